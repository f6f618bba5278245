"""The CPU fast path against the core without it, in one run: AR and speculative frames, before and after.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/fused_path.py [--frames 16] [--sizes 32] [--dtypes bfloat16,float32]

"Before" is `rvqspec.core.fused.enabled(False)`: the plain layer ops, exact draft heads and the walk over every
reachable depth (the core as it was); "after" is the default: fused kernels (rvqspec/core/fused.py), int8 draft
heads (core/draft_heads.py), the early-stopping CPU walk (core/walk.py). On the real 0.6B architecture (random
layers, heads peaked so that N=32 accepts the paper's 2.47 tokens/step, N=16 2.25; `rvqspec.bench.controlled`), the
deployed sampler, ReusedHeads drafts. Per frame the four decodes (AR / speculative x before / after) run back
to back in a rotating order; medians over frames. Writes fused-path.{json,md}. `--smoke`: a tiny predictor
(`smoke_config`), 2 frames, N = 16, bfloat16, 1 thread, a temporary folder.
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch

from rvqspec.bench.controlled import PAPER_ACCEPTANCE, calibrate_strength, controlled_predictor
from rvqspec.bench.one_stream import ARCHS
from rvqspec.bench.systems import smoke_config
from rvqspec.bench.timing import SMOKE_HELP, finish_machine, machine, machine_text, report_folder
from rvqspec.core import fused
from rvqspec.core.checkpoint import save_json, save_text
from rvqspec.core.decode import decode_frame, tokens_per_step
from rvqspec.core.drafters import ReusedHeads
from rvqspec.core.latency import clocks, elapsed_ms
from rvqspec.core.sampling import Sampler
from rvqspec.core.tree import default_tree

MODES = [("ar", False), ("ar", True), ("spec", False), ("spec", True)]  # (kind, fast path on)


def time_frames(predictor, tree, frames, sampler, drafter) -> dict:
    """Median wall ms per frame and tokens/step of each mode, the four decodes of a frame in rotating order."""
    generators = {mode: torch.Generator().manual_seed(i) for i, mode in enumerate(MODES)}
    times, decoded = {mode: [] for mode in MODES}, {mode: [] for mode in MODES}
    for i, (h, c0) in enumerate([frames[0]] + frames):  # the first: warm-up (plans, packs, int8 heads)
        for kind, on in MODES[i % 4:] + MODES[:i % 4]:
            with fused.enabled(on):
                start = clocks()
                result = decode_frame(predictor.model, h, c0, sampler, generators[(kind, on)],
                                      drafter=drafter if kind == "spec" else None, tree=tree if kind == "spec" else None)
                ms = elapsed_ms(start)[0]
            if i:
                times[(kind, on)].append(ms)
                decoded[(kind, on)].append(result)
    return {f"{kind} {'after' if on else 'before'}": {"frame_ms": statistics.median(times[(kind, on)]),
                                                      "tokens_per_step": tokens_per_step(decoded[(kind, on)])}
            for kind, on in MODES}


def markdown(report: dict) -> str:
    m, s = report["machine"], report["settings"]
    lines = ["# The CPU fast path: before and after, same run", "",
             f"`python benchmarks/fused_path.py --frames {s['frames']} --sizes {','.join(map(str, s['sizes']))} "
             f"--dtypes {','.join(s['dtypes'])} --threads {','.join(map(str, s['threads']))}`: 0.6B architecture "
             "(random layers, acceptance-controlled heads), deployed sampler, ReusedHeads drafts; before = "
             "`fused.enabled(False)` (plain ops, exact draft heads, walk over every reachable depth), after = the "
             f"default. Medians of {s['frames']} frames, the four decodes of each frame back to back; "
             f"{machine_text(m)}.", "",
             "| setting | N | AR ms/frame before | after | after/before | tok/step before | after | spec ms/call "
             "before | after | spec call / AR step before | after | realized before | realized after |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in report["rows"]:
        r, codes = row["frames"], 15
        ar0, ar1 = r["ar before"]["frame_ms"], r["ar after"]["frame_ms"]
        sp0, sp1 = r["spec before"]["frame_ms"], r["spec after"]["frame_ms"]
        t0, t1 = r["spec before"]["tokens_per_step"], r["spec after"]["tokens_per_step"]
        call0, call1 = sp0 * t0 / codes, sp1 * t1 / codes  # ms per call of a median frame
        lines.append(f"| {row['dtype']} {row['threads']}t | {row['tree_size']} | {ar0:.1f} | {ar1:.1f} | {ar1 / ar0:.3f} "
                     f"| {t0:.2f} | {t1:.2f} | {call0:.1f} | {call1:.1f} | {call0 / (ar0 / codes):.2f} "
                     f"| {call1 / (ar1 / codes):.2f} | {ar0 / sp0:.2f}x | {ar1 / sp1:.2f}x |")
    lines += ["", "realized = AR frame / speculative frame, each against the AR of its own side (after: our fastest "
              "AR, which gets the same fused kernels). Before and after draw different random codes, so their "
              "tokens/step differ by chance (same frames, same peak strength); spec ms/call = spec frame x tokens/step "
              "/ 15 and its ratio to the AR step (AR frame / 15) compare the two without that noise."]
    return "\n".join(lines) + "\n"


SMOKE = ["--frames", "2", "--sizes", "16", "--dtypes", "bfloat16", "--threads", "1"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    parser.add_argument("--frames", type=int, default=16)
    parser.add_argument("--sizes", default="32")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--out", default="benchmarks/results")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.smoke:
        args = parser.parse_args([*SMOKE, *argv])
    settings = {"frames": args.frames, "sizes": [int(n) for n in args.sizes.split(",")],
                "dtypes": args.dtypes.split(","), "threads": [int(t) for t in args.threads.split(",")]}
    info, sampler, rows = machine(), Sampler(), []
    assert fused.kernels() is not None, "the fused kernels could not be built here"
    for dtype in settings["dtypes"]:
        predictor = controlled_predictor(smoke_config(ARCHS["0.6b"]) if args.smoke else ARCHS["0.6b"], dtype=dtype)
        frames, drafter = predictor.frames(args.frames, seed=1), ReusedHeads(predictor.model)
        for n in settings["sizes"]:
            tree = default_tree(n)
            torch.set_num_threads(1)
            calibrated = calibrate_strength(predictor, tree, PAPER_ACCEPTANCE[n], sampler, frames[:8],
                                            1 if args.smoke else 6)
            for threads in settings["threads"]:
                torch.set_num_threads(threads)
                with torch.inference_mode():
                    result = time_frames(predictor, tree, frames, sampler, drafter)
                rows.append({"dtype": dtype, "threads": threads, "tree_size": n, "strength": calibrated.strength,
                             "calibrated_tokens_per_step": calibrated.measured, "frames": result})
                print(markdown({"machine": finish_machine(dict(info)), "settings": settings,
                                "rows": rows[-1:]}).splitlines()[-3], flush=True)
    report = {"settings": settings, "machine": finish_machine(info), "rows": rows}
    out = report_folder(Path(args.out), args.smoke)
    save_json(out / "fused-path.json", report)
    save_text(out / "fused-path.md", markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
