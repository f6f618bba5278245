"""`rvqspec serve --ray` (rvqspec/serve/ray.py) on a local Ray instance of 2 CPUs: the command joining it (--address)
and serving the stand-in, whose audio through the official `openai` client is the Engine's for the seed, then
draining on SIGTERM mid-stream; and two replicas of the engine's test double (tests/helpers/fake_server.py: requests
that decode as long as a test needs): requests spread over both, a voice registered through one replica spoken by the
other and deleted everywhere, a killed replica's stream cut at once and the replica replaced, 429 from a full cluster,
autoscaling from 1 to 2 replicas and back; the engine's status copied into Ray's gauges. Refusals before Ray starts,
one line each (the install hint of `--ray` and the Ray flags without it run where ray is not installed). All in one
xdist group, one Ray instance at a time (`make test` runs `--dist loadgroup`)."""

import functools
import importlib.util
import io
import os
import signal
import sys
import threading
import time

import httpx
import numpy as np
import openai
import pytest
import soundfile
from helpers.fake_server import FakeEngine
from helpers.server import ROOT, running
from test_serve import clip, expected

from rvqspec.cli.main import main
from rvqspec.runtime import Engine
from rvqspec.serve.audio import to_int16

needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                               reason="ray is not installed: pip install 'rvqspec[ray]'")
pytestmark = [pytest.mark.xdist_group("ray"), pytest.mark.long]
REPLICA = "x-rvqspec-replica"
TEXT = "Hello there."


