"""`rvqspec serve`'s HTTP behaviour, against a real server process on loopback serving a test double of the engine
(tests/helpers/fake_server.py: requests that decode as long as a test needs): the response formats, refusals in OpenAI's
error shape (and a hypothesis fuzz of the JSON body), 429 on a full queue, a disconnect freeing its row, a failing
row, the API key, the voice registry, /metrics, SIGTERM, and the page in a headless chromium. The real engine's audio
through the server: tests/test_serve_engine.py."""

import base64
import io
import json
import os
import re
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import soundfile
from hypothesis import HealthCheck, given, settings, strategies as st
from helpers.browser import chromium, page_value
from helpers.fake_server import SAMPLES_PER_FRAME, FakeEngine
from helpers.server import fake_server

from rvqspec.cli.main import main
from rvqspec.serve.app import MAX_SPEECH_BODY
from rvqspec.serve.audio import to_int16
from rvqspec.serve.protocol import MAX_INPUT, SPEECH_FIELDS

KEY = "sk-test-0123456789"
JSON_TYPE = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with fake_server(tmp_path_factory.mktemp("serve"), "--max-batch", "2", "--max-queue", "2") as server:
        yield server


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """A server with an API key, of a model that clones voices."""
    with fake_server(tmp_path_factory.mktemp("keyed"), "--api-key", KEY, "--can-clone") as server:
        server.headers = {"Authorization": f"Bearer {KEY}"}
        yield server


def expected(text: str, seed: int, voice: str | None = "en", clone: object | None = None) -> np.ndarray:
    """The fake engine's audio for this request, as 16-bit samples."""
    engine = FakeEngine()
    try:
        return to_int16(engine.speech(text, voice=voice, clone=clone, seed=seed).audio())
    finally:
        engine.close()


def speak(server, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/audio/speech", json={"model": "fake", **body}, headers=server.headers,
                      timeout=30)


def sse_audio(text: str) -> bytes:
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]
    assert [e["type"] for e in events][-1] == "speech.audio.done"
    return b"".join(base64.b64decode(e["audio"]) for e in events[:-1])


def test_every_format_carries_the_engines_audio_for_the_seed(server):
    want = expected("hello world", 7)
    wav = speak(server, input="hello world", voice="en", seed=7)
    assert wav.status_code == 200 and wav.headers["content-type"] == "audio/wav"
    assert np.array_equal(soundfile.read(io.BytesIO(wav.content), dtype="int16")[0], want)
    pcm = speak(server, input="hello world", voice="en", seed=7, response_format="pcm")
    assert pcm.headers["x-sample-rate"] == "16000" and pcm.content == want.tobytes()
    flac = speak(server, input="hello world", voice="en", seed=7, response_format="flac")
    assert np.array_equal(soundfile.read(io.BytesIO(flac.content), dtype="int16")[0], want)
    sse = speak(server, input="hello world", voice="en", seed=7, response_format="pcm", stream_format="sse")
    assert sse.headers["content-type"].startswith("text/event-stream") and sse_audio(sse.text) == want.tobytes()
    assert speak(server, input="hello world", voice="de", seed=7, response_format="pcm").content != want.tobytes()


def test_the_first_bytes_leave_with_the_first_chunk(server):
    start = time.perf_counter()
    with httpx.stream("POST", f"{server.url}/v1/audio/speech", timeout=30,
                      json={"model": "fake", "input": "x" * 100, "response_format": "pcm"}) as response:
        pieces = response.iter_raw()
        first = len(next(pieces)), time.perf_counter() - start
        total = first[0] + sum(len(piece) for piece in pieces)
    seconds = time.perf_counter() - start
    assert total == 100 * SAMPLES_PER_FRAME * 2  # 100 frames of 16-bit samples: nothing lost
    assert first[1] < seconds / 3, (first, seconds)  # 4 frames of 100 decoded


