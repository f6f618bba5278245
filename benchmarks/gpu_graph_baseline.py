"""The GPU baseline rvqspec's speculation must beat (issue 25): faster-qwen3-tts's CUDA-graph code predictor frame
against our eager AR and speculative frames, same GPU, same random 0.6B weights, bf16, batch 1.

faster-qwen3-tts (`PredictorGraph`, its whole 15-step loop captured as one CUDA graph) is loaded from its wheel
in .wheels/ without its package __init__ (which pulls its talker and GGML backends): the predictor module only,
around upstream qwen-tts's own code predictor holding our weights (`upstream_code_predictor`). Our frames run
eagerly (rvqspec has no graph runner yet). Medians of --frames frames, CUDA synchronized around each.

    python benchmarks/gpu_graph_baseline.py --out benchmarks/results/gpu   # on the GPU machine (gpu_check.sh)
"""

import argparse
import importlib
import statistics
import sys
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rvqspec.bench.controlled import PAPER_ACCEPTANCE, calibrate_strength, controlled_predictor  # noqa: E402
from rvqspec.bench.timing import finish_machine, machine, write_reports  # noqa: E402
from rvqspec.engine.config import QWEN3_TTS_0_6B  # noqa: E402
from rvqspec.engine.decode import decode_frame  # noqa: E402
from rvqspec.engine.drafters import ReusedHeads  # noqa: E402
from rvqspec.engine.sampling import Sampler  # noqa: E402
from rvqspec.engine.tree import default_tree  # noqa: E402
from rvqspec.integrations.qwen_tts import upstream_code_predictor  # noqa: E402


def predictor_graph_class(wheels: Path):
    """faster_qwen3_tts.predictor_graph.PredictorGraph from its wheel (a zip on sys.path), __init__ skipped."""
    wheel = next(iter(sorted(wheels.glob("faster_qwen3_tts-*.whl"))), None)
    if wheel is None:
        raise SystemExit(f"no faster_qwen3_tts wheel in {wheels}: `pip download --no-deps faster-qwen3-tts -d {wheels}`")
    package = types.ModuleType("faster_qwen3_tts")
    package.__path__ = [f"{wheel}/faster_qwen3_tts"]  # zipimport reads inside the wheel
    sys.modules["faster_qwen3_tts"] = package
    return importlib.import_module("faster_qwen3_tts.predictor_graph").PredictorGraph, wheel.name


def median_ms(fn, frames: int) -> float:
    times = []
    for _ in range(frames + 3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times[3:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=30)
    parser.add_argument("--wheels", type=Path, default=ROOT / ".wheels")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gpu")
    args = parser.parse_args()
    info, sampler, tree = machine(), Sampler(), default_tree(32)
    predictor = controlled_predictor(QWEN3_TTS_0_6B, dtype="bfloat16", device="cuda")
    frames = predictor.frames(12)
    calibrated = calibrate_strength(predictor, tree, PAPER_ACCEPTANCE[32], sampler, frames, iterations=6, low=3.0,
                                    high=12.0)
    model, (hidden, c0) = predictor.model, frames[0]
    generator = torch.Generator("cuda").manual_seed(0)
    drafter = ReusedHeads(model)
    ours_ar = median_ms(lambda: decode_frame(model, hidden, c0, sampler, generator), args.frames)
    ours_spec = median_ms(lambda: decode_frame(model, hidden, c0, sampler, generator, drafter, tree), args.frames)
    PredictorGraph, wheel = predictor_graph_class(args.wheels)
    upstream = upstream_code_predictor(model)
    graph = PredictorGraph(upstream, upstream.config, QWEN3_TTS_0_6B.talker_hidden_size, device="cuda",
                           dtype=torch.bfloat16, do_sample=True, top_k=sampler.top_k, temperature=sampler.temperature)
    graph.capture()
    with torch.no_grad():
        c0_embed = model.code_embed.weight[int(c0)]  # the talker's c0 row of the shared table (offset 0)
        pred_input = torch.stack([hidden, c0_embed])[None].to(torch.bfloat16)
    theirs = median_ms(lambda: graph.run(pred_input), args.frames)
    report = {"graphs": {"ar_frame_ms": None, "spec_frame_ms": None, "eager_ar_frame_ms": ours_ar,
                         "eager_spec_frame_ms": ours_spec, "upstream_graph_frame_ms": theirs},
              "note": "rvqspec's graph runner is not built yet: ar_frame_ms / spec_frame_ms are not measured",
              "tokens_per_step": calibrated.measured, "tree_size": 32, "faster_qwen3_tts": wheel,
              "gpu": torch.cuda.get_device_name(), "machine": finish_machine(info)}
    for path in write_reports(report, args.out, "graph-baseline", to_markdown):
        print(f"wrote {path}")


def to_markdown(r: dict) -> str:
    g = r["graphs"]
    return "\n".join([
        "# The GPU baseline: faster-qwen3-tts's CUDA-graph predictor frame vs rvqspec eager", "",
        f"{r['gpu']}, bf16, batch 1, random 0.6B weights; heads at {r['tokens_per_step']:.2f} tokens/step (N=32). "
        f"{r['note']}.", "", "| frame | ms |", "|---|---|",
        f"| rvqspec eager AR | {g['eager_ar_frame_ms']:.2f} |", f"| rvqspec eager speculative N=32 | {g['eager_spec_frame_ms']:.2f} |",
        f"| faster-qwen3-tts CUDA graph AR ({r['faster_qwen3_tts']}) | {g['upstream_graph_frame_ms']:.2f} |", ""])


if __name__ == "__main__":
    main()
