"""Every script in benchmarks/ runs: its `--smoke` mode (tiny sizes, seconds), called in this process as
`main(argv)` (a script that starts processes of its own still does so), its reports written under tmp_path. A
script that breaks fails here, not at its next measurement. A new script gets a row in SMOKE (the test below
checks that none is missing)."""

import importlib
import os
import subprocess
from pathlib import Path

import pytest
import torch

from rvqspec.core import cpu_class

from helpers.upstream_models import upstream_available

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
UPSTREAM = "qwen-tts"  # the `ref` extra: upstream's model classes

# script -> (what it needs, extra arguments ({out}: tmp_path), the reports it writes under tmp_path ({class}: this
# CPU's class)
SMOKE = {
    "ar_vs_upstream": (UPSTREAM, ["--out", "{out}/ar_vs_upstream"], ["ar_vs_upstream.json", "ar_vs_upstream.md"]),
    "bf16_rows": (None, ["--out", "{out}"], ["bf16-rows.json", "bf16-rows.md"]),
    "capacity_prior": (None, ["--out", "{out}"], ["capacity-prior.json", "capacity-prior.md"]),
    "codec_batch": (UPSTREAM, ["--out", "{out}"], ["codec-batch.json", "codec-batch.md"]),
    "codec_batch --streaming": (UPSTREAM, ["--streaming", "--out", "{out}"], ["codec-batch-streaming.md"]),
    "compiled_frames": (None, ["--out", "{out}"], ["bench-compile.json", "bench-compile.md"]),
    "concurrency": (UPSTREAM, ["--out", "{out}"], ["concurrency.json", "concurrency.md"]),
    "codec_beside": (UPSTREAM, ["--out", "{out}"], ["codec-beside.json", "codec-beside.md"]),
    "cpu_classes": (None, [], []),  # re-renders the committed table into a temporary folder of its own
    "decoder_stream": (UPSTREAM, ["--out", "{out}"], ["decoder-stream.json", "decoder-stream.md"]),
    "draft_depth": (None, ["--out", "{out}"], ["draft-depth.json", "draft-depth.md"]),
    "end_to_end": (UPSTREAM, ["--out", "{out}"], ["end-to-end.json", "end-to-end.md"]),
    "end_to_end --size 1.7b": (UPSTREAM, ["--size", "1.7b", "--out", "{out}"], ["end-to-end-1.7b.json",
                                                                               "end-to-end-1.7b.md"]),
    "exact_rounds": (None, ["--out", "{out}"], ["exact-rounds-{class}.json", "exact-rounds-{class}.md"]),
    "frame_step": (UPSTREAM, ["--out", "{out}"], ["frame-step.json", "frame-step.md"]),
    "fused_path": (None, ["--out", "{out}"], ["fused-path.json", "fused-path.md"]),
    "gpu_graph_baseline": (None, ["--out", "{out}"], []),  # without a GPU it only says so
    "int4_probe": (None, ["--out", "{out}"], ["int4-probe.json", "int4-probe.md"]),
    "int8_calls": (None, ["--out", "{out}"], ["int8-calls.json", "int8-calls.md"]),
    "int8_cpu": (UPSTREAM, ["--out", "{out}"], ["int8-cpu.json", "int8-cpu.md"]),
    "latency_default": (None, [], []),  # writes a temporary copy of the tables
    "memory": (UPSTREAM, ["--out", "{out}"], ["memory.json", "memory.md"]),
    "live_serve": (UPSTREAM, ["--out", "{out}"], ["live-serve.json", "live-serve.md"]),
    "live_speech": (UPSTREAM, ["--out", "{out}"], ["live-speech.json", "live-speech.md"]),
    "ordered_attention": (None, ["--out", "{out}"],
                          ["ordered-attention-{class}.json", "ordered-attention-{class}.md"]),
    "packed_linear": (None, [], []),  # prints its table
    "prefill_gap": (UPSTREAM, ["--out", "{out}"], ["prefill-gap.json", "prefill-gap.md"]),
    "predictor_frame": (None, ["--out", "{out}"], ["predictor-frame.json", "predictor-frame.md"]),
    "quantization_quality": (None, ["--out", "{out}"], ["quantization-quality.json", "quantization-quality.md"]),
    "round_profile": (None, ["--out", "{out}"], ["round-profile.json", "round-profile.md"]),
    "row_draws": (None, ["--out", "{out}"], ["row-draws.json", "row-draws.md"]),
    "serve_load": (UPSTREAM, ["--out", "{out}/serve-load"], ["serve-load.json", "serve-load.md"]),
    "standin_scaling": (None, ["--out", "{out}"], ["scaling.json", "scaling.md"]),
    "speech_rate": (None, ["--out", "{out}"], ["speech-rate.json", "speech-rate.md"]),
    "talker_weights": (UPSTREAM, ["--out", "{out}"], ["talker-weights.json", "talker-weights.md"]),
    "threads": (None, ["--out", "{out}"], ["threads.json", "threads.md"]),
    "tune_standin": (None, ["--out", "{out}"], ["tune-standin.json", "tune-standin.md"]),
    "two_cores": (UPSTREAM, ["--out", "{out}"], ["two-cores.json", "two-cores.md"]),
    "weights_check": (UPSTREAM, [], []),  # prints its figures
}
NOT_SMOKED = {"make_results"}  # writes docs/RESULTS.md from the reports: tests/test_results.py runs it


def test_every_script_has_a_smoke_run():
    assert {path.stem for path in BENCHMARKS.glob("*.py")} - NOT_SMOKED == {name.split()[0] for name in SMOKE}


def test_the_gpu_check_script_parses():
    """gpu_check.sh needs a GPU machine: here, only that bash reads it."""
    assert subprocess.run(["bash", "-n", str(BENCHMARKS / "gpu_check.sh")]).returncode == 0


@pytest.fixture
def process_state():
    """What a script may change in this process and put back only on success: torch's threads, the CPUs each thread
    may run on, the working folder."""
    threads, cpus, folder = torch.get_num_threads(), os.sched_getaffinity(0), os.getcwd()
    yield
    torch.set_num_threads(threads)
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cpus)
        except OSError:  # a thread that ended meanwhile
            pass
    os.chdir(folder)


@pytest.mark.parametrize("name", sorted(SMOKE))
def test_the_script_runs_its_smoke_mode(name, tmp_path, monkeypatch, process_state):
    needs, extra, reports = SMOKE[name]
    if needs == UPSTREAM and not upstream_available():
        pytest.skip("qwen-tts reference not installed: run `make install`")
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # scripts import each other as `python benchmarks/x.py` does
    script, *options = name.split()
    status = importlib.import_module(script).main(
        ["--smoke", *options, *(arg.replace("{out}", str(tmp_path)) for arg in extra)])
    assert status in (None, 0)
    reports = [report.replace("{class}", cpu_class.cpu_class()) for report in reports]  # a report per CPU class
    assert sorted(report for report in reports if not (tmp_path / report).exists()) == []
