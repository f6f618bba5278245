"""`rvqspec serve --ray`: the same app (rvqspec.serve.app) on Ray Serve, one Engine per replica, on one machine or a
Ray cluster. Needs `rvqspec[ray]`.

    from ray import serve
    from rvqspec.serve import ray as rvqspec_ray
    serve.run(rvqspec_ray.app(model="standin", replicas=2), route_prefix="/")    # or compose it with your own

Each replica builds its Engine and the app in its own process (Ray Serve's FastAPI ingress, built on the replica).
Ray's proxy sends a request to a replica with room (at most max_batch + max_queue in flight on each: the Engine's
batch and queue), scales between min and max replicas on ongoing requests
(the target: a full batch on each), restarts a replica that dies, and answers 429 with Retry-After once every replica
is full and max_queue more wait at the proxy. Every replica keeps its voices in one folder (on a cluster: on storage
that all nodes see) and reads it on each lookup, so a voice registered or deleted through one replica is so on all.
Each replica's /metrics counts its own requests; its engine's status also goes to Ray's metrics export (STATUS_METRICS,
tagged with the replica).
"""

import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import ray
import torch
from ray import serve
from ray.serve.metrics import Gauge

from rvqspec.core.errors import RvqspecError
from rvqspec.runtime import Engine
from rvqspec.serve import BODY_SECONDS
from rvqspec.serve.app import create_app
from rvqspec.serve.stream import RETRY_AFTER_SECONDS
from rvqspec.serve.ray_proxy import PROXY_CALLBACK
from rvqspec.serve.server import bind
from rvqspec.serve.voices import MAX_VOICES, VOICES_QUOTA, VoiceStore

APP_NAME = "rvqspec"
REPLICA_HEADER = b"x-rvqspec-replica"  # which replica answered: Ray's replica id (its actor's name)
CONSTRUCTOR_TRIES = 3  # a replica whose Engine cannot be built (a bad checkpoint) fails the deployment after this many
METRICS_SECONDS = 5.0  # how often a replica copies its engine's status into Ray's metrics
STATUS_METRICS = {  # engine.status() key: (Ray metric, its description); exported as ray_<metric>, per replica
    "active": ("rvqspec_active_rows", "Requests decoding in the replica's batch"),
    "queued": ("rvqspec_queued_requests", "Requests waiting for a batch row in the replica"),
    "frames": ("rvqspec_frames", "Frames the replica decoded"),
    "audio_seconds": ("rvqspec_audio_seconds", "Seconds of audio the replica produced"),
    "frames_per_second": ("rvqspec_capacity_frames_per_second", "Frames per second the replica's batch sustains"),
    "largest_chunk_gap": ("rvqspec_largest_chunk_gap_seconds", "The longest wait between two audio chunks of a "
                          "stream in the replica now"),
}


class SharedVoices(VoiceStore):
    """A VoiceStore that other processes change too: a cached clone prompt is used only while the voice on disk is
    the one it was made from (a voice deleted and registered again elsewhere is a new file)."""

    def __init__(self, folder: str | Path, max_voices: int = MAX_VOICES, quota: int = VOICES_QUOTA):
        super().__init__(folder, max_voices, quota)
        self.stamps: dict[str, tuple[int, int]] = {}

    def prompt(self, name: str, engine) -> object:
        meta = os.stat(self.folder / name / "voice.json")
        stamp = (meta.st_ino, meta.st_mtime_ns)
        with self.lock:
            if self.stamps.get(name) != stamp:
                self.prompts.pop(name, None)
                self.stamps[name] = stamp
        return super().prompt(name, engine)


@serve.ingress()
class Replica:
    """One replica: an Engine (built here, in the replica's process), the shared voices, the app."""

    def __init__(self, model: str | Callable[[], object], engine_options: dict, voices_dir: str | None,
                 api_key: str | None, threads: int, guards: dict):
        torch.set_num_threads(threads)
        self.engine = model() if callable(model) else Engine(model, **engine_options)
        folder = voices_dir or Path.home() / ".cache" / "rvqspec" / "voices" / self.engine.name
        self.voices = SharedVoices(folder, guards["max_voices"], guards["voices_quota"])
        self.api_key, self.guards = api_key, guards
        self.threads = engine_options["max_batch"] + engine_options["max_queue"] + 16  # as `rvqspec serve`'s
        self.stop = threading.Event()
        gauges = {key: Gauge(name, description=text) for key, (name, text) in STATUS_METRICS.items()}
        threading.Thread(target=export_status, args=(self.engine, gauges, self.stop), daemon=True).start()

    def __serve_build_asgi_app__(self):
        replica = serve.get_replica_context().replica_id.to_full_id_str()
        return tagged(create_app(self.engine, self.voices, self.api_key, self.threads, self.guards["allowed_hosts"],
                                 self.guards["body_seconds"]), replica)

    def __del__(self):
        self.stop.set()
        self.engine.close(grace=0)


def export_status(engine, gauges: dict, stop: threading.Event) -> None:
    """Copy the engine's status into Ray's gauges every METRICS_SECONDS, until `stop`."""
    while not stop.wait(METRICS_SECONDS):
        status = engine.status()
        for key, gauge in gauges.items():
            gauge.set(status[key])


def tagged(app, replica: str):
    """`app` with a header on every response naming the replica that answered."""
    async def with_header(scope, receive, send):
        async def send_tagged(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (REPLICA_HEADER, replica.encode())]}
            await send(message)

        await app(scope, receive, send_tagged if scope["type"] == "http" else send)
    return with_header


