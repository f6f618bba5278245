"""Running the app with uvicorn: on a socket bound before the model loads (a taken port fails at once), until SIGTERM
or Ctrl-C.

On SIGTERM uvicorn stops accepting, lets in-flight responses finish for `grace` seconds, then cancels them (their
rows leave the batch); the engine is closed and the process exits 0.
"""

import signal
import socket
import sys

from rvqspec.serve.app import create_app
from rvqspec.serve.voices import VoiceStore


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: any free port; `sock.getsockname()[1]` says which)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def serve(engine, sock: socket.socket, voices: VoiceStore, api_key: str | None = None, grace: float = 30.0,
          threads: int = 64) -> None:
    """Serve `engine` on `sock` until SIGTERM or Ctrl-C; the engine is closed on the way out."""
    import uvicorn

    app = create_app(engine, voices, api_key, threads)
    server = uvicorn.Server(uvicorn.Config(app, timeout_graceful_shutdown=grace, log_level="info"))
    host, port = sock.getsockname()[:2]
    host = f"[{host}]" if ":" in host else host  # an IPv6 address in a URL
    print(f"rvqspec serve: {engine.name} on http://{host}:{port} (voices in {voices.folder})", flush=True)
    # uvicorn raises the signal it drained on once more when it is done; landing on a no-op handler, that SIGTERM
    # ends nothing: the process exits 0 (Ctrl-C keeps its KeyboardInterrupt).
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        server.run(sockets=[sock])
    finally:
        engine.close(grace=0)
        signal.signal(signal.SIGTERM, previous)
        sys.stdout.flush()
