"""CUDA graphs on the GPU (issue 25): our AR and speculative frames eager and graph-captured (rvqspec.core.graphs),
against faster-qwen3-tts's CUDA-graph code predictor frame, same GPU, same random 0.6B weights, bf16; batch 1, then
every batch bucket (1..64); and torch.compile(mode="reduce-overhead") of our AR frame beside the hand capture.

faster-qwen3-tts (`PredictorGraph`, its whole 15-step loop captured as one CUDA graph) is loaded from its wheel
in .wheels/ without its package __init__ (which pulls its talker and GGML backends): the predictor module only,
around upstream qwen-tts's own code predictor holding our weights (`upstream_code_predictor`). Medians of --frames
frames, CUDA synchronized around each; the first call of each graph (its capture) is not timed.

    python benchmarks/gpu_graph_baseline.py --out benchmarks/results/gpu   # on the GPU machine (gpu_check.sh)
    python benchmarks/gpu_graph_baseline.py --smoke   # a tiny predictor, 2 frames (a temporary folder); without a
                                                      # GPU it only says so (CI has none)
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
from rvqspec.bench.systems import SMOKE_PREDICTOR  # noqa: E402
from rvqspec.bench.timing import SMOKE_HELP, finish_machine, machine, report_folder, write_reports  # noqa: E402
from rvqspec.core.config import QWEN3_TTS_0_6B  # noqa: E402
from rvqspec.core.context import new_context  # noqa: E402
from rvqspec.core.decode import autoregressive_codes, decode_frame, decode_frames  # noqa: E402
from rvqspec.core.graphs import BUCKETS, GraphCache  # noqa: E402
from rvqspec.core.drafters import ReusedHeads  # noqa: E402
from rvqspec.core.sampling import Sampler  # noqa: E402
from rvqspec.core.tree import default_tree  # noqa: E402
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    parser.add_argument("--frames", type=int, default=None, help="default 30 (--smoke: 2)")
    parser.add_argument("--wheels", type=Path, default=ROOT / ".wheels")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gpu")
    args = parser.parse_args(argv)
    args.frames = args.frames or (2 if args.smoke else 30)
    if not torch.cuda.is_available():
        if args.smoke:
            return print("no CUDA device here: nothing to time (benchmarks/gpu_check.sh runs this on a GPU)")
        raise SystemExit("no CUDA device: run this on a GPU machine (benchmarks/gpu_check.sh)")
    config = SMOKE_PREDICTOR if args.smoke else QWEN3_TTS_0_6B
    info, sampler, tree = machine(), Sampler(), default_tree(32)
    predictor = controlled_predictor(config, dtype="bfloat16", device="cuda")
    frames = predictor.frames(12)
    calibrated = calibrate_strength(predictor, tree, PAPER_ACCEPTANCE[32], sampler, frames, iterations=6, low=3.0,
                                    high=12.0)
    model, (hidden, c0) = predictor.model, frames[0]
    generator = torch.Generator("cuda").manual_seed(0)
    drafter, graphs = ReusedHeads(model), GraphCache()
    ours = {"eager_ar_frame_ms": lambda: decode_frame(model, hidden, c0, sampler, generator),
            "eager_spec_frame_ms": lambda: decode_frame(model, hidden, c0, sampler, generator, drafter, tree),
            "ar_frame_ms": lambda: decode_frames(model, hidden[None], torch.tensor([c0]), sampler, generator,
                                                 graphs=graphs),
            "spec_frame_ms": lambda: decode_frames(model, hidden[None], torch.tensor([c0]), sampler, generator,
                                                   drafter, tree, graphs=graphs)}
    timed = {name: median_ms(fn, args.frames) for name, fn in ours.items()}
    PredictorGraph, wheel = predictor_graph_class(args.wheels)
    upstream = upstream_code_predictor(model)
    graph = PredictorGraph(upstream, upstream.config, config.talker_hidden_size, device="cuda",
                           dtype=torch.bfloat16, do_sample=True, top_k=sampler.top_k, temperature=sampler.temperature)
    graph.capture()
    with torch.no_grad():
        c0_embed = model.code_embed.weight[int(c0)]  # the talker's c0 row of the shared table (offset 0)
        pred_input = torch.stack([hidden, c0_embed])[None].to(torch.bfloat16)
    timed["upstream_graph_frame_ms"] = median_ms(lambda: graph.run(pred_input), args.frames)
    report = {"graphs": timed, "compiled_ar_frame_ms": compiled_ar(model, hidden, c0, sampler, args.frames),
              "batches": batched(predictor, sampler, args.frames), "tokens_per_step": calibrated.measured,
              "tree_size": 32, "faster_qwen3_tts": wheel, "gpu": torch.cuda.get_device_name(),
              "machine": finish_machine(info)}
    for path in write_reports(report, report_folder(args.out, args.smoke), "graph-baseline", to_markdown):
        print(f"wrote {path}")


def compiled_ar(model, hidden, c0, sampler, frames: int):
    """torch.compile(mode="reduce-overhead") of the AR frame on a static cache: ms, or why it failed."""
    cache = model.new_cache(1, model.config.num_code_groups)
    inputs = (hidden[None].clone(), torch.tensor([c0], device="cuda"))
    with torch.inference_mode():
        ctx = new_context(model, cache, sampler, None, None, None, 1)
    try:
        step = torch.compile(lambda h, c: autoregressive_codes(ctx, h, c),
                             mode="reduce-overhead")
        with torch.inference_mode():
            for _ in range(3):
                step(*inputs)
            return median_ms(lambda: step(*inputs), frames)
    except Exception as e:  # a report, not a crash: the hand capture is measured either way
        return f"{type(e).__name__}: {str(e)[:200]}"


def batched(predictor, sampler, frames: int) -> list[dict]:
    """ms per frame at each bucket: eager AR, graph AR, graph speculative N = 8 and 32 (one GraphCache)."""
    model, graphs, drafter, rows = predictor.model, GraphCache(), ReusedHeads(predictor.model), []
    generator = torch.Generator("cuda").manual_seed(0)
    for batch in BUCKETS:
        picked = predictor.frames(batch, seed=batch)
        hidden, c0 = torch.stack([h for h, _ in picked]), torch.tensor([c for _, c in picked])
        calls = {"eager_ar": lambda: decode_frames(model, hidden, c0, sampler, generator),
                 "graph_ar": lambda: decode_frames(model, hidden, c0, sampler, generator, graphs=graphs)}
        for n in (8, 32):
            calls[f"graph_spec_n{n}"] = lambda n=n: decode_frames(model, hidden, c0, sampler, generator, drafter,
                                                                  default_tree(n), graphs=graphs)
        row = {"batch": batch} | {name: median_ms(fn, max(frames // 3, 5)) / batch for name, fn in calls.items()}
        rows.append(row)
        print(row, flush=True)
    return rows


def to_markdown(r: dict) -> str:
    g = r["graphs"]
    compiled = r["compiled_ar_frame_ms"]
    lines = ["# CUDA graphs: rvqspec eager and captured, faster-qwen3-tts's captured predictor frame", "",
             f"{r['gpu']}, bf16, random 0.6B weights; heads at {r['tokens_per_step']:.2f} tokens/step (N=32).", "",
             "| frame, batch 1 | ms |", "|---|---|",
             f"| rvqspec eager AR | {g['eager_ar_frame_ms']:.2f} |",
             f"| rvqspec eager speculative N=32 | {g['eager_spec_frame_ms']:.2f} |",
             f"| rvqspec CUDA graphs AR | {g['ar_frame_ms']:.2f} |",
             f"| rvqspec CUDA graphs speculative N=32 | {g['spec_frame_ms']:.2f} |",
             f"| rvqspec AR, torch.compile(mode='reduce-overhead') | "
             f"{compiled if isinstance(compiled, str) else f'{compiled:.2f}'} |",
             f"| faster-qwen3-tts CUDA graph AR ({r['faster_qwen3_tts']}) | {g['upstream_graph_frame_ms']:.2f} |", "",
             "| batch | eager AR ms/frame | graph AR | graph spec N=8 | graph spec N=32 |", "|---|---|---|---|---|"]
    lines += [f"| {b['batch']} | {b['eager_ar']:.2f} | {b['graph_ar']:.2f} | {b['graph_spec_n8']:.2f} | "
              f"{b['graph_spec_n32']:.2f} |" for b in r["batches"]]
    return "\n".join(lines + [""])


if __name__ == "__main__":
    main()
