"""The HTTP API on an `rvqspec.runtime.Engine`, in the OpenAI API's shapes (FastAPI): the routes, the API key and Host
checks, and the streamed answers; what a request's fields mean and the error shape are protocol.py's.

    POST   /v1/audio/speech         text -> audio, streamed as it is decoded (`stream_format`: audio bytes or SSE)
    WS     /v1/audio/speech/stream  text in as it is written, audio out as it is decoded (stream.py)
    GET    /v1/models               the served model
    GET    /v1/audio/voices         built-in voices and registered clones
    POST   /v1/audio/voices         register a cloned voice (JSON: name, base64 audio clip, transcript)
    DELETE /v1/audio/voices/{name}  remove one
    GET    /health, /metrics        liveness; Prometheus text
    GET    /                        a page: a text box, the voices, a player

Every refusal is a JSON body in OpenAI's error shape (protocol.ApiError), the server's own failures included. Against
pages in a browser: a body is parsed only when its Content-Type is JSON (a cross-site "simple" request, sent without a
preflight, never is: 415), and the Host header must name this server (an IP address, localhost or an --allowed-hosts
name: a DNS-rebinding page's Host is its own domain: 421). A WebSocket gets the same checks (its API key in the
Authorization header, or from a browser as the subprotocol "bearer.<key>"), and a browser's Origin must be this
server's (no CORS protects a WebSocket); a refusal is an `error` message and a close.

The engine's request iterators block, so they are read in worker threads, which only wait for the chunks the
engine's codec workers make (within its thread budget); the event loop only moves bytes.
"""

import asyncio
import hmac
import ipaddress
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib import resources

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from rvqspec.core.errors import RvqspecError
from rvqspec.serve import BODY_SECONDS, STALL_SECONDS
from rvqspec.serve.audio import flac_bytes, pcm_bytes, sse_delta, sse_event, wav_header
from rvqspec.serve.metrics import Metrics
from rvqspec.serve.protocol import MAX_INPUT, ApiError, Speech, VoiceUpload, json_object, parse_speech, parse_voice
from rvqspec.serve.stream import Limits, Sessions, next_chunk, refuse_websocket, submit
from rvqspec.serve.voices import StoreFull, VoiceExists, VoiceStore

log = logging.getLogger("uvicorn.error")  # uvicorn's configured logger: one line per event on the server's stderr

MAX_SPEECH_BODY = 64 * 1024  # bytes of a speech request
MAX_VOICE_BODY = 16 * 1024 * 1024  # bytes of a voice registration (a base64 clip of up to 60 s)
CLOSE = {"Connection": "close"}
CLIENT_CLOSED = 499  # nginx's status for a client that left before its answer (logs and /metrics)
OPEN_PATHS = {"/health", "/"}  # no API key asked: liveness, and the page (static; it asks for the key itself)


# ---------------------------------------------------------------- reading a request's body

async def read_json(request: Request, limit: int, seconds: float) -> dict:
    """The body as a JSON object (`json_object`): refused unless its Content-Type is JSON (415), past `limit` bytes
    (counted as it arrives, whatever Content-Length says: 413), or when it has not all arrived within `seconds` (408);
    a client that leaves while sending it gets CLIENT_CLOSED (it is not there to read it: the status is for the
    logs)."""
    media = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media != "application/json":
        raise ApiError(415, f"Content-Type is {media[:80]!r}, not JSON: send the body with 'Content-Type: "
                       "application/json'", code="unsupported_media_type")
    # the rest of such a body is never read: the connection closes after the answer
    too_big = ApiError(413, f"the request body is over {limit} bytes: send less (input is capped at {MAX_INPUT} "
                            "characters)", code="body_too_large", headers=CLOSE)
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_big
    data = bytearray()
    try:
        with anyio.fail_after(seconds):
            async for part in request.stream():
                data += part
                if len(data) > limit:
                    raise too_big
    except TimeoutError:
        raise ApiError(408, f"the body did not arrive within {seconds:g} s: send it whole and at once (a "
                       "Content-Length that matches the bytes sent)", code="body_timeout", headers=CLOSE) from None
    except ClientDisconnect:
        log.info("%s %s: the client closed the connection while sending its body", request.method,
                 request.url.path)
        raise ApiError(CLIENT_CLOSED, "the client closed the connection while sending its body",
                       code="client_closed") from None
    return json_object(data)


# ---------------------------------------------------------------- the audio of one request

