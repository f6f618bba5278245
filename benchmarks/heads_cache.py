"""The heads a w8a8 predictor frame reads (issue 51: "the policy's speculative predictor frame <= 30 ms"), before and
after a change, 0.6B, 1 thread.

The frame of `benchmarks/predictor_frame.py` (the acceptance-controlled 0.6B predictor quantized to w8a8, ReusedHeads,
the policy's tree for one row, the deployed sampler, one seeded generator per frame, `decode_checked`), with the
heads' calls timed (CPU time): the drafts' (`draft_heads.logits`) and the rest (the walk's, the frame's first code).
Where this tree's heads have int4 copies (`QuantizedHeads.rank_logits`), frames alternate drafts ranked by the int8
heads and by the int4 copies, in one process: frame time, the heads' time, tokens per step, and whether the codes
are the same (drafts never emit: they must be). And an AR frame (15 one-row calls, greedy): its time and its heads'.

The base commit's rvqspec and this tree's run in processes of their own (1 intra-op thread, OMP_WAIT_POLICY=PASSIVE),
alternated `--rounds` times; per side the median over rounds of each process's medians, and after / before per round.
The machine is shared: compare within one run.

    .venv/bin/python benchmarks/heads_cache.py [--base 144ac60] [--rounds 3] [--frames 30]  # -> results/heads-cache.*
    .venv/bin/python benchmarks/heads_cache.py --smoke   # this tree against itself, tiny sizes: seconds
"""

import argparse
import json
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
STRENGTH = 6.13  # predictor_frame.py's: the heads' peak that end_to_end's calibration found
SMOKE = ["--rounds", "1", "--frames", "4"]
WARM_UP = 4


class HeadTimes:
    """CPU ms in the drafts' head calls (`drafts`) and in the others (`other`); `int4`: drafts ranked by the int4
    copies."""

    def __init__(self):
        self.drafts = self.other = 0.0
        self.int4 = self.drafting = False

    def install(self) -> None:
        from rvqspec.core import draft_heads
        from rvqspec.core.model import by_codebook
        from rvqspec.core.quantize import QuantizedHeads

        exact, plain, times = draft_heads.logits, QuantizedHeads.logits, self

        def drafts(model, hidden, codebooks, path):
            start, times.drafting = time.thread_time(), True
            try:
                if not times.int4:
                    return exact(model, hidden, codebooks, path)
                rank = model.head_weights.rank_logits
                return by_codebook(hidden, codebooks, model.config.vocab_size, rank)
            finally:
                times.drafts += (time.thread_time() - start) * 1e3
                times.drafting = False

        def heads(self, hidden, codebook):
            start = time.thread_time()
            try:
                return plain(self, hidden, codebook)
            finally:
                if not times.drafting:
                    times.other += (time.thread_time() - start) * 1e3

        draft_heads.logits, QuantizedHeads.logits = drafts, heads


def spec_frames(model, drafter, tree, inputs, times: HeadTimes, modes: list[bool]) -> dict:
    """Per mode (int4 drafts or not): frame ms, drafts' and other heads' ms (medians), tokens per step; whether every
    frame's codes were the same in every mode."""
    import torch

    from rvqspec.core import decode
    from rvqspec.core.sampling import Sampler

    out = {mode: {"frame": [], "drafts": [], "other": [], "calls": 0} for mode in modes}
    same = True
    for i, (hidden, c0) in enumerate(inputs):
        codes = []
        for mode in modes if i % 2 else modes[::-1]:
            times.int4, times.drafts, times.other = mode, 0.0, 0.0
            start = time.thread_time()
            result = decode.decode_checked(model, hidden[None], torch.tensor([c0]), Sampler(),
                                           [torch.Generator().manual_seed(i)], drafter, tree)
            spent = (time.thread_time() - start) * 1e3
            codes.append(result.codes)
            if i >= WARM_UP:
                side = out[mode]
                side["frame"].append(spent), side["drafts"].append(times.drafts)
                side["calls"] += result.calls
                side["other"].append(times.other)
        same = same and all(torch.equal(c, codes[0]) for c in codes)
    frames = len(inputs) - WARM_UP
    return {"int4" if mode else "int8": {"frame_ms": statistics.median(v["frame"]),
                                         "draft_heads_ms": statistics.median(v["drafts"]),
                                         "other_heads_ms": statistics.median(v["other"]),
                                         "tokens_per_step": 15 * frames / v["calls"]} for mode, v in out.items()} | {
        "same_codes": same}


def ar_frames(model, inputs, times: HeadTimes) -> dict:
    import torch

    from rvqspec.core.decode import decode_frames
    from rvqspec.core.sampling import Sampler

    frame, heads = [], []
    for i, (hidden, c0) in enumerate(inputs):
        times.other = 0.0
        start = time.thread_time()
        decode_frames(model, hidden[None], torch.tensor([c0]), Sampler(do_sample=False))
        if i >= WARM_UP:
            frame.append((time.thread_time() - start) * 1e3)
            heads.append(times.other)
    return {"frame_ms": statistics.median(frame), "heads_ms": statistics.median(heads)}


