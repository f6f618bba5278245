"""Bit-exact rounds (issue 51, item 4): speculative codes against AR codes, frame by frame, and what the ordered
attention costs, on this CPU's class (run it natively and under `ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2`).

- exactness: the shipped stand-in's predictor with w8a8 weights (float32 activations) on random talker states (low
  confidence: near-ties happen) and random c0, `--frames` frames: greedy codes of speculative frames (the shipped
  offsets drafter and calibrated trees N = 4, 16), alone and in batches of 8, and AR frames in batches of 8, each
  against the AR frame alone; seeded sampled speculative frames (a generator per frame, seeded by its index) in
  batches of 8 against the AR frames (in batches of 8: `REFERENCE`). Per
  attention: SDPA as before (`packing.attention`, the measured query floor) and the ordered kernel
  (`fused.attention_in_order`). The float stand-in (float32, bfloat16) greedy, `--float-frames` frames, for what
  remains there.
- cost: one predictor call at the 0.6B sizes (random weights, head_dim 128), an AR step (one query, 16 slots) and
  verify calls of N = 4, 16, 32 (N + 1 queries over 16 + N + 1 slots), with SDPA and with the ordered kernel,
  interleaved in one process, medians; w8a8 (bfloat16 activations, as the Engine runs it), bfloat16, float32.

    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=. .venv/bin/python benchmarks/exact_rounds.py [--frames 1000]
    # -> benchmarks/results/exact-rounds-<class>.{json,md}
    .venv/bin/python benchmarks/exact_rounds.py --smoke   # a few frames, the smoke predictor's calls: seconds
"""

import argparse
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rvqspec import MultiCodeDecoder, Offsets, Sampler, Tree, decode_frames, quantize  # noqa: E402
from rvqspec.bench.systems import smoke_config  # noqa: E402
from rvqspec.bench.timing import SMOKE_HELP, finish_machine, machine, machine_text, report_folder, write_reports  # noqa: E402,E501
from rvqspec.core import cpu_class, fused, packing  # noqa: E402
from rvqspec.core.config import QWEN3_TTS_0_6B  # noqa: E402
from rvqspec.core.context import plan_for  # noqa: E402
from rvqspec.core.device_path import median_ms, prepare  # noqa: E402
from rvqspec.core.tree import default_tree  # noqa: E402
from rvqspec.standin.settings import MODEL_DIR, OFFSETS_FILE, TREES_DIR  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
ATTENTIONS = {"sdpa": packing.attention, "ordered": fused.attention_in_order}
BATCH = 8
GREEDY, SAMPLED = Sampler(do_sample=False), Sampler()
RUNS = {  # name: (sampler, tree budget or None for AR, frames per call); against the AR frames of REFERENCE
    "greedy ar, batches of 8": (GREEDY, None, BATCH), "greedy N=4 alone": (GREEDY, 4, 1),
    "greedy N=4, batches of 8": (GREEDY, 4, BATCH), "greedy N=16, batches of 8": (GREEDY, 16, BATCH),
    "sampled N=4, batches of 8": (SAMPLED, 4, BATCH), "sampled N=16, batches of 8": (SAMPLED, 16, BATCH)}
REFERENCE = {"greedy": 1, "sampled": BATCH}  # AR frames per call: greedy alone; sampled in batches (greedy shows
# that batches of AR frames are the frames alone, and a shared machine leaves time for one pass alone)
COST_BUDGETS = (4, 16, 32)


@contextmanager
def attending(name: str):
    """The predictor's cached forwards attend with ATTENTIONS[name] inside the block."""
    before = fused.attention_in_order
    fused.attention_in_order = ATTENTIONS[name]
    try:
        yield
    finally:
        fused.attention_in_order = before


def decode_all(model, hidden, c0, sampler, drafter, tree, per_call: int) -> torch.Tensor:
    """Codes [F, G-1] of every frame, `per_call` frames per decode call, frame f seeded f (when sampling)."""
    codes = []
    for start in range(0, len(c0), per_call):
        rows = range(start, min(start + per_call, len(c0)))
        seeds = [torch.Generator().manual_seed(f) for f in rows]
        codes.append(decode_frames(model, hidden[rows.start:rows.stop], c0[rows.start:rows.stop], sampler, seeds,
                                   drafter, tree).codes)
    return torch.cat(codes)


def differing(codes: torch.Tensor, reference: torch.Tensor) -> list[int]:
    return (codes != reference).any(1).nonzero().flatten().tolist()


