"""Running the app with uvicorn: on a socket bound before the model loads (a taken port fails at once), until SIGTERM
or Ctrl-C.

SIGTERM is handled from the start (`exiting_on_sigterm`: before the server runs, it exits 0 at once, nothing being in
flight); once the server runs, uvicorn stops accepting, lets in-flight responses finish for `grace` seconds, then
cancels them (their rows leave the batch); the engine is closed and the process exits 0. A request's headers must
arrive within `header_seconds` (uvicorn has no such deadline: a client trickling bytes held its connection forever),
its body within `body_seconds` (the app's `read_json`).
"""

import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from rvqspec.core.errors import RvqspecError
from rvqspec.serve import BODY_SECONDS, HEADER_SECONDS, STALL_SECONDS
from rvqspec.serve.app import create_app
from rvqspec.serve.voices import VoiceStore


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: any free port; `sock.getsockname()[1]` says which)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise RvqspecError(f"cannot listen on {host}: {e.strerror or e}: pass an address of this machine as --host") \
            from None
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise RvqspecError(f"cannot listen on {host} port {port}: {e.strerror or e}: pick another --port (or stop "
                           "what listens there)") from None
    return sock


@contextmanager
def exiting_on_sigterm() -> Iterator[None]:
    """Until the server runs (flags checked, the model loading), SIGTERM exits at once with status 0. The handler's
    SystemExit may land inside native code (safetensors reading the model), which turns it into an error of its own:
    once SIGTERM came, whatever error leaves the block is that exit. The handler stays until `serve` replaces it."""
    received = threading.Event()

    def stop(signum, frame) -> None:
        received.set()
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    try:
        yield
    except Exception:
        if received.is_set():
            sys.exit(0)
        raise


def serve(engine, sock: socket.socket, voices: VoiceStore, api_key: str | None = None, grace: float = 30.0,
          threads: int = 64, allowed_hosts: tuple[str, ...] = (), header_seconds: float = HEADER_SECONDS,
          body_seconds: float = BODY_SECONDS, stall_seconds: float = STALL_SECONDS) -> None:
    """Serve `engine` on `sock` until SIGTERM or Ctrl-C; the engine is closed on the way out."""
    import uvicorn

    app = create_app(engine, voices, api_key, threads, allowed_hosts, body_seconds, stall_seconds)
    server = uvicorn.Server(uvicorn.Config(app, timeout_graceful_shutdown=grace, log_level="info",
                                           http=header_deadline(header_seconds)))
    # From here SIGTERM drains: before uvicorn installs its own handler (and after it puts this one back), this one
    # tells it to stop; uvicorn raises the signal it drained on once more when it is done, which lands here and
    # ends nothing: the process exits 0 (Ctrl-C keeps its KeyboardInterrupt).
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: setattr(server, "should_exit", True))
    host, port = sock.getsockname()[:2]
    host = f"[{host}]" if ":" in host else host  # an IPv6 address in a URL
    print(f"rvqspec serve: {engine.name} on http://{host}:{port} (voices in {voices.folder})", flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        engine.close(grace=0)
        signal.signal(signal.SIGTERM, previous)
        sys.stdout.flush()


@contextmanager
def in_thread(app, host: str = "127.0.0.1") -> Iterator[int]:
    """`app` served by uvicorn in a thread of this process on a free port of `host` (a test's or a benchmark's
    server, beside its client), until the block ends; yields the port."""
    import uvicorn

    sock = bind(host, 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", ws="websockets"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(10)


def header_deadline(seconds: float):
    """uvicorn's h11 protocol, closing a connection whose next request's headers have not arrived `seconds` after
    it opened or after its last response (uvicorn's keep-alive timer stops at the first byte of them)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    return type("HeaderDeadline", (HeaderDeadline, H11Protocol), {"header_seconds": seconds, "h11_idle": h11.IDLE})


class HeaderDeadline:
    """The deadline's part of `header_deadline`'s protocol (mixed into uvicorn's H11Protocol there, so that uvicorn
    and h11 are imported only when a server runs): a timer armed while the connection waits for a request."""

    header_seconds: float
    h11_idle: object  # h11.IDLE: the client's state between requests
    deadline = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self.arm()

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not self.h11_idle:
            self.disarm()

    def connection_lost(self, exc) -> None:
        self.disarm()
        super().connection_lost(exc)

    def arm(self) -> None:
        self.disarm()
        if not self.transport.is_closing() and self.conn.their_state is self.h11_idle:
            self.deadline = self.loop.call_later(self.header_seconds, self.too_slow)

    def disarm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def too_slow(self) -> None:
        self.deadline = None
        if self.conn.their_state is self.h11_idle and not self.transport.is_closing():
            self.logger.info("closed a connection whose request headers took over %g s", self.header_seconds)
            self.transport.close()