def test_ray_without_the_extra_says_in_one_line_what_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed
    assert main(["serve", "--ray", "--replicas", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'rvqspec[ray]'" in err, err


def test_ray_flags_without_ray_are_refused(capsys):
    assert main(["serve", "--replicas", "2"]) == 2
    assert "add --ray" in capsys.readouterr().err


@needs_ray
def test_serve_ray_refuses_a_taken_port_before_ray_starts(capsys):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert main(["serve", "--ray", "--port", str(taken.getsockname()[1])]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "in use" in err


@needs_ray
def test_each_replica_copies_its_engines_status_into_rays_gauges(monkeypatch):
    from rvqspec.serve import ray as rvqspec_ray

    class Gauge:
        def set(self, value):
            self.value = value

    monkeypatch.setattr(rvqspec_ray, "METRICS_SECONDS", 0.01)
    engine, gauges, stop = FakeEngine(), {key: Gauge() for key in rvqspec_ray.STATUS_METRICS}, threading.Event()
    try:
        engine.speech("x" * 8, voice="en").audio()
        exporter = threading.Thread(target=rvqspec_ray.export_status, args=(engine, gauges, stop))
        exporter.start()
        time.sleep(0.1)
        stop.set()
        exporter.join()
    finally:
        engine.close()
    assert {key: gauge.value for key, gauge in gauges.items()} == {key: engine.status()[key] for key in gauges}


@pytest.fixture(scope="module")
def cluster():
    """A local Ray instance (2 CPUs) with Serve's proxy on a free loopback port; its URL."""
    import ray
    from ray import serve

    from rvqspec.serve.ray import free_port

    from rvqspec.serve.ray_proxy import PROXY_CALLBACK

    given = {"PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}",  # the replicas import the test double
             "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": PROXY_CALLBACK}  # as `rvqspec serve --ray` sets it
    saved = {name: os.environ.get(name) for name in given}
    os.environ.update(given)
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    finally:  # (ray.init sets variables of its own, which the command joining the cluster needs)
        for name, value in saved.items():
            os.environ.pop(name) if value is None else os.environ.update({name: value})
    port = free_port("127.0.0.1")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def deploy(url: str, voices_dir=None, max_batch: int = 2, max_queue: int = 8, **options) -> str:
    """The fake engine's app (a model that clones) in place of the one deployed."""
    from ray import serve

    from rvqspec.serve import ray as rvqspec_ray

    engine = functools.partial(FakeEngine, max_batch, max_queue, True)
    application = rvqspec_ray.app(engine, max_batch=max_batch, max_queue=max_queue, voices_dir=voices_dir, **options)
    serve.run(application, name=rvqspec_ray.APP_NAME, route_prefix="/")
    return url


@pytest.fixture(scope="module")
def two(cluster, tmp_path_factory):
    """Two replicas of the fake engine (2 rows, 8 waiting each)."""
    return deploy(cluster, tmp_path_factory.mktemp("voices"), replicas=2)


def replicas() -> dict[str, int] | None:
    """The deployed app's replicas by state (None: no app)."""
    from ray import serve

    from rvqspec.serve.ray import APP_NAME

    app = serve.status().applications.get(APP_NAME)
    return app.deployments[APP_NAME].replica_states if app else None


def speak(url: str, text: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/audio/speech", timeout=30,
                      json={"model": "fake", "input": text, "voice": "en", "response_format": "pcm", **body})


def together(url: str, n: int, text: str) -> list[httpx.Response]:
    """`n` requests sent at once: each thread waits for all the others to start (on a busy machine threads started in
    turn would send theirs after the first ones were done)."""
    got: list[httpx.Response] = []
    ready = threading.Barrier(n)

    def send() -> None:
        ready.wait()
        got.append(speak(url, text))

    threads = [threading.Thread(target=send) for _ in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return got


@needs_ray
def test_serve_ray_joins_a_cluster_streams_the_engines_audio_and_drains_on_sigterm(cluster, tmp_path):
    import ray

    with Engine("standin", max_batch=2) as engine:  # the single-process audio, computed before the replica starts
        want = to_int16(engine.speech(TEXT, voice="en", seed=5).audio())
        sample_rate = engine.sample_rate
    command = ["-m", "rvqspec.cli", "serve", "--ray", "--address", ray.get_runtime_context().gcs_address,
               "--port", cluster.rsplit(":", 1)[1], "--replicas", "1", "--max-batch", "2", "--grace", "30",
               "--voices-dir", str(tmp_path / "voices")]
    with running(command, tmp_path / "server.log") as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        with client.audio.speech.with_streaming_response.create(
                model="standin", voice="en", input=TEXT, response_format="wav", extra_body={"seed": 5}) as response:
            pieces = response.iter_bytes()
            wav = next(pieces)
            server.process.send_signal(signal.SIGTERM)  # mid-stream: the request finishes, then the app is deleted
            wav += b"".join(pieces)
        audio, rate = soundfile.read(io.BytesIO(wav), dtype="int16")
        assert rate == sample_rate and np.array_equal(audio, want)
        assert server.process.wait(timeout=60) == 0
    assert replicas() is None  # gone from the cluster, which runs on


@needs_ray
def test_concurrent_requests_spread_over_both_replicas(two):
    for _ in range(2):  # the first burst also teaches the proxy's router the replicas' queue lengths (cold: skewed)
        got = together(two, 8, "x" * 50)  # 0.5 s rows, 2 decoding at a time on a replica
        assert [r.status_code for r in got] == [200] * 8
    assert len({r.headers[REPLICA] for r in got}) == 2
    assert {r.content for r in got} == {expected("x" * 50, 0).tobytes()}


@needs_ray
def test_a_voice_registered_through_one_replica_is_spoken_by_the_other_and_deleted_everywhere(two):
    added = httpx.post(f"{two}/v1/audio/voices", json={"name": "anna", "audio": clip(1.0), "transcript": "a hum"})
    assert added.status_code == 201
    for seconds in (1.0, 2.0):  # registered again with another clip: no replica keeps the old one's prompt
        want = expected("hello", 3, voice=None, clone=f"clone:{int(16000 * seconds)}:16000:a hum").tobytes()
        by: dict[str, bytes] = {}
        for _ in range(40):  # until both replicas answered (Ray picks one at random)
            response = speak(two, "hello", voice="anna", seed=3)
            by[response.headers[REPLICA]] = response.content
            if len(by) == 2:
                break
        assert len(by) == 2 and set(by.values()) == {want}
        assert httpx.delete(f"{two}/v1/audio/voices/anna").json()["deleted"]
        for _ in range(6):
            response = speak(two, "hello", voice="anna")
            assert response.status_code == 400 and "register it" in response.json()["error"]["message"]
        if seconds == 1.0:
            added = httpx.post(f"{two}/v1/audio/voices", json={"name": "anna", "audio": clip(2.0),
                                                                "transcript": "a hum"})
            assert added.status_code == 201


@needs_ray
def test_a_killed_replica_cuts_its_stream_and_is_replaced(two):
    import ray

    body = {"model": "fake", "input": "x" * 1000, "response_format": "pcm"}  # 10 s of rows
    with httpx.stream("POST", f"{two}/v1/audio/speech", json=body, timeout=30) as response:
        pieces = response.iter_raw()
        next(pieces)
        start = time.monotonic()
        ray.kill(ray.get_actor(response.headers[REPLICA], namespace="serve"))
        with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):  # the stream breaks off, detectably
            b"".join(pieces)
    assert time.monotonic() - start < 5
    deadline = time.monotonic() + 60
    while replicas() != {"RUNNING": 2} and time.monotonic() < deadline:
        time.sleep(0.2)
    assert replicas() == {"RUNNING": 2}
    assert [r.status_code for r in together(two, 8, "x" * 20)] == [200] * 8


@needs_ray
def test_a_full_cluster_answers_429_with_retry_after_in_openais_error_shape(cluster, tmp_path):
    """A cluster small enough that 16 requests at once overflow it however the machine spreads their arrival: 2
    replicas of 1 row and 1 waiting, 1 more at the proxy (how many past the replicas' own the proxy holds depends on
    when Ray's routers count them). It takes the place of `two`'s app (the 2 CPUs hold 2 replicas): the tests after
    this one deploy their own."""
    small = deploy(cluster, tmp_path / "voices", max_batch=1, max_queue=1, replicas=2)
    got = together(small, 16, "x" * 100)  # 1 s of frames each
    statuses = sorted(r.status_code for r in got)
    assert set(statuses) == {200, 429}, statuses  # some served, the overflow refused (Ray may route 3 to a replica)
    refused = [r for r in got if r.status_code == 429]  # by the proxy, or by a replica's engine at a frame boundary
    assert all(r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "rate_limit_error" for r in refused)
    assert any("every replica is full" in r.json()["error"]["message"] for r in refused)


@needs_ray
def test_autoscaling_adds_a_replica_under_a_queue_and_removes_it_after(cluster, tmp_path):
    fast = dict(upscale_delay_s=0, downscale_delay_s=1, metrics_interval_s=0.2, look_back_period_s=0.5)
    url = deploy(cluster, tmp_path / "voices", min_replicas=1, max_replicas=2, autoscaling=fast)
    assert replicas() == {"RUNNING": 1}
    seen = set()
    load = threading.Thread(target=lambda: together(url, 4, "x" * 300))  # 2 decoding, 2 waiting: over the target
    load.start()
    while load.is_alive():
        seen.add(replicas().get("STARTING", 0) + replicas().get("RUNNING", 0))
        time.sleep(0.1)
    deadline = time.monotonic() + 30
    while replicas() != {"RUNNING": 1} and time.monotonic() < deadline:
        time.sleep(0.2)
    assert 2 in seen and replicas() == {"RUNNING": 1}
