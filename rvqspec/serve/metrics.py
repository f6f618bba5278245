"""The server's metrics for /metrics, in Prometheus' exposition format (`prometheus_client`, a registry per app):
its own counters and histogram, and the engine's `status()` read at each scrape (`EngineStatus`)."""

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

FIRST_AUDIO_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)  # seconds
END_REASONS = ("eos", "length", "cancelled", "error")  # how a speech request ended (runtime/request.py)


class Metrics:
    def __init__(self, engine):
        self.registry = CollectorRegistry()
        self.statuses = Counter("rvqspec_requests", "HTTP requests answered, by status code", ["status"],
                                registry=self.registry)
        self.first_audio = Histogram("rvqspec_time_to_first_audio_seconds", "Seconds from a speech request's "
                                     "submission to its first audio chunk", buckets=FIRST_AUDIO_BUCKETS,
                                     registry=self.registry)
        self.ends = Counter("rvqspec_speech_ends", "Speech requests by how they ended: eos (the model's end), length "
                            "(its frame budget), cancelled (the client left, or stalled), error", ["reason"],
                            registry=self.registry)
        for reason in END_REASONS:
            self.ends.labels(reason)
        self.stalled = Counter("rvqspec_stalled_clients", "Streams ended because the client stopped reading",
                               registry=self.registry)
        self.registry.register(EngineStatus(engine))

    def count_status(self, status: int) -> None:
        self.statuses.labels(str(status)).inc()

    def observe_first_audio(self, seconds: float) -> None:
        self.first_audio.observe(seconds)

    def count_end(self, reason: str | None) -> None:
        self.ends.labels(reason or "cancelled").inc()

    def text(self) -> bytes:
        """The exposition: this server's metrics and the engine's `status()`."""
        return generate_latest(self.registry)


class EngineStatus:
    """The engine's `status()` as metric families, read at each scrape."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        status = self.engine.status()
        yield gauge("rvqspec_active_rows", "Requests decoding in the current batch", status["active"])
        yield gauge("rvqspec_queued_requests", "Requests waiting for a batch row", status["queued"])
        yield CounterMetricFamily("rvqspec_frames", "Frames decoded", status["frames"])
        yield CounterMetricFamily("rvqspec_audio_seconds", "Seconds of audio produced", status["audio_seconds"])
        yield gauge("rvqspec_tokens_per_step", "The code predictor's codes per call", status["tokens_per_step"])
        yield gauge("rvqspec_capacity_frames_per_second", "Frames per second the current batch sustains (measured "
                    "frame steps)", status["frames_per_second"])
        realtime = status["realtime_rows"]
        yield gauge("rvqspec_realtime_rows", "The most rows the frame loop keeps at real time (-1: not measured yet)",
                    -1 if realtime is None else realtime)
        factors = GaugeMetricFamily("rvqspec_row_real_time_factor", "Each decoding row's audio seconds per second "
                                    "since its first frame", labels=["row"])
        for i, factor in enumerate(status["real_time_factors"]):
            factors.add_metric([str(i)], factor)
        yield factors
        gaps = GaugeMetricFamily("rvqspec_largest_chunk_gap_seconds", "The longest wait between two audio chunks of "
                                 "a stream: of those streaming now, and ever", labels=["of"])
        gaps.add_metric(["now"], status["largest_chunk_gap"])
        gaps.add_metric(["ever"], status["largest_chunk_gap_ever"])
        yield gaps
        tree = GaugeMetricFamily("rvqspec_policy_tree", "The decoding policy's choice for the current batch (label)",
                                 labels=["tree"])
        tree.add_metric([str(status["tree"])], 1)
        yield tree


def gauge(name: str, help: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, help, value=value)
