"""`rvqspec serve`: an OpenAI-compatible speech server on the continuous-batching engine (`rvqspec.runtime.Engine`).

app (the endpoints, FastAPI: routes, API key and Host checks, streamed answers), protocol (OpenAI's request fields
checked, its error shape), audio (response formats and server-sent events), voices (the cloned-voice registry),
metrics (Prometheus text), server (uvicorn, SIGTERM), page/index.html (the page at /). Needs `rvqspec[serve]`.
ray: the same app on Ray Serve, one Engine per replica (`rvqspec serve --ray`; needs `rvqspec[ray]`, imported only
there), and ray_proxy: Ray's proxy's own error answers in OpenAI's shape.
"""

# Deadlines, here so that `rvqspec serve --help` shows them without importing the server (fastapi).
HEADER_SECONDS = 10.0  # a request's headers must arrive within this (server.py: the connection is closed)
BODY_SECONDS = 30.0  # a request's whole body must arrive within this (app.py: 408)
# A streaming client must take each piece of its audio within this: one that stopped reading (its socket buffer full)
# has its request cancelled, freeing its row, and its connection closed (app.py: AudioResponse). A client that plays
# at real time waits about a second per piece (uvicorn's 64 KiB write buffer: 1.4 s of 24 kHz 16-bit audio).
STALL_SECONDS = 30.0