def frames_worker(frames: int, smoke: bool) -> dict:
    import torch

    from rvqspec.bench.controlled import controlled_predictor
    from rvqspec.bench.systems import smoke_config
    from rvqspec.core import decode, device_path
    from rvqspec.core.config import ARCHITECTURES
    from rvqspec.core.drafters import ReusedHeads
    from rvqspec.core.frame_loop import decoding_policy
    from rvqspec.core.quantize import QuantizedHeads, quantize

    torch.set_num_threads(1)
    config = smoke_config(ARCHITECTURES["0.6b"]) if smoke else ARCHITECTURES["0.6b"]
    predictor = controlled_predictor(config, strength=STRENGTH, dtype="bfloat16")
    model = quantize(predictor.model, "w8a8")
    device_path.prepare(model)
    drafter = ReusedHeads(model)
    tree = decoding_policy(model, drafter, "auto", None).tree_for(1)
    decode.fit_speculation(model, drafter, tree)
    times = HeadTimes()
    times.install()
    inputs = predictor.frames(frames + WARM_UP)
    modes = [False, True] if hasattr(QuantizedHeads, "rank_logits") else [False]
    with torch.inference_mode():
        return {"spec": spec_frames(model, drafter, tree, inputs, times, modes), "ar": ar_frames(model, inputs, times),
                "tree": tree.size}


def run_worker(source: Path, frames: int, smoke: bool) -> dict:
    from rvqspec.bench.timing import worker_result

    return worker_result(source, [__file__, "--worker", "--frames", str(frames), *["--smoke"] * smoke],
                         env={"OMP_WAIT_POLICY": "PASSIVE"})


def flat(run: dict) -> dict:
    """A worker's figures as one level of names."""
    figures = {f"AR frame, {k}": v for k, v in run["ar"].items()}
    for mode in ("int8", "int4"):
        figures |= {f"spec frame, {mode} drafts, {k}": v for k, v in run["spec"].get(mode, {}).items()}
    return figures


def summary(runs: list[dict]) -> dict:
    names = flat(runs[0])
    return {name: statistics.median(flat(run)[name] for run in runs) for name in names}


def markdown(report: dict) -> str:
    from rvqspec.bench.timing import machine_text

    before, after = report["before"], report["after"]
    lines = ["# The heads a w8a8 predictor frame reads (0.6B, 1 thread)", "",
             f"`{report['command']}` ({report['native']}): {machine_text(report['machine'])}; base {report['base']}, "
             f"after {report['after_commit']}.", "",
             f"{report['frames']} random frames per process (the policy's tree for one row, N={report['tree']}, the "
             f"deployed sampler; AR: greedy); processes alternated {report['rounds']} times, medians over rounds, CPU "
             "time. Where `after` has int4 copies of the heads, its frames alternate drafts ranked by the int8 heads "
             "and by the int4 copies, in one process; the codes were "
             + ("the same in every frame." if report["same_codes"] else "**not** the same in every frame."), "",
             "| per frame | before | after | after / before |", "|---|---:|---:|---:|"]
    for name, value in after.items():
        b = before.get(name)
        unit = "" if "tokens" in name else ", ms"
        lines.append(f"| {name}{unit} | {'' if b is None else f'{b:.3f}'} | {value:.3f} | "
                     f"{'' if b is None else f'{value / b:.2f}'} |")
    int4 = "spec frame, int4 drafts, frame_ms"
    if int4 in after:
        lines += ["", f"After, int4 drafts over int8 drafts (one process): frame "
                  f"{after[int4] / after['spec frame, int8 drafts, frame_ms']:.3f}, drafts' heads "
                  f"{after['spec frame, int4 drafts, draft_heads_ms'] / after['spec frame, int8 drafts, draft_heads_ms']:.2f}"
                  f", tokens per step {after['spec frame, int4 drafts, tokens_per_step']:.3f} against "
                  f"{after['spec frame, int8 drafts, tokens_per_step']:.3f}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="this tree against itself, tiny: seconds")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--base", default="144ac60", help="the commit before the change")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--frames", type=int, default=30)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.smoke and not args.worker:
        args = parser.parse_args([*SMOKE, *argv])
    if args.worker:
        print(json.dumps(frames_worker(args.frames, args.smoke)))
        return
    sys.path.insert(0, str(ROOT))
    from rvqspec.bench.timing import machine, report_folder, run_record, sources_at, tree_commit, write_reports

    info, runs = machine(), {"before": [], "after": []}
    with nullcontext(ROOT) if args.smoke else sources_at(args.base, ROOT) as base:
        for _ in range(args.rounds):
            runs["before"].append(run_worker(base, args.frames, args.smoke))
            runs["after"].append(run_worker(ROOT, args.frames, args.smoke))
    report = {**run_record("heads_cache.py", argv, info), "base": "this tree (--smoke)" if args.smoke else args.base,
              "after_commit": tree_commit(ROOT), "rounds": args.rounds, "frames": args.frames,
              "tree": runs["after"][0]["tree"], "before": summary(runs["before"]), "after": summary(runs["after"]),
              "same_codes": all(run["spec"]["same_codes"] for run in runs["after"]), "runs": runs}
    for path in write_reports(report, report_folder(args.out, args.smoke), "heads-cache", markdown):
        print(f"wrote {path}")
    print(markdown(report))


if __name__ == "__main__":
    main()
