"""Why a second thread does not pay for our predictor on the CPU, and what OpenMP's waiting does when the cores are
shared: the 0.6B predictor (acceptance-controlled heads, bfloat16, and w8a8), one stream, 1 vs 2 threads, under
each of libgomp's wait settings, on a quiet machine and beside one busy neighbour process.

torch's CPU build runs its intra-op threads on libgomp. Between two parallel regions a worker spins for
GOMP_SPINCOUNT iterations (OMP_WAIT_POLICY=PASSIVE: none, it sleeps at once; unset: 300,000; ACTIVE: for good),
then sleeps on a futex; waking a sleeping worker costs a system call and a reschedule. An AR step is ~70 small
ops (5 layers, each a few matmuls of one row and the elementwise ops around them), so waking costs are paid
~1,000 times a frame. Each setting runs in its own process (the variables are read when libgomp loads):

- frames: AR and speculative (N = 32) frame times at 1 and 2 threads, interleaved, medians;
- ops: one [1, 1024] x [1024, 3072] matmul (the packed bfloat16 kernel, and w8a8's int8 one) and one
  [33, 1024] x [1024, 3072] (a verify call's rows), 1 vs 2 threads: how much a split of one op gains.

    .venv/bin/python benchmarks/threads.py   # -> benchmarks/results/threads.{json,md}
    .venv/bin/python benchmarks/threads.py --smoke   # PASSIVE, quiet, a tiny predictor: seconds, a temporary folder
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
WAITS = {"PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"}, "spin 10k": {"GOMP_SPINCOUNT": "10000"},
         "unset (spin 300k)": {}, "ACTIVE": {"OMP_WAIT_POLICY": "ACTIVE"}}
CHILD_TIMEOUT_S = 240


def child(frames: int, smoke: bool) -> dict:
    """Run in a process of its own: the frame and op times of this process's wait setting."""
    from rvqspec import ReusedHeads, Sampler, decode_frames, default_tree, quantize
    from rvqspec.bench.batched import batch_inputs
    from rvqspec.bench.controlled import PAPER_ACCEPTANCE, calibrate_strength, controlled_predictor
    from rvqspec.bench.systems import SMOKE_PREDICTOR
    from rvqspec.core.config import QWEN3_TTS_0_6B
    from rvqspec.core.packing import Linear
    from rvqspec.core.quantize import Int8Matmul

    torch.set_num_threads(1)
    config, calls = (SMOKE_PREDICTOR, 5) if smoke else (QWEN3_TTS_0_6B, 200)
    predictor, sampler, tree = controlled_predictor(config, dtype="bfloat16"), Sampler(), default_tree(32)
    calibrate_strength(predictor, tree, PAPER_ACCEPTANCE[32], sampler, predictor.frames(8, seed=2),
                       iterations=1 if smoke else 5, low=3.0, high=12.0)
    models = {"bfloat16": predictor.model, "w8a8": quantize(predictor.model, "w8a8")}
    inputs = [batch_inputs(predictor, 1, r) for r in range(frames + 1)]
    linear = Linear(1024, 3072, bias=False).to(torch.bfloat16).requires_grad_(False)
    int8, times = Int8Matmul(linear.weight, "w8a8"), {}
    with torch.inference_mode():
        for r, (hidden, c0) in enumerate(inputs):  # the first frame warms up
            for threads in (1, 2):
                torch.set_num_threads(threads)
                for name, model in models.items():
                    for mode, drafter in (("ar", None), ("spec", ReusedHeads(model))):
                        start = time.perf_counter()
                        decode_frames(model, hidden, c0, sampler, torch.Generator().manual_seed(r), drafter,
                                      tree if drafter else None)
                        if r:
                            times.setdefault(f"{name} {mode} {threads}t", []).append(time.perf_counter() - start)
        for rows in (1, 33):
            x = torch.randn(rows, 1024, dtype=torch.bfloat16)
            for _ in range(calls):
                for threads in (1, 2):
                    torch.set_num_threads(threads)
                    for name, op in (("bf16", linear), ("w8a8", int8)):
                        start = time.perf_counter()
                        op(x)
                        times.setdefault(f"op {name} M={rows} {threads}t", []).append(time.perf_counter() - start)
    return {key: 1e3 * statistics.median(values[len(values) // 10:]) for key, values in times.items()}


def busy_neighbour() -> subprocess.Popen:
    """Another job on the machine: one process that keeps one core busy."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def run_child(env_extra: dict, frames: int, loaded: bool, smoke: bool = False) -> dict | None:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")} | env_extra
    neighbour = busy_neighbour() if loaded else None
    try:
        done = subprocess.run([sys.executable, __file__, "--child", str(frames), *["--smoke"] * smoke], env=env,
                              capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None
    finally:
        if neighbour:
            neighbour.kill()
            neighbour.wait()
    if done.returncode:
        raise SystemExit(f"child failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def markdown(report: dict) -> str:
    from rvqspec.bench.timing import machine_text

    lines = ["# Threads: 1 vs 2, and OpenMP's waiting", "",
             f"`python benchmarks/threads.py`: {machine_text(report['machine'])}. 0.6B predictor, acceptance-"
             f"controlled heads (N = 32 at the paper's 2.47 tokens/step), one stream, {report['frames']} frames per "
             "figure (medians); each wait setting in its own process; \"loaded\": one busy process beside it. "
             "Ratios are 2-thread time / 1-thread time (below 1: the second thread pays).", "",
             "| wait | machine | bf16 AR 1t ms | bf16 AR 2t/1t | bf16 spec 2t/1t | w8a8 AR 1t ms | w8a8 AR 2t/1t | "
             "w8a8 spec 2t/1t | op bf16 M=1 | op bf16 M=33 | op w8a8 M=1 | op w8a8 M=33 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for wait, by_load in report["runs"].items():
        for load, t in by_load.items():
            if t is None:
                lines.append(f"| {wait} | {load} | timed out after {CHILD_TIMEOUT_S} s |" + " |" * 9)
                continue

            def ratio(key):
                return f"{t[f'{key} 2t'] / t[f'{key} 1t']:.2f}"
            lines.append(f"| {wait} | {load} | {t['bfloat16 ar 1t']:.0f} | {ratio('bfloat16 ar')} | "
                         f"{ratio('bfloat16 spec')} | {t['w8a8 ar 1t']:.0f} | {ratio('w8a8 ar')} | {ratio('w8a8 spec')} "
                         f"| {ratio('op bf16 M=1')} | {ratio('op bf16 M=33')} | {ratio('op w8a8 M=1')} | "
                         f"{ratio('op w8a8 M=33')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    from rvqspec.bench.timing import SMOKE_HELP, finish_machine, machine, report_folder, write_reports

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--frames", type=int, default=None, help="default 6 (--smoke: 1)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.smoke)))
        return
    frames = args.frames or (1 if args.smoke else 6)
    waits = {"PASSIVE": WAITS["PASSIVE"]} if args.smoke else WAITS
    info, runs = machine(), {}
    for wait, env in waits.items():
        for load in ("quiet",) if args.smoke else ("quiet", "loaded"):
            runs.setdefault(wait, {})[load] = run_child(env, frames, load == "loaded", args.smoke)
            print(wait, load, runs[wait][load], flush=True)
    report = {"frames": frames, "runs": runs, "machine": finish_machine(info)}
    write_reports(report, report_folder(args.out, args.smoke), "threads", markdown)
    print(markdown(report))


if __name__ == "__main__":
    main()
