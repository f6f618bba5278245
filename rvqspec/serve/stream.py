"""The engine's requests as the server streams them (`submit`, `next_chunk`: the HTTP route's too), and the
WebSocket at /v1/audio/speech/stream: text in as it is written (an LLM's tokens), audio out as it is decoded,
in vLLM-Omni's message types so that its clients work unchanged (docs/live-speech.md has the protocol).

    client: {"type": "session.config", ...}  {"type": "input.text", "text": "..."}...  {"type": "input.done"}
    server: {"type": "audio.start", ...}  <binary audio frames>...  {"type": "audio.done", ...}
            {"type": "session.done", ...}, then it closes; or {"type": "error", "message": ..., "error": {...}}

A session is one request of the engine (one row of its continuous batch): in "token" mode (a dual-track model) the
row takes each text token as it arrives and waits, parked out of the batch, for the next; in "sentence" mode it
speaks each sentence as it completes. Whatever goes wrong ends the session with one `error` message (OpenAI's error
fields, and vLLM-Omni's `message`) and a close; the row is freed at the next frame, the other sessions go on.
"""

import asyncio
import json
import logging
import time
from dataclasses import dataclass

import anyio
from fastapi import WebSocket
from starlette.websockets import WebSocketDisconnect

from rvqspec.core.errors import RvqspecError
from rvqspec.runtime import QueueFull, TextStream
from rvqspec.serve.audio import pcm_bytes, wav_header
from rvqspec.serve.protocol import MAX_INPUT, ApiError, Speech, encodable, parse_speech

log = logging.getLogger("uvicorn.error")

SUBPROTOCOL = "rvqspec"  # what a browser offers beside "bearer.<key>" (it cannot send an Authorization header)
CONFIG_FIELDS = {"type", "model", "voice", "instructions", "language", "response_format", "seed", "temperature",
                 "top_k", "top_p", "speed", "mode"}
IGNORED_FIELDS = {"task_type", "stream_audio", "split_granularity", "initial_codec_chunk_frames", "max_new_tokens",
                  "non_streaming_mode"}  # vLLM-Omni's, with nothing to change here
RETRY_AFTER_SECONDS = 1  # what a 429 tells the client to wait
MAX_MESSAGE = 64 * 1024  # characters of one client message
POLICY, OVERLOADED, SERVER_ERROR = 1008, 1013, 1011  # WebSocket close codes


@dataclass(frozen=True)
class Limits:
    """A session's caps: characters of text in all, seconds to the session.config, seconds between two messages
    while text is still coming, sessions open at once."""

    max_text: int = 4 * MAX_INPUT
    config_seconds: float = 10.0
    idle_seconds: float = 30.0
    max_sessions: int = 32