def test_the_openai_client_maps_refusals_to_its_errors(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        client.audio.speech.create(model="fake", voice="alloy", input="hi")
    assert refused.value.body["param"] == "voice" and "use one of en, de" in refused.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.audio.speech.create(model="tts-1", voice="en", input="hi")
    assert client.models.list().data[0].id == "fake"


BAD = [  # (body, status, param, words of the message)
    ({}, 400, "model", "model is missing"),
    ({"model": "fake"}, 400, "input", "missing or empty"),
    ({"model": "fake", "input": "  "}, 400, "input", "missing or empty"),
    ({"model": "fake", "input": "x" * (MAX_INPUT + 1)}, 400, "input", "split the text"),
    ({"model": "fake", "input": "hi", "instructions": "x" * (MAX_INPUT + 1)}, 400, "instructions", "over"),
    ({"model": "fake", "input": 3}, 400, "input", "must be a string"),
    ({"model": "fake", "input": "hi", "response_format": "mp3"}, 400, "response_format", "use wav, pcm, flac"),
    ({"model": "fake", "input": "hi", "stream_format": "chunks"}, 400, "stream_format", "'audio' or 'sse'"),
    ({"model": "fake", "input": "hi", "speed": 1.5}, 400, "speed", "1.0"),
    ({"model": "fake", "input": "hi", "seed": -1}, 400, "seed", "2**63"),
    ({"model": "fake", "input": "hi", "seed": True}, 400, "seed", "an integer"),
    ({"model": "fake", "input": "hi", "top_p": 2}, 400, "top_p", "(0, 1]"),
    ({"model": "fake", "input": "hi", "top_k": 0}, 400, "top_k", ">= 1"),
    ({"model": "fake", "input": "hi", "temperature": "hot"}, 400, "temperature", "finite number"),
    ({"model": "fake", "input": "hi", "voice": "alloy"}, 400, "voice", "register it"),
    ({"model": "fake", "input": "hi", "volume": 3}, 400, "volume", "the fields are"),
    ({"model": "tts-1", "input": "hi"}, 404, "model", "use 'fake'"),
]


@pytest.mark.parametrize("body,status,param,words", BAD)
def test_bad_requests_get_a_4xx_in_openais_error_shape(server, body, status, param, words):
    response = httpx.post(f"{server.url}/v1/audio/speech", json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    assert words in error["message"] and ": " in error["message"]  # the problem, then the fix


@pytest.mark.parametrize("content,status,words", [
    (b"{not json", 400, "not valid JSON"), (b"[1, 2]", 400, "not an object"), (b"[" * 50000, 400, "not valid JSON"),
    (b'{"input": "' + b"x" * MAX_SPEECH_BODY + b'"}', 413, "send less")])
def test_bodies_that_are_no_request_or_too_big_are_refused(server, content, status, words):
    response = httpx.post(f"{server.url}/v1/audio/speech", content=content, headers=JSON_TYPE)
    assert response.status_code == status and words in response.json()["error"]["message"]


def test_unknown_paths_and_methods_get_the_error_shape(server):
    assert httpx.get(f"{server.url}/v1/nothing").json()["error"]["message"].startswith("Not Found")
    assert httpx.get(f"{server.url}/v1/audio/speech").status_code == 405


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                    max_leaves=6)
FIELD_VALUES = {"model": st.just("fake") | JSON, "input": st.text(min_size=1, max_size=12) | JSON,
                "voice": st.sampled_from(["en", "de", "alloy", "../en"]) | JSON,
                "response_format": st.sampled_from(["wav", "pcm", "flac", "mp3"]) | JSON,
                "stream_format": st.sampled_from(["audio", "sse"]) | JSON}


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=st.fixed_dictionaries({}, optional={name: FIELD_VALUES.get(name, JSON) for name in SPEECH_FIELDS})
       | st.dictionaries(st.text(max_size=10), JSON, max_size=4) | JSON)
def test_fuzzed_json_bodies_get_audio_or_a_4xx_never_a_5xx(server, body):
    response = httpx.post(f"{server.url}/v1/audio/speech", content=json.dumps(body).encode(), timeout=30,
                          headers=JSON_TYPE)
    assert response.status_code == 200 or 400 <= response.status_code < 500, (body, response.text)
    if response.status_code != 200:
        assert response.json()["error"]["message"]
    assert httpx.get(f"{server.url}/health").status_code == 200


def long_stream(server, opened: threading.Event, leave: threading.Event, statuses: list) -> None:
    """A streaming request of 20 s of frames that reads its first chunk, then waits for `leave` and disconnects."""
    with httpx.stream("POST", f"{server.url}/v1/audio/speech", json={"model": "fake", "input": "x" * 2000},
                      timeout=30) as response:
        statuses.append(response.status_code)
        pieces = response.iter_raw()  # kept: a dropped iterator closes the response
        next(pieces)
        opened.set()
        leave.wait(30)


