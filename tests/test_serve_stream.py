"""The WebSocket at /v1/audio/speech/stream (issue 52) through the real `websockets` client, on a tiny Qwen3-TTS
served in-process: vLLM-Omni's message types and the engine's audio for the seed whatever the pieces; bad input
(binary frames, unknown types, text after input.done, the idle timeout, oversized text, a lone surrogate, no
session.config, a wrong key, another site's page, too many sessions), each one `error` message in OpenAI's shape and
a closed session while another session goes on unchanged; a client that leaves frees its row."""

import asyncio
import base64
import contextlib
import json
import os
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from helpers.browser import Browser, chromium
from helpers.upstream_models import upstream_available

if not upstream_available():
    pytest.skip("qwen-tts reference not installed: run `make install`", allow_module_level=True)

from websockets.asyncio.client import connect  # noqa: E402
from websockets.exceptions import ConnectionClosed  # noqa: E402

from helpers.upstream_tts import tiny_qwen3_tts  # noqa: E402
from rvqspec.core.errors import RvqspecError  # noqa: E402
from rvqspec.runtime import Engine  # noqa: E402
from rvqspec.serve.app import create_app  # noqa: E402
from rvqspec.serve.audio import to_int16  # noqa: E402
from rvqspec.serve.server import in_thread  # noqa: E402
from rvqspec.serve.stream import Limits  # noqa: E402
from rvqspec.serve.voices import VoiceStore  # noqa: E402

KEY = "sesame"
TEXT = "hello there, how are you?"
CONFIG = {"type": "session.config", "voice": "tiny", "language": "English", "response_format": "pcm", "seed": 3}
LIMITS = Limits(max_text=200, config_seconds=2.0, idle_seconds=1.0, max_sessions=4)


