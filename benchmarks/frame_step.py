"""A frame step of the Engine, before and after a change (issue 43: the house's changes must not slow the hot path).

The tiny qwen-tts of the tests in `rvqspec.Engine` (speculative, its policy's tree; greedy, so both sides do the
same work), 4 requests decoded together; every `Scheduler.frame_step` with all 4 rows in the batch is timed. The
base commit's rvqspec and this tree's run in processes of their own (1 intra-op thread), alternated `--rounds`
times; per side the median of the per-process medians, and the ratio after / before (below 1: faster).

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/frame_step.py [--base 0482d49] [--rounds 6]
    # -> results/frame-step.{json,md}
    .venv/bin/python benchmarks/frame_step.py --smoke   # HEAD against itself, one round of 4 frames: seconds, a
                                                        # temporary folder
"""

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
ROWS = 4
TEXTS = ["hello there, how are you today", "a second sentence for the batch", "the third one is short",
         "four requests decoding together"]
# 12 frames: the rows join one prefill apart, so a run of 4 frames can end its first row before its last one joins
SMOKE = ["--base", "HEAD", "--rounds", "1", "--frames", "12", "--repeats", "1"]


def upstream_builders():
    """This tree's rvqspec/bench/upstream.py (the tiny qwen-tts), loaded as a module of its own: a worker's rvqspec
    may be a base commit's, from before that module."""
    spec = importlib.util.spec_from_file_location("bench_upstream", ROOT / "rvqspec" / "bench" / "upstream.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def frame_steps(frames: int, repeats: int) -> dict:
    """Milliseconds of each frame step with all ROWS rows (the median per repeat), in whichever rvqspec is first on
    the path. Only public names and the scheduler's `frame_step`, which every compared commit has."""
    import torch

    import rvqspec
    from rvqspec.runtime import scheduler

    upstream = upstream_builders()
    torch.set_num_threads(1)
    times: list[float] = []
    step = scheduler.Scheduler.frame_step

    def timed(self) -> None:
        start = time.perf_counter()
        step(self)
        if len(self.rows) == ROWS:
            times.append(time.perf_counter() - start)

    scheduler.Scheduler.frame_step = timed
    engine = rvqspec.Engine(upstream.tiny_qwen3_tts(seed=0), max_batch=ROWS, realtime=False, threads=1, seed=0)
    medians = []
    try:
        for _ in range(repeats):
            times.clear()
            requests = [engine.submit("custom_voice", text=text, speaker="tiny", language="English",
                                      max_new_tokens=frames, do_sample=False, subtalker_dosample=False,
                                      eos_token_id=upstream.CODEBOOK + upstream.SPECIALS - 1)  # all `frames` frames
                        for text in TEXTS[:ROWS]]
            for request in requests:
                request.wait()
            if not times:
                raise SystemExit(f"no frame step had all {ROWS} rows: run more --frames")
            medians.append(1e3 * statistics.median(times))
    finally:
        engine.close()
    return {"ms": statistics.median(medians), "steps_per_repeat": len(times)}


def run_worker(source: Path, frames: int, repeats: int, smoke: bool) -> dict:
    """One process's frame steps (a smoke run's without the fused kernels: an extracted commit would build its own)."""
    from rvqspec.bench.timing import worker_result

    return worker_result(source, [__file__, "--worker", "--frames", str(frames), "--repeats", str(repeats)],
                         env={"RVQSPEC_FUSED": "0"} if smoke else None)


def markdown(report: dict) -> str:
    from rvqspec.bench.timing import machine_text

    lines = ["# A frame step before and after", "", f"{machine_text(report['machine'])}; 1 intra-op thread; "
             f"`benchmarks/frame_step.py` (base {report['base']}, after {report['after_commit']}).", "",
             f"The tiny qwen-tts in rvqspec.Engine, {ROWS} greedy requests of {report['frames']} frames together; "
             f"the median frame step with all {ROWS} rows, per process ({report['repeats']} repeats), alternated "
             f"{report['rounds']} times.", "",
             "| round | before (ms) | after (ms) | after / before |", "|---:|---:|---:|---:|"]
    for i, (before, after) in enumerate(zip(report["before"], report["after"]), 1):
        lines.append(f"| {i} | {before:.3f} | {after:.3f} | {after / before:.2f} |")
    lines += ["", f"Median of the rounds' ratios: **{report['ratio']:.2f}** (range {min(report['ratios']):.2f}-"
              f"{max(report['ratios']):.2f})."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="HEAD against itself, tiny: seconds, a temporary folder")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--base", default="0482d49", help="the commit before the change")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--frames", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.smoke:
        args = parser.parse_args([*SMOKE, *argv])
    if args.worker:
        print(json.dumps(frame_steps(args.frames, args.repeats)))
        return
    sys.path.insert(0, str(ROOT))
    from rvqspec.bench.timing import finish_machine, machine, report_folder, sources_at, tree_commit, write_reports

    info = machine()
    report = {"machine": info, "base": args.base, "after_commit": tree_commit(ROOT),
              "rounds": args.rounds, "frames": args.frames, "repeats": args.repeats, "before": [], "after": []}
    with sources_at(args.base, ROOT) as base:
        for _ in range(args.rounds):
            report["before"].append(run_worker(base, args.frames, args.repeats, args.smoke)["ms"])
            report["after"].append(run_worker(ROOT, args.frames, args.repeats, args.smoke)["ms"])
    report["ratios"] = [after / before for before, after in zip(report["before"], report["after"])]
    report["ratio"] = statistics.median(report["ratios"])
    report["machine"] = finish_machine(info)
    for path in write_reports(report, report_folder(args.out, args.smoke), "frame-step", markdown):
        print(f"wrote {path}")
    print(markdown(report))


if __name__ == "__main__":
    main()