def test_a_full_queue_answers_429_with_retry_after_and_disconnects_free_every_row(server):
    leave, statuses, threads = threading.Event(), [], []
    try:
        for held in range(1, 5):  # 2 rows decoding, 2 waiting (max_batch 2, max_queue 2), submitted one by one
            threads.append(threading.Thread(target=long_stream, args=(server, threading.Event(), leave, statuses)))
            threads[-1].start()
            server.wait_until(lambda m: m["rvqspec_active_rows"] + m["rvqspec_queued_requests"] == held)
        m = server.wait_until(lambda m: m["rvqspec_active_rows"] == 2 and m["rvqspec_queued_requests"] == 2)
        assert (m["rvqspec_active_rows"], m["rvqspec_queued_requests"]) == (2, 2)
        full = speak(server, input="hi")
        assert full.status_code == 429 and full.headers["retry-after"] == "1"
        assert full.json()["error"]["code"] == "queue_full"
    finally:
        leave.set()
        for thread in threads:
            thread.join()
    m = server.wait_until(lambda m: m["rvqspec_active_rows"] == 0 and m["rvqspec_queued_requests"] == 0, timeout=15)
    assert (m["rvqspec_active_rows"], m["rvqspec_queued_requests"]) == (0, 0)  # long before their 20 s
    assert statuses == [200] * 4


def test_a_disconnect_mid_stream_frees_the_row_within_frames(server):
    opened, leave, statuses = threading.Event(), threading.Event(), []
    thread = threading.Thread(target=long_stream, args=(server, opened, leave, statuses))
    thread.start()
    assert opened.wait(15)
    assert server.metrics()["rvqspec_active_rows"] == 1
    leave.set()
    thread.join()
    gone = time.perf_counter()
    m = server.wait_until(lambda m: m["rvqspec_active_rows"] == 0)
    assert m["rvqspec_active_rows"] == 0 and time.perf_counter() - gone < 5
    frames = m["rvqspec_frames_total"]
    time.sleep(0.2)
    assert server.metrics()["rvqspec_frames_total"] == frames  # nothing decodes any more


def test_a_client_that_stops_reading_is_cut_off_and_its_row_freed_while_others_go_on(tmp_path):
    """A stream whose client stops reading (a small receive buffer, never read) fills the server's socket buffers;
    within --stall-timeout of the server's write waiting, its request is cancelled (the row freed), the connection
    closed and the stall counted; the other row serves a request meanwhile."""
    with fake_server(tmp_path, "--stall-timeout", "1", "--frame-seconds", "0.001") as server:
        stalled = socket.socket()
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stalled.connect(("127.0.0.1", int(server.url.rpartition(":")[2])))
        body = json.dumps({"model": "fake", "input": "x" * 4000}).encode()  # 10 MB of audio, 4 s of frames
        stalled.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert stalled.recv(12) == b"HTTP/1.1 200"
        server.wait_until(lambda m: m["rvqspec_active_rows"] == 1)
        assert speak(server, input="hello meanwhile").status_code == 200
        m = server.wait_until(lambda m: m["rvqspec_stalled_clients_total"] == 1, timeout=30)
        assert m["rvqspec_stalled_clients_total"] == 1
        m = server.wait_until(lambda m: m["rvqspec_active_rows"] == 0)
        assert m["rvqspec_active_rows"] == 0 and m["rvqspec_frames_total"] < 4000  # freed before its end
        stalled.settimeout(10)
        while stalled.recv(65536):  # what the buffers held, then the end: the server closed the connection
            pass
        stalled.close()
        assert "a client took no audio for 1 s" in server.log.read_text()
        assert speak(server, input="hello after").status_code == 200


def test_a_failing_row_is_a_500_json_and_a_log_line_and_the_server_lives_on(server):
    response = speak(server, input="explode")
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "server_error" and "exploded" not in error["message"]  # the engine's words, logged only
    assert "speech request failed: RuntimeError: the fake engine exploded" in server.log.read_text()
    assert speak(server, input="hi").status_code == 200