def app(model: str | Callable[[], object] = "standin", *, replicas: int | None = None,
        min_replicas: int | None = None, max_replicas: int | None = None, threads_per_replica: int = 1,
        max_batch: int = 8, max_queue: int = 32, weights: str | None = None, talker_weights: str | None = None,
        voices_dir: str | Path | None = None, api_key: str | None = None, grace: float = 30.0,
        autoscaling: dict | None = None, allowed_hosts: tuple[str, ...] = (), max_voices: int = MAX_VOICES,
        voices_quota: int = VOICES_QUOTA, body_seconds: float = BODY_SECONDS) -> serve.Application:
    """The Ray Serve application of `rvqspec serve` on `model` ("standin", a checkpoint folder every node can read,
    or a zero-argument callable building an Engine-like object in each replica): `replicas` fixed, or between
    `min_replicas` and `max_replicas` scaled on ongoing requests (`autoscaling`: more of Ray's autoscaling_config,
    e.g. its delays). Each replica is one Engine of `max_batch` rows and `max_queue` waiting, on
    `threads_per_replica` torch threads (and as many of Ray's CPUs). Run it with `serve.run(app(...),
    route_prefix="/")`; `grace`: seconds a stopping replica lets its requests finish; `allowed_hosts`, `max_voices`,
    `voices_quota` (bytes) and `body_seconds` as `rvqspec serve`'s flags."""
    scaling = replica_count(replicas, min_replicas, max_replicas)
    if "autoscaling_config" in scaling:
        scaling["autoscaling_config"].update(target_ongoing_requests=max_batch, **(autoscaling or {}))
    elif autoscaling:
        raise RvqspecError("autoscaling settings need min_replicas and max_replicas: give those instead of replicas")
    engine_options = dict(max_batch=max_batch, max_queue=max_queue, weights=weights, talker_weights=talker_weights,
                          cores=threads_per_replica)
    deployment = serve.deployment(
        Replica, name=APP_NAME, ray_actor_options={"num_cpus": threads_per_replica},
        max_ongoing_requests=max_batch + max_queue, max_queued_requests=max_queue,
        backpressure_config={"status_code": 429, "retry_after_s": RETRY_AFTER_SECONDS},
        graceful_shutdown_timeout_s=grace, graceful_shutdown_wait_loop_s=0.5,
        max_constructor_retry_count=CONSTRUCTOR_TRIES, **scaling)
    guards = dict(allowed_hosts=allowed_hosts, max_voices=max_voices, voices_quota=voices_quota,
                  body_seconds=body_seconds)
    return deployment.bind(model, engine_options, None if voices_dir is None else str(voices_dir), api_key,
                           threads_per_replica, guards)


def replica_count(replicas: int | None, min_replicas: int | None, max_replicas: int | None) -> dict:
    """The deployment's num_replicas or autoscaling_config (min and max)."""
    if min_replicas is None and max_replicas is None:
        count = 1 if replicas is None else replicas
        if count < 1:
            raise RvqspecError(f"replicas is {count}: use 1 or more")
        return {"num_replicas": count}
    if replicas is not None:
        raise RvqspecError("replicas (--replicas) is a fixed number, min_replicas and max_replicas (--min-replicas, "
                           "--max-replicas) autoscale: give one or the other")
    if min_replicas is None or max_replicas is None or not 1 <= min_replicas <= max_replicas:
        raise RvqspecError(f"min_replicas {min_replicas} and max_replicas {max_replicas} (--min-replicas, "
                           "--max-replicas): give both, with 1 <= min_replicas <= max_replicas")
    return {"autoscaling_config": {"min_replicas": min_replicas, "max_replicas": max_replicas,
                                   "initial_replicas": min_replicas}}


def free_port(host: str, port: int = 0) -> int:
    """`port` on `host` if it is free now (0: any free port); OSError if it is taken."""
    with bind(host, port) as sock:
        return sock.getsockname()[1]


def run(application: serve.Application, name: str, address: str | None, host: str, port: int,
        grace: float) -> None:
    """Deploy `application` on Ray (a local instance, or the cluster at `address`) behind Ray's HTTP proxy on
    host:port (0 on a local instance: a free port), print its address, serve until SIGTERM or Ctrl-C, then delete the
    application, its replicas draining for up to `grace` seconds (the deployment's), and on a local instance stop
    Serve and Ray."""
    if not address:  # a taken port fails now, before Ray starts (a cluster's Serve may hold it already: its own)
        port = free_port(host, port)
        os.environ.setdefault("RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH", PROXY_CALLBACK)  # the proxy's errors as JSON
    ray.init(address=address, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(application, name=APP_NAME, route_prefix="/")
        where = f"the Ray cluster at {address}" if address else "a local Ray instance"
        host = f"[{host}]" if ":" in host else host
        print(f"rvqspec serve: {name} on http://{host}:{port} (Ray Serve on {where})", flush=True)
        stop = threading.Event()
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
        try:
            while not stop.wait(1.0):
                pass
        finally:
            signal.signal(signal.SIGTERM, previous)
    finally:
        print(f"rvqspec serve: stopping: in-flight requests get up to {grace:g} s", file=sys.stderr, flush=True)
        serve.delete(APP_NAME)  # drains: each replica finishes its requests (up to grace) before it stops
        if not address:
            serve.shutdown()
        ray.shutdown()