@contextlib.contextmanager
def serving(engine, voices: Path, limits: Limits = LIMITS):
    """The WebSocket's URL of an app serving `engine` on a loopback port, in a thread."""
    app = create_app(engine, VoiceStore(voices), api_key=KEY, limits=limits)
    try:
        with in_thread(app) as port:
            yield f"ws://127.0.0.1:{port}/v1/audio/speech/stream"
    finally:
        engine.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(the WebSocket's URL, the engine): a tiny Qwen3-TTS CustomVoice (token mode)."""
    engine = Engine(tiny_qwen3_tts(seed=1), drafter=None, max_batch=4)
    with serving(engine, tmp_path_factory.mktemp("voices")) as url:
        yield url, engine


def session(url: str, **options):
    return connect(url, additional_headers={"Authorization": f"Bearer {KEY}"}, **options)


async def speak(websocket, pieces: list[str], config: dict = CONFIG) -> tuple[list[dict], bytes]:
    """Send a whole session; (the JSON messages, the audio bytes) until the server closes."""
    await websocket.send(json.dumps(config))
    for piece in pieces:
        await websocket.send(json.dumps({"type": "input.text", "text": piece}))
        await asyncio.sleep(0.005)
    await websocket.send(json.dumps({"type": "input.done"}))
    return await until_closed(websocket)


async def until_closed(websocket) -> tuple[list[dict], bytes]:
    messages, audio = [], b""
    try:
        async for frame in websocket:
            if isinstance(frame, bytes):
                audio += frame
            else:
                messages.append(json.loads(frame))
    except ConnectionClosed:  # closed with an error code
        pass
    return messages, audio


def expected(engine) -> bytes:
    request = engine.speech(iter([TEXT]), voice="tiny", language="English", seed=3)
    return to_int16(request.audio()).tobytes()


def test_a_session_speaks_the_engines_audio_in_vllm_omnis_messages(served):
    url, engine = served

    async def run():
        async with session(url) as websocket:
            return await speak(websocket, ["hel", "lo the", "re, how", " are you?"])

    messages, audio = asyncio.run(run())
    assert [m["type"] for m in messages] == ["audio.start", "audio.done", "session.done"]
    start, done, end = messages
    assert start["mode"] == "token" and start["model"] == engine.name and start["format"] == "pcm"
    assert start["sample_rate"] == engine.sample_rate and start["channels"] == 1
    assert start["utterance_index"] == start["sentence_index"] == 0
    assert done["total_bytes"] == len(audio) and done["error"] is False and end["total_sentences"] == 1
    assert len(audio) > 0 and audio == expected(engine)


def test_the_http_route_with_non_streaming_mode_false_is_the_websockets_audio(served):
    """POST /v1/audio/speech keeps upstream's default prompt (custom voice: the whole text, non_streaming_mode true);
    with non_streaming_mode false it runs the dual-track prompt, and its audio is the WebSocket's bit for bit."""
    url, engine = served
    speech = url.replace("ws://", "http://").replace("/speech/stream", "/speech")
    body = {"model": engine.name, "input": TEXT, "voice": "tiny", "language": "English", "response_format": "pcm",
            "seed": 3}

    def post(**extra) -> bytes:
        response = httpx.post(speech, json={**body, **extra}, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
        assert response.status_code == 200, response.text
        return response.content

    async def run():
        async with session(url) as websocket:
            return await speak(websocket, ["hello th", "ere, how are", " you?"])

    live = asyncio.run(run())[1]
    whole = to_int16(engine.speech(TEXT, voice="tiny", language="English", seed=3).audio()).tobytes()
    assert len(live) > 0 and post(non_streaming_mode=False) == live
    assert post() == post(non_streaming_mode=True) == whole != live  # upstream's default: the whole-text prompt
    with pytest.raises(RvqspecError, match="dual-track prompt"):  # text that arrives over time has no other
        engine.speech(iter([TEXT]), voice="tiny", non_streaming_mode=True)


BAD = {  # case: (what the client sends after connecting, the error's code)
    "binary frame": ([CONFIG, b"\x00\x01"], "binary_frame"),
    "unknown type": ([CONFIG, {"type": "input.speak"}], "invalid_message"),
    "text after input.done": ([CONFIG, {"type": "input.text", "text": "hello"}, {"type": "input.done"},
                               {"type": "input.text", "text": "more"}], "input_done"),
    "idle timeout": ([CONFIG, {"type": "input.text", "text": "hello"}], "idle_timeout"),
    "oversized text": ([CONFIG, {"type": "input.text", "text": "a" * 201}], "text_too_long"),
    "lone surrogate": ([CONFIG, '{"type": "input.text", "text": "a\\ud800"}'], "invalid_message"),
    "no session.config": ([{"type": "input.text", "text": "hello"}], "invalid_message"),
    "not json": ([CONFIG, "{nope"], "invalid_message"),
    "unknown config field": ([dict(CONFIG, colour="red")], "invalid_message"),
    "unknown voice": ([dict(CONFIG, voice="nobody")], "invalid_request"),
    "mode the model has not": ([dict(CONFIG, mode="sentence")], "invalid_message"),
}


async def refused(url: str, sends: list, **options) -> dict:
    """The one error message a session gets for `sends`; the server closed it after."""
    async with connect(url, **options) as websocket:
        for item in sends:
            await websocket.send(item if isinstance(item, (bytes, str)) else json.dumps(item))
        messages, audio = await asyncio.wait_for(until_closed(websocket), 30)
    errors = [m for m in messages if m["type"] == "error"]
    assert len(errors) == 1 and messages[-1] is errors[0], messages
    assert websocket.close_code in (1008, 1013)
    return errors[0]


def test_bad_input_gets_one_error_and_a_closed_session_while_another_goes_on(served):
    url, engine = served
    headers = {"additional_headers": {"Authorization": f"Bearer {KEY}"}}

    async def each_refused():
        return {case: await refused(url, sends, **headers) for case, (sends, _) in BAD.items()}

    async def run():
        async with session(url) as good:
            await good.send(json.dumps(CONFIG))
            await good.send(json.dumps({"type": "input.text", "text": "hel"}))
            bad = asyncio.create_task(each_refused())
            while not bad.done():  # within the idle timeout: empty pieces (no text yet)
                await good.send(json.dumps({"type": "input.text", "text": ""}))
                await asyncio.wait([bad], timeout=0.3)
            errors = bad.result()
            await good.send(json.dumps({"type": "input.text", "text": TEXT[3:]}))
            await good.send(json.dumps({"type": "input.done"}))
            return errors, await until_closed(good)

    errors, (messages, audio) = asyncio.run(run())
    for case, (_, code) in BAD.items():
        error = errors[case]
        assert error["error"]["code"] == code and error["error"]["message"] == error["message"], case
        assert error["error"]["type"] == "invalid_request_error" and "Traceback" not in error["message"], case
    assert "surrogate" in errors["lone surrogate"]["message"] and "voice" in errors["unknown voice"]["message"]
    assert [m["type"] for m in messages][-1] == "session.done" and audio == expected(engine)
    wait_for_rows(engine, 0)


def test_the_key_the_origin_and_the_session_cap_are_checked(served):
    url, engine = served

    async def run():
        keyless = await refused(url, [])
        wrong = await refused(url, [], additional_headers={"Authorization": "Bearer nope"})
        foreign = await refused(url, [], additional_headers={"Authorization": f"Bearer {KEY}"},
                                origin="http://evil.example")
        async with connect(url, subprotocols=["rvqspec", f"bearer.{KEY}"]) as browser:  # a page's way to the key
            assert browser.subprotocol == "rvqspec"
            messages, audio = await speak(browser, [TEXT])
        opened = [await session(url).__aenter__() for _ in range(LIMITS.max_sessions)]
        full = await refused(url, [], additional_headers={"Authorization": f"Bearer {KEY}"})
        for websocket in opened:
            await websocket.close()
        return keyless, wrong, foreign, messages, full

    keyless, wrong, foreign, messages, full = asyncio.run(run())
    assert keyless["error"]["code"] == wrong["error"]["code"] == "invalid_api_key"
    assert foreign["error"]["code"] == "origin_not_allowed"
    assert messages[-1]["type"] == "session.done"
    assert full["error"]["code"] == "too_many_sessions" and full["error"]["type"] == "rate_limit_error"


def test_a_client_that_leaves_mid_text_frees_its_row(served):
    url, engine = served

    async def run():
        async with session(url) as websocket:
            await websocket.send(json.dumps(CONFIG))
            await websocket.send(json.dumps({"type": "input.text", "text": "hello there, how"}))
            start = json.loads(await asyncio.wait_for(websocket.recv(), 60))
            assert start["type"] == "audio.start"
            assert engine.status()["active"] == 1

    asyncio.run(run())
    wait_for_rows(engine, 0)


def wait_for_rows(engine, rows: int, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while engine.status()["active"] != rows:
        assert time.monotonic() < deadline, engine.status()
        time.sleep(0.02)
    assert np.isfinite(engine.status()["audio_seconds"])


@pytest.mark.skipif(chromium() is None and not os.environ.get("CI"), reason="no chromium (apt install "
                    "chromium-headless-shell); in CI (CI set) a missing browser fails instead")
def test_the_pages_live_mode_speaks_as_it_types_in_headless_chromium(served, tmp_path):
    """The page at / in live mode types its text a few characters at a time over the WebSocket (the key as a
    subprotocol) and plays the audio as it arrives: the model and mode, first audio, real-time factor and tokens per
    step shown, the waveform drawn; a screenshot kept (RVQSPEC_ARTIFACTS, else the test's folder)."""
    url, engine = served
    page = url.replace("ws://", "http://").replace("/v1/audio/speech/stream", "/")
    browser = Browser(chromium())
    try:
        browser.open(f"{page}?key={KEY}&voice=tiny&text=hello%20there%2C%20how%20are%20you%3F&autoplay=1&live=1")
        status = browser.wait_for('document.getElementById("status").textContent', "done", timeout=120)
        info = browser.wait_for('document.getElementById("info").textContent', "model", timeout=5)
        inked = browser.wait_for("String(Array.from(document.getElementById('wave').getContext('2d')"
                                 ".getImageData(0, 0, 640, 80).data).some((v, i) => i % 4 == 3 && v > 0))", "true")
        shot = Path(os.environ.get("RVQSPEC_ARTIFACTS", tmp_path)) / "page-live.png"
        shot.parent.mkdir(parents=True, exist_ok=True)
        shot.write_bytes(base64.b64decode(browser.call("Page.captureScreenshot", format="png")["data"]))
    finally:
        browser.close()
    assert status.startswith("done: ") and f"at {engine.sample_rate} Hz, first audio after" in status, status
    assert info.startswith(f"model {engine.name} (token mode, live): first audio") and "tokens/step" in info, info
    assert "real-time factor" in info and inked == "true"
    assert shot.read_bytes().startswith(b"\x89PNG")


def test_the_stand_in_speaks_a_session_in_sentence_mode(tmp_path):
    """A model without dual-track text: the session is spoken sentence by sentence as each completes, one stream
    (one audio.start in "sentence" mode), the audio the engine's passage of the whole text for the seed."""
    text = "Hello there. How are you today? I am fine."
    engine = Engine("standin", max_batch=2)
    want = to_int16(engine.speech(text, voice="en", seed=3, sentences=True).audio()).tobytes()
    with serving(engine, tmp_path / "voices", Limits()) as url:  # the default timeouts: a slow machine's margin
        async def run():
            async with session(url) as websocket:
                return await speak(websocket, [text[i:i + 4] for i in range(0, len(text), 4)],
                                   dict(CONFIG, voice="en", language=None))

        messages, audio = asyncio.run(run())
    assert [m["type"] for m in messages] == ["audio.start", "audio.done", "session.done"], messages
    assert messages[0]["mode"] == "sentence" and audio == want
