"""`rvqspec serve`: an OpenAI-compatible speech server on the continuous-batching engine (`rvqspec.runtime.Engine`).

app (the endpoints, FastAPI), audio (response formats and server-sent events), voices (the cloned-voice registry),
metrics (Prometheus text), server (uvicorn, SIGTERM), page/index.html (the page at /). Needs `rvqspec[serve]`.
ray: the same app on Ray Serve, one Engine per replica (`rvqspec serve --ray`; needs `rvqspec[ray]`, imported only
there), and ray_proxy: Ray's proxy's own error answers in OpenAI's shape.
"""