def test_metrics_are_prometheus_text(server):
    speak(server, input="hi")
    text = httpx.get(f"{server.url}/metrics").text
    for line in text.splitlines():
        assert re.fullmatch(r"# (HELP|TYPE) \w+ .+|rvqspec_\w+(\{\w+=\"[^\"]*\"\})? [-+.\deE]+|.*\+Inf.*", line), line
    for family in ("requests_total", "time_to_first_audio_seconds", "active_rows", "queued_requests",
                   "audio_seconds_total", "tokens_per_step", "policy_tree", "capacity_frames_per_second",
                   "realtime_rows", "row_real_time_factor", "largest_chunk_gap_seconds"):
        assert f"# TYPE rvqspec_{family} " in text
    assert re.search(r'rvqspec_requests_total\{status="200"\} [1-9]', text)
    assert 'rvqspec_policy_tree{tree="AR"} 1' in text


def test_every_answer_says_how_its_request_ended_and_metrics_count_it(server):
    def ends(reason: str) -> float:
        text = httpx.get(f"{server.url}/metrics").text
        return float(re.search(rf'rvqspec_speech_ends_total\{{reason="{reason}"\}} (\S+)', text).group(1))

    before = {reason: ends(reason) for reason in ("eos", "length", "error")}
    assert speak(server, input="hello", response_format="flac").headers["x-end-reason"] == "eos"
    cut = speak(server, input="runaway text", response_format="flac")
    assert cut.status_code == 200 and cut.headers["x-end-reason"] == "length"
    events = speak(server, input="runaway text", response_format="pcm", stream_format="sse").text
    done = json.loads(events.strip().splitlines()[-1][6:])
    assert done == {"type": "speech.audio.done", "end_reason": "length"}
    assert speak(server, input="explode").status_code == 500
    assert (ends("eos"), ends("length"), ends("error")) == (before["eos"] + 1, before["length"] + 2,
                                                            before["error"] + 1)
    assert "speech request cut at its frame budget (12 frames)" in server.log.read_text()


def test_the_api_key_guards_every_endpoint_but_health_and_the_page(keyed):
    url = keyed.url
    assert httpx.get(f"{url}/health").status_code == 200 and httpx.get(f"{url}/").status_code == 200
    for path in ("/v1/models", "/v1/audio/voices", "/metrics"):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            refused = httpx.get(f"{url}{path}", headers=headers)
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{url}{path}", headers=keyed.headers).status_code == 200
    assert httpx.post(f"{url}/v1/audio/speech", json={"model": "fake", "input": "hi"}).status_code == 401
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    assert client.audio.speech.create(model="fake", voice="en", input="hi", response_format="pcm").content
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="sk-wrong", max_retries=0).models.list()


def clip(seconds: float = 1.0) -> str:
    buffer = io.BytesIO()
    soundfile.write(buffer, np.sin(np.arange(int(16000 * seconds)) / 10).astype(np.float32) * 0.3, 16000,
                    format="WAV")
    return base64.b64encode(buffer.getvalue()).decode()


def test_voice_registration_round_trip(keyed, tmp_path):
    url, auth = keyed.url, keyed.headers
    voices_dir = keyed.log.parent / "voices"
    added = httpx.post(f"{url}/v1/audio/voices", headers=auth, json={"name": "anna_1", "audio": clip(),
                                                                     "transcript": "a hum"})
    assert added.status_code == 201 and added.json()["id"] == "anna_1"
    listed = httpx.get(f"{url}/v1/audio/voices", headers=auth).json()["data"]
    assert {"id": "anna_1", "object": "voice", "kind": "cloned"} in listed and listed[0]["kind"] == "builtin"
    spoken = speak(keyed, input="hello", voice="anna_1", seed=3, response_format="pcm")
    assert spoken.status_code == 200
    assert spoken.content == expected("hello", 3, voice=None, clone="clone:16000:16000:a hum").tobytes()
    again = httpx.post(f"{url}/v1/audio/voices", headers=auth, json={"name": "anna_1", "audio": clip()})
    assert again.status_code == 409 and "DELETE" in again.json()["error"]["message"]
    assert sorted(p.name for p in voices_dir.iterdir()) == ["anna_1"]  # no partial or temporary folders left
    assert httpx.delete(f"{url}/v1/audio/voices/anna_1", headers=auth).json()["deleted"] is True
    assert httpx.delete(f"{url}/v1/audio/voices/anna_1", headers=auth).status_code == 404
    assert httpx.delete(f"{url}/v1/audio/voices/en", headers=auth).status_code == 400
    assert speak(keyed, input="hello", voice="anna_1").status_code == 400
    assert list(voices_dir.iterdir()) == []