async def audio_bytes(synthesis, response_format: str, sample_rate: int, metrics: Metrics) -> AsyncIterator[bytes]:
    """The response body: the format's bytes as chunks are decoded (the wav header leaves with the first)."""
    chunks, start = iter(synthesis), time.perf_counter()
    if response_format == "flac":
        data = await anyio.to_thread.run_sync(flac_bytes, chunks, sample_rate, abandon_on_cancel=True)
        if synthesis.first_audio_seconds is not None:
            metrics.observe_first_audio(synthesis.first_audio_seconds)
        yield data
        return
    header = wav_header(sample_rate) if response_format == "wav" else b""
    while (chunk := await next_chunk(chunks)) is not None:
        if header is not None:
            metrics.observe_first_audio(synthesis.first_audio_seconds or time.perf_counter() - start)
        yield (header or b"") + pcm_bytes(chunk)
        header = None
    if header:  # no audio at all: still a valid (empty) wav
        yield header


async def sse(pieces: AsyncIterator[bytes], synthesis) -> AsyncIterator[bytes]:
    async for data in pieces:
        yield sse_delta(data)
    yield sse_event({"type": "speech.audio.done", "end_reason": end_reason(synthesis)})


def end_reason(synthesis) -> str:
    """How the synthesis ended (runtime/request.py's END_REASONS); one still decoding was cancelled by the server."""
    return synthesis.end_reason if synthesis.done and synthesis.end_reason else "cancelled"


def record_end(synthesis, metrics: Metrics) -> None:
    """Count the synthesis's end; a cut one (its frame budget spent) is logged."""
    reason = end_reason(synthesis)
    metrics.count_end(reason)
    if reason == "length":
        log.warning("speech request cut at its frame budget (%d frames): the model did not end it; pass a larger "
                    "max_tokens if the text needs it", len(synthesis.decoded))