class SessionError(ApiError):
    """What ends a session: its error message, then a close with `close_code`."""

    def __init__(self, message: str, code: str = "invalid_message", close_code: int = POLICY,
                 kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(400, message, param=param, code=code, kind=kind)
        self.close_code = close_code


def error_message(error: ApiError) -> dict:
    """The `error` message: vLLM-Omni's `message`, and OpenAI's error fields."""
    message = encodable(error.message)
    return {"type": "error", "message": message,
            "error": {"message": message, "type": error.kind, "param": encodable(error.param), "code": error.code}}


class Sessions:
    """The open sessions of an app (the cap), and how each runs."""

    def __init__(self, engine, voices, metrics, limits: Limits = Limits()):
        self.engine, self.voices, self.metrics, self.limits = engine, voices, metrics, limits
        self.open = 0

    async def serve(self, websocket: WebSocket) -> None:
        offered = websocket.scope.get("subprotocols") or []
        await websocket.accept(subprotocol=SUBPROTOCOL if SUBPROTOCOL in offered else None)
        if self.open >= self.limits.max_sessions:
            return await end(websocket, SessionError(
                f"{self.limits.max_sessions} sessions are open, the most this server takes: retry later",
                code="too_many_sessions", close_code=OVERLOADED, kind="rate_limit_error"))
        self.open += 1
        try:
            await self.session(websocket)
        finally:
            self.open -= 1

    async def session(self, websocket: WebSocket) -> None:
        synthesis, text = None, TextStream()
        try:
            config = await receive(websocket, self.limits.config_seconds, "session.config")
            job, mode = self.parse_config(config)
            job.args["text"] = text
            synthesis = await start(self.engine, self.voices, job)
            reply = dict(model=self.engine.name, mode=mode, format=job.response_format)
            await converse(websocket, synthesis, text, reply, self.limits, self.metrics, self.engine.status)
        except ApiError as e:
            await end(websocket, e)
        except WebSocketDisconnect:
            log.info("speech stream: the client left")
        except Exception as e:  # ours: logged, answered in one line
            log.error("speech stream failed: %s: %s", type(e).__name__, e)
            await end(websocket, SessionError("internal error: the server logged it; retry, or report it",
                                              code=None, close_code=SERVER_ERROR, kind="server_error"))
        finally:
            text.end()
            if synthesis is not None:
                synthesis.cancel()  # a no-op once done; a client gone or an error frees the row at the next frame

    def parse_config(self, config: dict) -> tuple:
        """(the checked speech request, the mode) of a session.config message."""
        if config.get("type") != "session.config":
            raise SessionError(f"the first message must be session.config, got {describe(config)}", param="type")
        for name in ("ref_audio", "ref_text", "speaker_embedding"):
            if config.get(name) is not None:
                raise SessionError(f"{name} is not taken here: register the voice (POST /v1/audio/voices) and send "
                                   "its name as voice", param=name)
        unknown = sorted(set(config) - CONFIG_FIELDS - IGNORED_FIELDS)
        if unknown:
            raise SessionError(f"unknown session.config field {unknown[0][:80]!r}: the fields are "
                               f"{', '.join(sorted(CONFIG_FIELDS - {'type'}))}", param=unknown[0][:80])
        fields = {k: v for k, v in config.items() if k not in IGNORED_FIELDS}
        mode = fields.pop("mode", None) or self.engine.text_mode
        if mode not in ("token", "sentence") or mode != self.engine.text_mode:
            raise SessionError(f"mode {str(mode)[:40]!r} is not served: {self.engine.name} speaks text as it arrives "
                               f"in {self.engine.text_mode!r} mode", param="mode")
        fields.pop("type")
        body = {"model": self.engine.name, **fields, "input": "-"}  # the text comes later
        try:
            job = parse_speech(body, self.engine, self.voices)
        except ApiError as e:
            raise SessionError(e.message, code=e.code or "invalid_request", param=e.param) from None
        if job.response_format not in ("pcm", "wav"):
            raise SessionError(f"response_format {job.response_format!r} does not stream: use 'pcm' or 'wav'",
                               param="response_format")
        return job, mode


def describe(message: dict) -> str:
    kind = message.get("type")
    return repr(kind[:40]) if isinstance(kind, str) else "a message without a type"


async def receive(websocket: WebSocket, seconds: float | None, waiting_for: str) -> dict:
    """The next client message, a JSON object in a text frame within `seconds`; SessionError otherwise."""
    try:
        message = await asyncio.wait_for(websocket.receive(), seconds)
    except TimeoutError:
        raise SessionError(f"no message for {seconds:g} s while waiting for {waiting_for}: the session is closed; "
                           "send input.done when the text is complete", code="idle_timeout") from None
    if message["type"] == "websocket.disconnect":
        raise WebSocketDisconnect(message.get("code", 1000))
    raw = message.get("text")
    if raw is None:
        raise SessionError("binary frames are not taken: send JSON messages in text frames", code="binary_frame")
    if len(raw) > MAX_MESSAGE:
        raise SessionError(f"a message is over {MAX_MESSAGE} characters: send the text in smaller pieces",
                           code="message_too_large")
    try:
        parsed = json.loads(raw)
    except (ValueError, RecursionError):
        raise SessionError("a message is not valid JSON: send JSON objects") from None
    if not isinstance(parsed, dict):
        raise SessionError(f"a message is a JSON {type(parsed).__name__}, not an object: send {{\"type\": ...}}")
    return parsed


# ---------------------------------------------------------------- the engine's requests (HTTP and WebSocket)

async def next_chunk(chunks):
    """The request's next audio chunk (None at the end), read in a worker thread; cancelling the caller does not
    wait for the chunk."""
    return await anyio.to_thread.run_sync(next, chunks, None, abandon_on_cancel=True)


async def submit(engine, voices, job: Speech):
    """The engine's request (a synthesis) for `job`, a registered voice's clone prompt fetched first: 429 when the
    engine's queue is full, 400 for what the engine refuses."""
    try:
        if job.clone:
            job.args["clone"] = await anyio.to_thread.run_sync(voices.prompt, job.clone, engine)
        return engine.speech(**job.args)
    except QueueFull as e:
        raise ApiError(429, f"{e}", code="queue_full", kind="rate_limit_error",
                       headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
    except RvqspecError as e:
        raise ApiError(400, str(e)) from None
    except FileNotFoundError:  # deleted since the request was checked
        raise ApiError(400, f"voice {job.clone!r} was just deleted: register it again", param="voice") from None


async def start(engine, voices, job):
    """The engine's request for the session (in a worker thread: a prompt is built by upstream's own code)."""
    try:
        return await submit(engine, voices, job)
    except ApiError as e:
        raise SessionError(e.message, code=e.code or "invalid_request", param=e.param,
                           close_code=OVERLOADED if e.status == 429 else POLICY, kind=e.kind) from None


async def converse(websocket: WebSocket, synthesis, text: TextStream, reply: dict, limits: Limits, metrics,
                   status) -> None:
    """The text in, the audio out, at once; the session's end messages once the audio is whole (audio.done with
    ours: the engine's tokens per step, `status()`'s)."""
    heard: list[str] = []  # the text so far (audio.start's sentence_text)
    reader = asyncio.create_task(read_text(websocket, text, heard, limits))
    writer = asyncio.create_task(send_audio(websocket, synthesis, heard, reply, metrics))
    try:
        done, _ = await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            task.result()  # the first error (or the reader's end: the client left)
        total = writer.result()
    finally:
        for task in (reader, writer):
            task.cancel()
        await asyncio.gather(reader, writer, return_exceptions=True)
    await websocket.send_json({"type": "audio.done", "utterance_index": 0, "sentence_index": 0, "total_bytes": total,
                               "error": False, "tokens_per_step": status()["tokens_per_step"]})
    await websocket.send_json({"type": "session.done", "utterance_index": 0, "total_sentences": 1})
    await websocket.close()


async def read_text(websocket: WebSocket, text: TextStream, heard: list[str], limits: Limits) -> None:
    """input.text pieces into `text` until input.done (within the caps and the idle timeout), then refuse more."""
    received, ended = 0, False
    while True:
        message = await receive(websocket, None if ended else limits.idle_seconds, "input.text or input.done")
        kind = message.get("type")
        if ended:
            raise SessionError(f"{describe(message)} after input.done: a session speaks one text; open another "
                               "session for the next", code="input_done")
        if kind == "input.done":
            text.end()
            ended = True
        elif kind == "input.text":
            piece = message.get("text")
            if not isinstance(piece, str):
                raise SessionError("input.text needs a string \"text\"", param="text")
            received += len(piece)
            if received > limits.max_text:
                raise SessionError(f"the text is over {limits.max_text} characters: split it into several sessions",
                                   code="text_too_long", param="text")
            write(text, piece)
            heard.append(piece)
        else:
            raise SessionError(f"unknown message type {describe(message)}: send input.text, then input.done",
                               param="type")


def write(text: TextStream, piece: str) -> None:
    try:
        text.write(piece)
    except RvqspecError as e:
        raise SessionError(str(e), param="text") from None


async def send_audio(websocket: WebSocket, synthesis, heard: list[str], reply: dict, metrics) -> int:
    """audio.start with the first chunk, then each chunk as a binary frame (pcm s16le; wav: the header first);
    the bytes sent."""
    chunks, total, started = iter(synthesis), 0, time.perf_counter()
    header = wav_header(synthesis.sample_rate) if reply["format"] == "wav" else b""
    while True:
        try:
            chunk = await next_chunk(chunks)
        except RvqspecError as e:
            raise SessionError(f"synthesis failed ({e})", code="synthesis_failed", close_code=SERVER_ERROR,
                               kind="server_error") from None
        if chunk is None:
            return total
        if total == 0:
            metrics.observe_first_audio(synthesis.first_audio_seconds or time.perf_counter() - started)
            await websocket.send_json({"type": "audio.start", "utterance_index": 0, "sentence_index": 0,
                                       "sentence_text": "".join(heard),
                                       "sample_rate": synthesis.sample_rate, "channels": 1, **reply})
        data = header + pcm_bytes(chunk)
        header = b""
        total += len(data)
        await websocket.send_bytes(data)


async def refuse_websocket(error: ApiError, scope, receive, send) -> None:
    """A WebSocket the Gate refuses (Host, API key, Origin): accepted, told why, closed."""
    if (await receive())["type"] == "websocket.connect":
        offered = scope.get("subprotocols") or []
        await send({"type": "websocket.accept", "subprotocol": SUBPROTOCOL if SUBPROTOCOL in offered else None})
        await send({"type": "websocket.send", "text": json.dumps(error_message(error))})
        await send({"type": "websocket.close", "code": POLICY})


async def end(websocket: WebSocket, error: ApiError) -> None:
    """Send the error message and close (the client may have gone already)."""
    try:
        await websocket.send_json(error_message(error))
        await websocket.close(getattr(error, "close_code", POLICY))
    except Exception:
        pass