@pytest.mark.parametrize("body,param,words", [
    ({"name": "../escape", "audio": clip()}, "name", "letters, digits"),
    ({"name": "a/b", "audio": clip()}, "name", "letters, digits"),
    ({"name": "x" * 65, "audio": clip()}, "name", "1-64"),
    ({"name": "", "audio": clip()}, "name", "1-64"),
    ({"name": "en", "audio": clip()}, "name", "built-in"),
    ({"name": "ok", "audio": "%%%"}, "audio", "not base64"),
    ({"name": "ok", "audio": base64.b64encode(b"RIFF nothing").decode()}, "audio", "not a readable wav"),
    ({"name": "ok", "audio": clip(0.1)}, "audio", "0.5 to 60 s"),
    ({"name": "ok", "audio": clip(), "transcript": "refuse"}, "audio", "refused"),
])
def test_voice_registrations_are_checked_before_anything_is_stored(keyed, body, param, words):
    refused = httpx.post(f"{keyed.url}/v1/audio/voices", headers=keyed.headers, json=body)
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == param and words in refused.json()["error"]["message"]
    assert list((keyed.log.parent / "voices").iterdir()) == []
    assert not (keyed.log.parent / "escape").exists()


def test_a_model_that_cannot_clone_refuses_registration(server):
    refused = httpx.post(f"{server.url}/v1/audio/voices", json={"name": "anna", "audio": clip()})
    assert refused.status_code == 400 and "cannot clone" in refused.json()["error"]["message"]


@pytest.mark.parametrize("grace,frames,complete", [(10, 150, True), (0.5, 3000, False)])
def test_sigterm_stops_accepting_drains_and_exits_0(tmp_path, grace, frames, complete):
    """In-flight requests finish within the grace period (or are cut at its end); the process exits 0."""
    with fake_server(tmp_path, "--grace", str(grace)) as server:
        with httpx.stream("POST", f"{server.url}/v1/audio/speech", timeout=30,
                          json={"model": "fake", "input": "x" * frames, "response_format": "pcm"}) as response:
            pieces = response.iter_raw()
            received = len(next(pieces))
            start = time.perf_counter()
            os.kill(server.process.pid, signal.SIGTERM)
            time.sleep(0.3)
            with pytest.raises(httpx.ConnectError):  # no longer accepting
                httpx.get(f"{server.url}/health")
            try:
                for piece in pieces:
                    received += len(piece)
            except httpx.HTTPError:  # cut at the end of the grace period
                pass
        assert (received == frames * SAMPLES_PER_FRAME * 2) == complete
        assert server.process.wait(timeout=30) == 0
        assert time.perf_counter() - start < (10 if complete else grace + 10)


@pytest.mark.skipif(chromium() is None and not os.environ.get("CI"), reason="no chromium (apt install "
                    "chromium-headless-shell); in CI (CI set) a missing browser fails instead")
def test_the_page_plays_the_stream_in_headless_chromium(server, tmp_path):
    assert chromium(), "no chromium on PATH: apt install chromium-headless-shell (.ci/run does)"
    shot = Path(os.environ.get("RVQSPEC_ARTIFACTS", tmp_path)) / "page.png"  # kept where CI collects artifacts
    status = page_value(f"{server.url}/?text=hello%20there&autoplay=1", 'document.getElementById("status").textContent',
                        "done", timeout=60, screenshot=shot)
    assert status.startswith("done: 0.88 s of audio at 16000 Hz"), status  # 11 frames of 80 ms
    assert shot.read_bytes().startswith(b"\x89PNG")


def test_serve_without_its_extra_names_it_in_one_line(monkeypatch, capsys):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "fastapi" else find_spec(name, *a))
    assert main(["serve", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'rvqspec[serve]'" in err


def test_serve_refuses_a_taken_port_in_one_line(capsys):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert main(["serve", "--port", str(taken.getsockname()[1])]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "in use" in err
