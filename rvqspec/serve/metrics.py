"""The server's counters, and /metrics in Prometheus' text format (written here: no client library needed)."""

import threading
from collections import Counter

FIRST_AUDIO_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)  # seconds


class Metrics:
    def __init__(self):
        self.statuses: Counter = Counter()
        self.first_audio = [0] * len(FIRST_AUDIO_BUCKETS)  # cumulative counts: observations <= each bucket
        self.first_audio_sum, self.first_audio_count = 0.0, 0
        self.lock = threading.Lock()

    def count_status(self, status: int) -> None:
        with self.lock:
            self.statuses[status] += 1

    def observe_first_audio(self, seconds: float) -> None:
        with self.lock:
            for i, bound in enumerate(FIRST_AUDIO_BUCKETS):
                self.first_audio[i] += seconds <= bound
            self.first_audio_sum += seconds
            self.first_audio_count += 1

    def text(self, status: dict) -> str:
        """The exposition: this server's counters and the engine's `status()`."""
        with self.lock:
            lines = family("rvqspec_requests_total", "counter", "HTTP requests answered, by status code",
                           [(f'{{status="{code}"}}', n) for code, n in sorted(self.statuses.items())])
            buckets = [(f'{{le="{bound}"}}', n) for bound, n in zip(FIRST_AUDIO_BUCKETS, self.first_audio)]
            buckets.append(('{le="+Inf"}', self.first_audio_count))
            lines += family("rvqspec_time_to_first_audio_seconds", "histogram",
                            "Seconds from a speech request's submission to its first audio chunk", [])
            lines += [f"rvqspec_time_to_first_audio_seconds_bucket{labels} {n}" for labels, n in buckets]
            lines += [f"rvqspec_time_to_first_audio_seconds_sum {self.first_audio_sum}",
                      f"rvqspec_time_to_first_audio_seconds_count {self.first_audio_count}"]
        lines += family("rvqspec_active_rows", "gauge", "Requests decoding in the current batch",
                        [("", status["active"])])
        lines += family("rvqspec_queued_requests", "gauge", "Requests waiting for a batch row",
                        [("", status["queued"])])
        lines += family("rvqspec_frames_total", "counter", "Frames decoded", [("", status["frames"])])
        lines += family("rvqspec_audio_seconds_total", "counter", "Seconds of audio produced",
                        [("", status["audio_seconds"])])
        lines += family("rvqspec_tokens_per_step", "gauge", "The code predictor's codes per call",
                        [("", status["tokens_per_step"])])
        lines += family("rvqspec_capacity_frames_per_second", "gauge",
                        "Frames per second the current batch sustains (measured frame steps)",
                        [("", status["frames_per_second"])])
        lines += family("rvqspec_realtime_rows", "gauge", "The most rows the frame loop keeps at real time (-1: not "
                        "measured yet)", [("", -1 if status["realtime_rows"] is None else status["realtime_rows"])])
        lines += family("rvqspec_row_real_time_factor", "gauge",
                        "Each decoding row's audio seconds per second since its first frame",
                        [(f'{{row="{i}"}}', factor) for i, factor in enumerate(status["real_time_factors"])])
        lines += family("rvqspec_largest_chunk_gap_seconds", "gauge",
                        "The longest wait between two audio chunks of a stream: of those streaming now, and ever",
                        [('{of="now"}', status["largest_chunk_gap"]),
                         ('{of="ever"}', status["largest_chunk_gap_ever"])])
        tree = str(status["tree"]).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        lines += family("rvqspec_policy_tree", "gauge", "The decoding policy's choice for the current batch (label)",
                        [(f'{{tree="{tree}"}}', 1)])
        return "\n".join(lines) + "\n"


def family(name: str, kind: str, help: str, samples: list[tuple[str, float]]) -> list[str]:
    return [f"# HELP {name} {help}", f"# TYPE {name} {kind}", *(f"{name}{labels} {value}" for labels, value in samples)]
