"""`rvqspec serve` under hostile input (issue 41): against a server process serving the test double of the engine
(tests/helpers/fake_server.py). Uploads bounded before they are decoded (FLAC bombs: the server's RSS measured),
stored small, within a quota; absurd clips refused; text UTF-8 cannot encode refused in words, error bodies that
always encode and hold no reprs; cross-site requests (Content-Type, Host); a client that leaves while sending;
header and body deadlines; SIGTERM as soon as the server is up; the CLI's checks before binding; a hypothesis fuzz
of the speech and voice endpoints (no 5xx, bounded RSS) and a soak (rows, threads, fds and memory flat). The
engine's side (a failing row fails alone): tests/test_reliability_rows.py."""

import base64
import io
import json
import os
import re
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile
from hypothesis import HealthCheck, given, settings, strategies as st
from helpers.server import fake_server
from test_serve import JSON, JSON_TYPE, clip

from rvqspec.cli.main import main

if not Path("/proc/self/status").exists():
    pytest.skip("reads a server's RSS, threads and fds in /proc (Linux)", allow_module_level=True)

MIB = 2 ** 20
ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}|<[\w.]+ object")  # what a repr leaks


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A server of a model that clones, with short deadlines and one extra host name."""
    with fake_server(tmp_path_factory.mktemp("hostile"), "--can-clone", "--max-batch", "8", "--max-queue", "64",
                     "--header-timeout", "1", "--body-timeout", "1", "--allowed-hosts", "tts.example") as server:
        yield server


def rss(server) -> int:
    """The server process's resident memory, bytes."""
    status = Path(f"/proc/{server.process.pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024


def threads(server) -> int:
    return int(re.search(r"Threads:\s+(\d+)", Path(f"/proc/{server.process.pid}/status").read_text()).group(1))


def fds(server) -> int:
    return len(os.listdir(f"/proc/{server.process.pid}/fd"))


def register(server, body: dict) -> httpx.Response:
    """POST /v1/audio/voices; the body as JSON with ASCII escapes (a lone surrogate included)."""
    return httpx.post(f"{server.url}/v1/audio/voices", content=json.dumps(body).encode(), headers=JSON_TYPE,
                      timeout=30)


def speak(server, content: bytes, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/audio/speech", content=content, headers={**JSON_TYPE, **(headers or {})},
                      timeout=30)


def encoded(audio: np.ndarray, rate: int, format: str = "WAV", subtype: str | None = None) -> str:
    buffer = io.BytesIO()
    soundfile.write(buffer, audio, rate, format=format, subtype=subtype)
    return base64.b64encode(buffer.getvalue()).decode()


def silence_flac(seconds: float, rate: int) -> bytes:
    """A FLAC file of `seconds` of silence (it compresses to almost nothing), written a minute at a time."""
    buffer = io.BytesIO()
    with soundfile.SoundFile(buffer, "w", rate, 1, format="FLAC", subtype="PCM_16") as file:
        minute, left = np.zeros(rate * 60, np.int16), int(seconds * rate)
        while left > 0:
            file.write(minute[:left])
            left -= len(minute)
    return buffer.getvalue()


def claiming(flac: bytes, frames: int) -> bytes:
    """`flac` with its STREAMINFO's 36-bit total sample count replaced (a header that lies)."""
    data = bytearray(flac)
    data[21] = (data[21] & 0xF0) | (frames >> 32 & 0x0F)
    data[22:26] = (frames & 0xFFFFFFFF).to_bytes(4, "big")
    return bytes(data)


def refused(response: httpx.Response, status: int, param: str | None, words: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
    assert words in error["message"] and not ADDRESS.search(error["message"]), error
    return error


# ---------------------------------------------------------------- uploads: bounded, small, within a quota (1, 2, 5)


def test_flac_bombs_are_refused_from_their_header_and_memory_stays_flat(server):
    """3 h of silence (0.5 MB of FLAC; decoded whole it took 2 GB), a header claiming 2**36 samples (a 256 GiB
    allocation: a 500), an unknown length, and a header claiming 10 s over the 3 h: all 400, RSS flat."""
    hours = silence_flac(3 * 3600, 16000)
    before = rss(server)
    cases = [(hours, "10800.00 s long"), (claiming(silence_flac(1, 16000), 2 ** 36 - 1), "4294967.30 s long"),
             (claiming(hours, 0), "s long"), (claiming(hours, 16000 * 10), None)]
    for data, words in cases:
        response = register(server, {"name": "bomb", "audio": base64.b64encode(data).decode()})
        if words is None:  # a header within the limits: at most its 10 s decoded, and that is silence
            refused(response, 400, "audio", "silent")
        else:
            refused(response, 400, "audio", words)
    growth = rss(server) - before
    print(f"RSS before the bombs {before / MIB:.1f} MiB, after {(before + growth) / MIB:.1f} MiB")
    assert growth < 20 * MIB


def test_a_clip_is_stored_as_16_bit_at_the_models_rate_and_odd_rates_are_refused(server):
    """60 s of silence at 655,350 Hz (142 KB of FLAC, once stored as 157 MB of float32): refused by its rate. A
    float clip at 44.1 kHz is stored as 16-bit PCM at the model's 16 kHz (and its prompt made from those samples)."""
    refused(register(server, {"name": "odd", "audio": base64.b64encode(silence_flac(60, 655350)).decode()}),
            400, "audio", "655350 Hz")
    tone = (np.sin(np.arange(44100 * 2) / 7) * 0.3).astype(np.float32)
    added = register(server, {"name": "stored", "audio": encoded(tone, 44100, subtype="FLOAT")})
    assert added.status_code == 201, added.text
    stored = server.log.parent / "voices" / "stored" / "audio.wav"
    info = soundfile.info(stored)
    assert (info.samplerate, info.subtype, info.frames) == (16000, "PCM_16", 32000)
    assert stored.stat().st_size < 70_000  # 2 s at 16 kHz in 16 bits (not 2 s at 44.1 kHz in float32: 350 KB)
    assert httpx.delete(f"{server.url}/v1/audio/voices/stored").status_code == 200


@pytest.mark.parametrize("audio,words", [
    (np.full(16000, np.nan, np.float32), "nan or inf"), (np.full(16000, np.inf, np.float32), "nan or inf"),
    (np.full(16000, 1e30, np.float32), "peak is 1e+30"), (np.zeros(16000, np.float32), "silent"),
    (np.zeros((16000, 3), np.float32) + 0.1, "3 channels")])
def test_absurd_clips_are_refused_at_registration(server, audio, words):
    refused(register(server, {"name": "absurd", "audio": encoded(audio, 16000, subtype="FLOAT")}), 400, "audio",
            words)


@pytest.mark.parametrize("format", ["OGG", "AIFF", "MP3"])
def test_only_wav_and_flac_clips_are_taken(server, format):
    refused(register(server, {"name": "other", "audio": encoded(np.full(16000, 0.1, np.float32), 16000, format)}),
            400, "audio", "send wav or flac")


def test_the_voices_quota_counts_voices_and_bytes(tmp_path):
    with fake_server(tmp_path, "--can-clone", "--max-voices", "2", "--voices-quota", "1") as server:
        for name in ("a", "b"):
            assert register(server, {"name": name, "audio": clip()}).status_code == 201
        full = register(server, {"name": "c", "audio": clip()})
        assert full.status_code == 507 and full.json()["error"]["code"] == "voices_quota"
        assert "--max-voices" in full.json()["error"]["message"]
        assert httpx.delete(f"{server.url}/v1/audio/voices/b").status_code == 200
        big = register(server, {"name": "c", "audio": clip(40)})  # 1.3 MB in 16 bits: over the 1 MiB quota
        assert big.status_code == 507 and "--voices-quota" in big.json()["error"]["message"]
        assert sorted(p.name for p in (tmp_path / "voices").iterdir()) == ["a"]  # nothing partial left


def test_voice_registration_checks_its_fields(server):
    refused(register(server, {"name": "x", "audio": clip(), "gender": "f"}), 400, "gender", "the fields are")
    refused(register(server, {"name": "x"}), 400, "audio", "missing")
    refused(register(server, {"name": "x", "audio": clip(), "transcript": "a\ud800"}), 400, "transcript",
            "unpaired surrogate")
    wrapped = base64.encodebytes(base64.b64decode(clip())).decode()  # what `base64` writes: 76-character lines
    assert "\n" in wrapped and register(server, {"name": "wrapped", "audio": wrapped}).status_code == 201
    assert httpx.delete(f"{server.url}/v1/audio/voices/wrapped").status_code == 200
    error = refused(register(server, {"name": "x", "audio": base64.b64encode(b"RIFF nothing").decode()}), 400,
                    "audio", "not a readable wav or flac")
    assert "BytesIO" not in error["message"]


# ---------------------------------------------------------------- text and error bodies (4)


def test_a_lone_surrogate_is_a_400_naming_the_field_and_the_connection_lives_on(server):
    with httpx.Client(base_url=server.url, timeout=30, headers=JSON_TYPE) as client:  # one pooled connection
        refused(client.post("/v1/audio/speech", content=b'{"model": "fake", "input": "hi \\ud800"}'), 400, "input",
                "unpaired surrogate")
        error = refused(client.post("/v1/audio/speech", content=b'{"model": "fake", "input": "hi", "\\udc00x": 1}'),
                        400, "\\udc00x", "unknown field")
        assert "\\udc00" in error["message"]
        assert client.post("/v1/audio/speech", json={"model": "fake", "input": "hi"}).status_code == 200


# ---------------------------------------------------------------- browsers: Content-Type and Host (10)


def test_a_cross_site_simple_request_is_never_parsed(server):
    for media in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", ""):
        response = httpx.post(f"{server.url}/v1/audio/speech", timeout=30, headers={"Content-Type": media},
                              content=json.dumps({"model": "fake", "input": "hi"}))
        assert refused(response, 415, None, "application/json")["code"] == "unsupported_media_type"
    assert speak(server, b'{"model": "fake", "input": "hi"}', {"Content-Type": "application/json; charset=utf-8"}
                 ).status_code == 200


@pytest.mark.parametrize("host,status", [("evil.example", 421), ("evil.example:8000", 421), ("tts.example", 200),
                                         ("TTS.example:80", 200), ("localhost:1", 200), ("127.0.0.1", 200),
                                         ("[::1]:8000", 200), ("10.1.2.3", 200)])
def test_the_host_header_must_name_this_server(server, host, status):
    """A DNS-rebinding page's Host is its own domain: refused unless it is in --allowed-hosts."""
    response = speak(server, b'{"model": "fake", "input": "hi"}', {"Host": host, "Origin": "http://evil.example"})
    assert response.status_code == status
    if status == 421:
        assert "--allowed-hosts" in response.json()["error"]["message"]
        assert httpx.get(f"{server.url}/health", headers={"Host": host}).status_code == 421


def test_head_health_answers(server):
    assert httpx.head(f"{server.url}/health").status_code == 200


# ---------------------------------------------------------------- connections: leaving, trickling, stalling (9)


def raw(server) -> socket.socket:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def status_count(server, status: int) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    found = re.search(rf'rvqspec_requests_total\{{status="{status}"\}} (\S+)', text)
    return float(found.group(1)) if found else 0.0


HEAD = (b"POST /v1/audio/voices HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100000\r\n\r\n")


def test_a_client_that_leaves_while_sending_its_body_is_a_499_not_a_500(server):
    closed, failed = status_count(server, 499), status_count(server, 500)
    with raw(server) as sock:
        sock.sendall(HEAD + b'{"name": "half", "audio": "')
        time.sleep(0.2)
    deadline = time.monotonic() + 10
    while status_count(server, 499) == closed and time.monotonic() < deadline:
        time.sleep(0.05)
    assert status_count(server, 499) == closed + 1 and status_count(server, 500) == failed
    log = server.log.read_text()
    assert "while sending its body" in log and "Traceback" not in log and "ERROR" not in log


def answer(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_a_stalled_or_endless_body_gets_a_408(server):
    with raw(server) as sock:  # a Content-Length longer than what is sent
        sock.sendall(HEAD + b'{"name": ')
        start = time.monotonic()
        reply = answer(sock)
    assert reply.startswith(b"HTTP/1.1 408") and b"did not arrive within 1 s" in reply
    assert time.monotonic() - start < 5
    with raw(server) as sock:  # chunks that never end
        sock.sendall(HEAD.replace(b"Content-Length: 100000", b"Transfer-Encoding: chunked"))
        start = time.monotonic()
        while time.monotonic() - start < 5:
            try:
                sock.sendall(b"1\r\n \r\n")
            except OSError:
                break
            time.sleep(0.1)
        reply = answer(sock)
    assert reply.startswith(b"HTTP/1.1 408") and time.monotonic() - start < 5


def test_headers_trickled_a_byte_at_a_time_are_cut_off(server):
    with raw(server) as sock:
        start = time.monotonic()
        for byte in b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 1000:
            try:
                sock.sendall(bytes([byte]))
                time.sleep(0.1)
            except OSError:
                break
            if time.monotonic() - start > 10:
                break
        assert answer(sock) == b""  # closed, no answer
    assert time.monotonic() - start < 5  # the 1 s header deadline, not the 100 s of trickling


# ---------------------------------------------------------------- SIGTERM and the CLI (6, 7, 8)


def test_sigterm_as_soon_as_the_address_is_printed_stops_the_server(tmp_path):
    for trial in range(2):
        (tmp_path / str(trial)).mkdir()
        with fake_server(tmp_path / str(trial)) as started:
            os.kill(started.process.pid, signal.SIGTERM)
            assert started.process.wait(timeout=15) == 0


def catches_sigterm(pid: int) -> bool:
    """Whether process `pid` has a handler for SIGTERM (bit 15 of SigCgt in /proc/PID/status)."""
    caught = int(re.search(r"SigCgt:\s+([0-9a-f]+)", Path(f"/proc/{pid}/status").read_text()).group(1), 16)
    return bool(caught >> (signal.SIGTERM - 1) & 1)


def test_sigterm_while_rvqspec_serve_starts_exits_0(tmp_path):
    """`rvqspec serve` handles SIGTERM from before it binds and loads the model: sent as soon as its handler is in
    place (before the address line), the process exits 0 at once."""
    import subprocess
    import sys

    process = subprocess.Popen([sys.executable, "-m", "rvqspec.cli", "serve", "--port", "0", "--voices-dir",
                                str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env=os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    try:
        deadline = time.monotonic() + 60
        while not catches_sigterm(process.pid) and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0, process.stderr.read().decode()[-2000:]
        assert b"rvqspec serve: standin on" not in process.stdout.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def damaged(folder: Path, text: str) -> str:
    folder.mkdir()
    (folder / "config.json").write_text(text)
    return str(folder)


@pytest.mark.parametrize("argv,words", [
    (["--max-queue", "0"], "argument --max-queue: 0 is out of range"),
    (["--max-batch", "-1"], "argument --max-batch"),
    (["--api-key", ""], "argument --api-key: the key is empty"),
    (["--grace", "nan"], "argument --grace"),
    (["--max-voices", "0"], "argument --max-voices"),
    (["--allowed-hosts", "a,,b"], "argument --allowed-hosts"),
    (["--model", "NOTJSON"], "is not valid JSON"),
    (["--model", "LIST"], "is not a model config"),
])
def test_serve_checks_its_flags_and_model_before_binding(tmp_path, capsys, argv, words):
    folders = {"NOTJSON": damaged(tmp_path / "a", "{nope"), "LIST": damaged(tmp_path / "b", "[1, 2]")}
    argv = [folders.get(arg, arg) for arg in argv]
    with socket.socket() as taken:  # the port is taken: a check after binding would say "in use"
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert main(["serve", "--port", str(taken.getsockname()[1]), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err and "in use" not in err


def test_an_empty_api_key_in_the_environment_is_refused(monkeypatch, capsys):
    monkeypatch.setenv("RVQSPEC_API_KEY", "")
    with socket.socket() as taken:  # a server that took the key would fail here instead, not serve on
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert main(["serve", "--port", str(taken.getsockname()[1])]) == 2
    assert "RVQSPEC_API_KEY: the key is empty" in capsys.readouterr().err


def test_a_taken_port_is_named(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    assert f"cannot listen on 127.0.0.1 port {port}: Address already in use: pick another --port" in \
        capsys.readouterr().err


# ---------------------------------------------------------------- fuzz and soak (Done when)

def fuzz_clip(rate: int, channels: int, seconds: float, peak: float, subtype: str, flac: bool) -> bytes:
    """A wav (float or 16-bit) or flac file of a constant; flac holds integers, so its constant is finite and in
    range."""
    if flac:
        peak = float(np.clip(np.nan_to_num(peak), -1, 1))
    return base64.b64decode(encoded(np.full((int(rate * seconds), channels), peak, np.float32), rate,
                                    "FLAC" if flac else "WAV", None if flac else subtype))


CLIPS = st.one_of(
    st.binary(max_size=64),
    st.builds(fuzz_clip, st.sampled_from([8000, 16000, 44100, 96000, 7999]), st.integers(1, 3),
              st.sampled_from([0.0, 0.3, 0.6, 1.0]), st.sampled_from([0.3, 1.0, np.nan, np.inf, 1e30, -5.0]),
              st.sampled_from(["FLOAT", "PCM_16"]), st.booleans()),
    st.builds(lambda seconds, frames: claiming(silence_flac(seconds, 8000), frames),
              st.sampled_from([0.6, 2.0]), st.sampled_from([0, 1, 8000, 2 ** 36 - 1, 2 ** 33])))
TEXT = st.text(max_size=12) | st.text(st.characters(min_codepoint=0xD7F0, max_codepoint=0xE010), max_size=4)
HEADERS = st.fixed_dictionaries({}, optional={
    "Content-Type": st.sampled_from(["application/json", "text/plain", "application/json; charset=latin-1", "",
                                     "APPLICATION/JSON"]),
    "Host": st.sampled_from(["127.0.0.1", "evil.example", "localhost:9", "tts.example", "[::1]", "a:b:c"]),
    "Content-Encoding": st.just("gzip"), "X-Forwarded-Host": st.just("evil.example")})
FUZZ_LIMIT = 100 * MIB  # RSS above the fuzz's start, at any point: a 60 s stereo 48 kHz clip decodes to 23 MB


@pytest.fixture(scope="module")
def baseline(server):
    speak(server, b'{"model": "fake", "input": "warm up"}')
    return rss(server)


def check_answer(server, response: httpx.Response, baseline: int) -> None:
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["message"] and not ADDRESS.search(error["message"]), error
    assert rss(server) - baseline < FUZZ_LIMIT


@settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=st.fixed_dictionaries({"model": st.just("fake") | JSON}, optional={
    "input": TEXT | JSON, "voice": st.sampled_from(["en", "de"]) | TEXT, "seed": st.integers() | JSON,
    "response_format": st.sampled_from(["wav", "pcm", "flac"]) | TEXT}), extra=st.dictionaries(TEXT, JSON, max_size=2),
    headers=HEADERS)
def test_fuzzed_speech_requests_get_no_5xx_and_bounded_memory(server, baseline, body, extra, headers):
    content = json.dumps({**extra, **body}).encode()  # lone surrogates as \ud800 escapes
    response = httpx.post(f"{server.url}/v1/audio/speech", content=content, headers=headers, timeout=30)
    check_answer(server, response, baseline)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(name=st.sampled_from(["fuzzed", "en", "../x"]) | TEXT, audio=CLIPS, transcript=st.none() | TEXT,
       wrap=st.booleans(), headers=HEADERS)
def test_fuzzed_voice_registrations_get_no_5xx_and_bounded_memory(server, baseline, name, audio, transcript, wrap,
                                                                  headers):
    text = (base64.encodebytes if wrap else base64.b64encode)(audio).decode()
    content = json.dumps({"name": name, "audio": text, "transcript": transcript}).encode()
    response = httpx.post(f"{server.url}/v1/audio/voices", content=content, headers={**JSON_TYPE, **headers},
                          timeout=30)
    check_answer(server, response, baseline)
    if response.status_code == 201:
        assert httpx.delete(f"{server.url}/v1/audio/voices/{name}").status_code == 200


def soak_request(server, index: int) -> int:
    """Request `index` of the soak: every 10th disconnects after its first chunk, 5 fail (the fake's 'explode')."""
    if index % 10 == 5:
        with httpx.stream("POST", f"{server.url}/v1/audio/speech", timeout=30,
                          json={"model": "fake", "input": "x" * 200, "response_format": "pcm"}) as response:
            next(response.iter_raw())
            return -1
    text = "explode" if index % 40 == 7 else "hi"
    return httpx.post(f"{server.url}/v1/audio/speech", json={"model": "fake", "input": text}, timeout=30).status_code


def test_a_soak_of_200_requests_leaves_rows_threads_fds_and_memory_where_they_were(server):
    """200 requests from 8 threads: 20 leave mid-stream, 5 rows fail. Measured after a warm-up of the same load."""
    def run(count: int) -> list[int]:
        with ThreadPoolExecutor(8) as pool:
            return list(pool.map(lambda i: soak_request(server, i), range(count)))

    def settled() -> dict:
        server.wait_until(lambda m: m["rvqspec_active_rows"] == 0 and m["rvqspec_queued_requests"] == 0)
        time.sleep(0.5)  # the connections closing
        return {"rows": server.metrics()["rvqspec_active_rows"], "threads": threads(server), "fds": fds(server),
                "rss": rss(server)}

    run(40)
    before = settled()
    start = time.monotonic()
    statuses = run(200)
    seconds = time.monotonic() - start
    after = settled()
    assert statuses.count(-1) == 20 and statuses.count(500) == 5 and statuses.count(200) == 175
    print(f"soak: 200 requests in {seconds:.1f} s; before {before}, after {after}")
    assert after["rows"] == before["rows"] == 0
    # anyio keeps a worker thread idle for 10 s: at most one per concurrent client (8) more than after the warm-up
    assert after["threads"] <= before["threads"] + 8 and after["fds"] <= before["fds"] + 2
    assert after["rss"] - before["rss"] < 20 * MIB