async def cancel_on_disconnect(request: Request, synthesis) -> None:
    """Cancel the synthesis once the client is gone (waiting for its first chunk or reading the stream)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    synthesis.cancel()


async def respond(request: Request, synthesis, speech: Speech, sample_rate: int, metrics: Metrics,
                  stall_seconds: float) -> StreamingResponse:
    """Stream the synthesis's audio (the engine's request). Its first piece is awaited before the response starts, so
    that a request that fails before any audio gets a JSON error, and the first bytes leave with the first chunk. A
    client that takes no piece for `stall_seconds` is cut off (`AudioResponse`)."""
    watcher = asyncio.create_task(cancel_on_disconnect(request, synthesis))
    pieces = audio_bytes(synthesis, speech.response_format, sample_rate, metrics)
    if speech.stream_format == "sse":
        pieces = sse(pieces, synthesis)

    def stop() -> None:
        watcher.cancel()
        synthesis.cancel()  # a no-op once it is done; frees its row when the client left or the server stops
        record_end(synthesis, metrics)

    async def body() -> AsyncIterator[bytes]:
        try:
            yield first
            async for piece in pieces:
                yield piece
        finally:
            stop()
            await pieces.aclose()

    try:
        first = await anext(pieces, b"")
    except Exception as e:  # the synthesis failed before any audio: its error, logged in one line
        stop()
        log.error("speech request failed: %s: %s", type(e).__name__, e)
        why = f" ({e})" if isinstance(e, RvqspecError) else ""  # the engine's own words; never another's repr
        raise ApiError(500, f"synthesis failed{why}: the server logged it; retry, or report it",
                       kind="server_error") from None
    except BaseException:
        stop()
        raise
    return AudioResponse(body(), synthesis, metrics, stall_seconds, media_type=speech.media_type,
                         headers=audio_headers(synthesis, sample_rate))


class ClientStalled(Exception):
    pass


class AudioResponse(StreamingResponse):
    """A synthesis's streamed answer whose client must take each piece within `stall_seconds`: for one that stopped
    reading (its socket buffer full, uvicorn's write waiting) the synthesis is cancelled (its row freed), the stall
    logged and counted, and the answer ends unfinished (uvicorn then closes the connection), so that a stalled client
    holds its row a bounded time."""

    def __init__(self, content, synthesis, metrics: Metrics, stall_seconds: float, **kwargs):
        super().__init__(content, **kwargs)
        self.synthesis, self.metrics, self.stall_seconds = synthesis, metrics, stall_seconds

    def on_stall(self) -> None:
        log.warning("a client took no audio for %g s (it stopped reading): its request is cancelled and its "
                    "connection closed", self.stall_seconds)
        self.metrics.stalled.inc()
        self.synthesis.cancel()

    async def stream_response(self, send) -> None:
        async def timed(message) -> None:
            with anyio.move_on_after(self.stall_seconds):
                return await send(message)
            raise ClientStalled

        try:
            await super().stream_response(timed)
        except ClientStalled:
            self.on_stall()
            await self.body_iterator.aclose()


def audio_headers(synthesis, sample_rate: int) -> dict:
    """The sample rate; and `X-End-Reason` where decoding ended before the response starts (flac, which is encoded
    whole; a short wav or pcm): a stream still decoding cannot know it yet (SSE's done event and /metrics say it)."""
    headers = {"X-Sample-Rate": str(sample_rate)}
    if synthesis.done and synthesis.end_reason:
        headers["X-End-Reason"] = synthesis.end_reason
    return headers


# ---------------------------------------------------------------- the app

def create_app(engine, voices: VoiceStore, api_key: str | None = None, threads: int = 64,
               allowed_hosts: tuple[str, ...] = (), body_seconds: float = BODY_SECONDS,
               stall_seconds: float = STALL_SECONDS, limits: Limits = Limits()):
    """The ASGI app serving `engine` (an `rvqspec.runtime.Engine`), cloned voices kept in `voices`. `threads`: worker
    threads for reading requests' audio (each decoding or waiting request holds one while it waits for a chunk);
    `allowed_hosts`: host names the Host header may give besides addresses and localhost ("*": any); a body must
    arrive within `body_seconds`, a streaming client take each piece of audio within `stall_seconds`; `limits`: the
    WebSocket sessions' caps (stream.Limits)."""
    @asynccontextmanager
    async def lifespan(app):
        anyio.to_thread.current_default_thread_limiter().total_tokens = threads
        yield

    app = FastAPI(title="rvqspec", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    metrics = Metrics(engine)
    add_error_handlers(app)
    add_info_routes(app, engine, metrics)
    add_voice_routes(app, engine, voices, body_seconds)
    add_speech_route(app, engine, voices, metrics, body_seconds, stall_seconds)
    sessions = Sessions(engine, voices, metrics, limits)
    app.add_api_websocket_route("/v1/audio/speech/stream", sessions.serve)
    return Gate(app, metrics, api_key, allowed_hosts)


def add_error_handlers(app: FastAPI) -> None:
    """Every error answered in OpenAI's shape: ours as raised, Starlette's (404, 405) with the fix, any other 500."""
    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        return e.response()

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        fix = {404: ": the endpoints are /v1/audio/speech, /v1/audio/voices, /v1/models, /health, /metrics",
               405: ": see the endpoints' methods in docs/serving.md"}.get(e.status_code, "")
        return ApiError(e.status_code, f"{e.detail} ({request.method} {request.url.path}){fix}").response()

    @app.exception_handler(Exception)
    async def internal_error(request, e: Exception):
        log.error("%s %s failed: %s: %s", request.method, request.url.path, type(e).__name__, e)
        return ApiError(500, "internal error: the server logged it; retry, or report it",
                        kind="server_error").response()


def add_info_routes(app: FastAPI, engine, metrics: Metrics) -> None:
    """/, /health, /metrics and /v1/models."""
    page = resources.files("rvqspec.serve").joinpath("page/index.html").read_text()
    created = int(time.time())

    @app.get("/", response_class=HTMLResponse)
    async def index():
        return page

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        return {"status": "ok", "model": engine.name}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.text(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": engine.name, "object": "model", "created": created,
                                            "owned_by": "rvqspec"}]}


def add_voice_routes(app: FastAPI, engine, voices: VoiceStore, body_seconds: float) -> None:
    """GET and POST /v1/audio/voices, DELETE /v1/audio/voices/{name}."""
    @app.get("/v1/audio/voices")
    async def list_voices():
        entries = [(name, "builtin") for name in engine.voices()] + [(name, "cloned") for name in voices.names()]
        return {"object": "list", "data": [{"id": name, "object": "voice", "kind": kind} for name, kind in entries]}

    @app.post("/v1/audio/voices", status_code=201)
    async def register_voice(request: Request):
        if not engine.can_clone:
            raise ApiError(400, f"the served model ({engine.name}) cannot clone voices: serve a Qwen3-TTS Base "
                           "checkpoint (rvqspec serve --model PATH)", code="cannot_clone")
        upload = parse_voice(await read_json(request, MAX_VOICE_BODY, body_seconds), engine.voices())
        await register(voices, upload, engine)
        return {"id": upload.name, "object": "voice", "kind": "cloned"}

    @app.delete("/v1/audio/voices/{name}")
    async def delete_voice(name: str):
        if name in engine.voices():
            raise ApiError(400, f"{name[:80]!r} is a built-in voice of the model: only registered voices can be "
                           "deleted", param="name")
        if not await anyio.to_thread.run_sync(voices.delete, name):
            raise ApiError(404, f"no registered voice {name[:80]!r}: GET /v1/audio/voices lists them", param="name")
        return {"id": name, "object": "voice", "deleted": True}


async def register(voices: VoiceStore, upload: VoiceUpload, engine) -> None:
    """Store the voice (decoding the clip and making its clone prompt, in a worker thread): 507 past the quota, 409
    if the name is taken, 400 for a clip the store or the engine refuses."""
    try:
        await anyio.to_thread.run_sync(voices.register, upload.name, upload.clip, upload.transcript, engine)
    except StoreFull as e:
        raise ApiError(507, str(e), code="voices_quota") from None
    except VoiceExists as e:
        raise ApiError(409, str(e), param="audio") from None
    except RvqspecError as e:
        raise ApiError(400, str(e), param="audio") from None


def add_speech_route(app: FastAPI, engine, voices: VoiceStore, metrics: Metrics, body_seconds: float,
                     stall_seconds: float) -> None:
    """POST /v1/audio/speech."""
    @app.post("/v1/audio/speech")
    async def speech(request: Request):
        job = parse_speech(await read_json(request, MAX_SPEECH_BODY, body_seconds), engine, voices)
        synthesis = await submit(engine, voices, job)
        return await respond(request, synthesis, job, engine.sample_rate, metrics, stall_seconds)


class Gate:
    """The outermost layer of the app: the Host and API key checks, and the count of answers by status for
    /metrics."""

    def __init__(self, app, metrics: Metrics, api_key: str | None, allowed_hosts: tuple[str, ...] = ()):
        self.app, self.metrics = app, metrics
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.allowed_hosts = {"localhost", *(name.lower() for name in allowed_hosts)}

    async def __call__(self, scope, receive, send):
        if scope["type"] == "websocket":
            refusal = self.refusal(scope) or cross_origin(scope, self.allowed_hosts)
            if refusal is not None:
                return await refuse_websocket(refusal, scope, receive, send)
            return await self.app(scope, receive, send)
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counted(message):
            if message["type"] == "http.response.start":
                self.metrics.count_status(message["status"])
            await send(message)

        refusal = self.refusal(scope)
        if refusal is not None:
            return await refusal.response()(scope, receive, counted)
        await self.app(scope, receive, counted)

    def refusal(self, scope) -> ApiError | None:
        """The Host and API key checks (a WebSocket's key may come as the subprotocol "bearer.<key>")."""
        headers = dict(scope["headers"])
        host = headers.get(b"host")
        if host is not None and not host_allowed(host.decode("latin-1"), self.allowed_hosts):
            return ApiError(421, f"Host {host.decode('latin-1')[:80]!r} is not a name of this server: use its "
                            "address, or start it with --allowed-hosts NAME", code="host_not_allowed")
        if self.expected is not None and scope["path"] not in OPEN_PATHS:
            given = headers.get(b"authorization", b"")
            offered = [f"Bearer {p[len('bearer.'):]}".encode() for p in scope.get("subprotocols") or []
                       if p.startswith("bearer.")]
            if not any(hmac.compare_digest(key, self.expected) for key in [given, *offered]):  # constant time
                return ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>' "
                                "(the server's --api-key or RVQSPEC_API_KEY)", code="invalid_api_key")
        return None


def cross_origin(scope, allowed: set[str]) -> ApiError | None:
    """A browser's WebSocket from another site's page (its Origin is not this server): refused."""
    headers = dict(scope["headers"])
    origin, host = headers.get(b"origin"), headers.get(b"host", b"")
    if origin is None:
        return None
    origin_host = origin.decode("latin-1").partition("://")[2]
    if origin_host == host.decode("latin-1") or origin_host.rpartition(":")[0] in allowed or "*" in allowed:
        return None
    return ApiError(403, f"a page from {origin.decode('latin-1')[:80]!r} may not open this WebSocket: use the "
                    "server's own page, or a client that is not a browser", code="origin_not_allowed")


def host_allowed(host: str, allowed: set[str]) -> bool:
    """Whether a Host header (name[:port]) names this server: an IP address (a DNS-rebinding page's Host is its own
    domain name, never an address), or a name in `allowed` ("*": any)."""
    name = host[1:].partition("]")[0] if host.startswith("[") else host.rpartition(":")[0] if ":" in host else host
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return name.lower() in allowed or "*" in allowed