def standin_inputs(model, frames: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(frames, model.config.talker_hidden_size, generator=generator).to(model.dtype)
    return hidden, torch.randint(model.config.vocab_size, (frames,), generator=generator)


@torch.inference_mode()
def exactness(model, frames: int, runs: dict, log) -> dict:
    """Per run of `runs`, the frames whose codes differ from the AR frame's alone (module docstring)."""
    hidden, c0 = standin_inputs(model, frames)
    drafter = Offsets.load(OFFSETS_FILE)
    references, out = {}, {}
    for name, (sampler, budget, per_call) in runs.items():
        kind = "greedy" if sampler is GREEDY else "sampled"
        if kind not in references:
            references[kind] = decode_all(model, hidden, c0, sampler, None, None, REFERENCE[kind])
        tree = Tree.load(TREES_DIR / f"tree-N{budget}.json") if budget else None
        codes = decode_all(model, hidden, c0, sampler, drafter if budget else None, tree, per_call)
        out[name] = differing(codes, references[kind])
        log(f"  {name}: {len(out[name])} of {frames} frames differ {out[name][:8]}")
    return out


def cost_model(dtype: torch.dtype, weights: str | None, smoke: bool):
    torch.manual_seed(0)
    model = MultiCodeDecoder(smoke_config(QWEN3_TTS_0_6B) if smoke else QWEN3_TTS_0_6B).eval().to(dtype)
    model = quantize(model, weights) if weights else model
    prepare(model)
    return model


@torch.inference_mode()
def call_costs(model, reps: int) -> dict:
    """Median ms of an AR step and of verify calls at COST_BUDGETS, each with SDPA and with the ordered kernel,
    interleaved (module docstring)."""
    c, generator = model.config, torch.Generator().manual_seed(1)
    groups, calls = c.num_code_groups, {}
    k = torch.tensor([7])
    for budget in (None, *COST_BUDGETS):
        tree = default_tree(budget) if budget else None
        slots = groups + (tree.size + 1 if tree else 0)
        cache = model.new_cache(1, slots)
        cache.kv.copy_(torch.randn(cache.kv.shape, generator=generator).to(model.dtype) * 0.5)
        if tree is None:
            position = k + 1
            args = (position, (torch.arange(slots) <= position)[None], cache, position)
        else:
            plan = plan_for(tree, model)
            args = (plan.positions[k], plan.masks[k], cache, plan.scratch)
        x = torch.randn(1, len(args[0].reshape(-1)), c.hidden_size, generator=generator).to(model.dtype)
        for name in ATTENTIONS:
            def call(x=x, args=args, name=name):
                with attending(name):
                    model(x, *args)
            calls[(f"N={budget}" if budget else "AR", name)] = call
    times = median_ms(calls, reps)
    rows = {}
    for (shape, name), ms in times.items():
        rows.setdefault(shape, {})[f"{name} ms"] = round(ms, 4)
    for row in rows.values():
        row["ordered / sdpa"] = round(row["ordered ms"] / row["sdpa ms"], 4)
    return rows


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = [f"# Bit-exact rounds: speculative codes against AR, {m['cpu_class']}", "",
             f"{machine_text(m)}; 1 thread; `benchmarks/exact_rounds.py --frames {report['frames']}`.", "",
             f"## The stand-in with w8a8 weights, {report['frames']} random talker states: frames whose codes differ "
             "from the AR frames' (greedy: AR alone; seeded sampled: AR in batches of 8)", "", "| run | SDPA (before) | ordered attention (after) |", "|---|---:|---:|"]
    for name in RUNS:
        cells = [str(len(report["w8a8"][a][name])) if name in report["w8a8"].get(a, {}) else "-" for a in ATTENTIONS]
        lines.append(f"| {name} | {' | '.join(cells)} |")
    lines += ["", f"Float stand-in (no quantization), greedy, {report['float_frames']} frames, ordered attention: "
              + "; ".join(f"{dtype}: {', '.join(f'{name} {len(d)}' for name, d in runs.items())}"
                          for dtype, runs in report["float"].items()), "",
              "## One predictor call at the 0.6B sizes, SDPA against the ordered kernel (medians of interleaved "
              "calls, ms)", "", "| weights | call | SDPA | ordered | ordered / SDPA |", "|---|---|---:|---:|---:|"]
    for weights, rows in report["costs"].items():
        lines += [f"| {weights} | {shape} | {r['sdpa ms']:.3f} | {r['ordered ms']:.3f} | {r['ordered / sdpa']:.3f} |"
                  for shape, r in rows.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=1000)
    parser.add_argument("--float-frames", type=int, default=300)
    parser.add_argument("--before", default="greedy", help="which runs also go through SDPA: greedy, all or none")
    parser.add_argument("--reps", type=int, default=21)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args(argv)
    if args.smoke:
        args.frames, args.float_frames, args.reps = 8, 8, 1
    torch.set_num_threads(1)
    info = machine()
    report = {"machine": info, "frames": args.frames, "float_frames": args.float_frames, "w8a8": {}, "float": {}}
    w8a8 = quantize(MultiCodeDecoder.from_pretrained(MODEL_DIR, dtype="float32"), "w8a8")
    for attention in ATTENTIONS:
        runs = {name: run for name, run in RUNS.items() if attention == "ordered" or args.before == "all"
                or args.before == "greedy" and run[0] is GREEDY}
        print(f"{attention}: w8a8 stand-in, {args.frames} frames", flush=True)
        with attending(attention):
            report["w8a8"][attention] = exactness(w8a8, args.frames, runs, print)
    for dtype in ("float32", "bfloat16"):
        print(f"ordered: {dtype} stand-in, {args.float_frames} frames", flush=True)
        model = MultiCodeDecoder.from_pretrained(MODEL_DIR, dtype=dtype)
        greedy = {name: run for name, run in RUNS.items() if run[0] is GREEDY}
        report["float"][dtype] = exactness(model, args.float_frames, greedy, print)
    report["costs"] = {}
    for name, dtype, weights in (("w8a8", torch.bfloat16, "w8a8"), ("bfloat16", torch.bfloat16, None),
                                 ("float32", torch.float32, None)):
        report["costs"][name] = call_costs(cost_model(dtype, weights, args.smoke), args.reps)
        print(name, report["costs"][name], flush=True)
    finish_machine(info)
    out = report_folder(args.out, args.smoke)
    for path in write_reports(report, out, f"exact-rounds-{cpu_class.cpu_class()}", markdown):
        print("wrote", path)


if __name__ == "__main__":
    main()
