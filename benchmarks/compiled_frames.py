"""Does torch.compile help the core on this CPU? Whole frames, AR vs speculative, eager vs compiled.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/compiled_frames.py [--arch 0.6b] [--dtype bfloat16] [--size 32]

The real architecture with acceptance controlled to the paper's tokens/step at N (`rvqspec.bench.controlled`),
ReusedHeads drafts, deployed sampler. Compiled = `torch.compile(model, dynamic=False)` with inductor freezing
(weights become constants, prepacked for oneDNN); `decode_frame` takes the compiled module as it is (attribute
access falls through to the model), so only the forward is compiled: drafts, heads, sampling and the tree walk
stay eager. Each frame is decoded four ways in rotating order; medians. Writes bench-compile.{json,md}.
`--smoke`: a tiny predictor, 2 frames, the eager ways only (compiling takes minutes), a temporary folder.
"""

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch._inductor.config as inductor_config

from rvqspec.bench.controlled import PAPER_ACCEPTANCE, calibrate_strength, controlled_predictor
from rvqspec.bench.one_stream import ARCHS
from rvqspec.bench.systems import SMOKE_PREDICTOR
from rvqspec.bench.timing import SMOKE_HELP, finish_machine, machine, machine_text, report_folder
from rvqspec.core.checkpoint import save_json, save_text
from rvqspec.core.decode import decode_frame, tokens_per_step
from rvqspec.core.drafters import ReusedHeads
from rvqspec.core.latency import clocks, elapsed_ms
from rvqspec.core.sampling import Sampler
from rvqspec.core.tree import default_tree

WAYS = ("eager AR", "eager spec", "compiled AR", "compiled spec")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    parser.add_argument("--arch", default="0.6b", choices=list(ARCHS))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--size", type=int, default=32, choices=list(PAPER_ACCEPTANCE))
    parser.add_argument("--frames", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    ways, frame_count = (WAYS[:2], 2) if args.smoke else (WAYS, args.frames)
    torch.set_num_threads(args.threads)
    inductor_config.freezing = True
    sampler, tree = Sampler(), default_tree(args.size)
    predictor = controlled_predictor(SMOKE_PREDICTOR if args.smoke else ARCHS[args.arch], dtype=args.dtype)
    calibrated = calibrate_strength(predictor, tree, PAPER_ACCEPTANCE[args.size], sampler, predictor.frames(12, seed=1),
                                    iterations=1 if args.smoke else 7)
    model, drafter = predictor.model, ReusedHeads(predictor.model)
    compiled = torch.compile(model, dynamic=False)
    models = {"eager": model, "compiled": compiled}
    frames = predictor.frames(frame_count, seed=2)
    generator = torch.Generator().manual_seed(0)

    def decode(way: str, h, c0):
        kind, mode = way.split()
        spec = mode == "spec"
        return decode_frame(models[kind], h, c0, sampler, generator, drafter=drafter if spec else None,
                            tree=tree if spec else None)

    compile_seconds = {}
    for way in ways:  # warm-up; the compiled ways compile their shapes here
        start = time.perf_counter()
        decode(way, *frames[0])
        compile_seconds[way] = time.perf_counter() - start
    times: dict = {way: [] for way in ways}
    decoded = {way: [] for way in ways}
    for i, (h, c0) in enumerate(frames):
        for way in ways[i % len(ways):] + ways[:i % len(ways)]:
            start = clocks()
            decoded[way].append(decode(way, h, c0))
            times[way].append(elapsed_ms(start))
    wall = {way: statistics.median(t[0] for t in times[way]) for way in ways}
    cpu = {way: statistics.median(t[1] for t in times[way]) for way in ways}
    ratios = {"eager spec over eager AR": ("eager AR", "eager spec"),
              "compiled spec over compiled AR": ("compiled AR", "compiled spec"),
              "compiled AR over eager AR": ("eager AR", "compiled AR"),
              "compiled spec over eager AR": ("eager AR", "compiled spec")}
    report = {"machine": finish_machine(machine()), "arch": "smoke" if args.smoke else args.arch,
              "dtype": args.dtype, "threads": args.threads, "tree_size": args.size, "frames": frame_count,
              "strength": calibrated.strength, "calibrated_tokens_per_step": calibrated.measured,
              "tokens_per_step": {w: tokens_per_step(decoded[w]) for w in ways},
              "frame_wall_ms": wall, "frame_cpu_ms": cpu, "first_frame_s": compile_seconds,
              "speedup": {name: wall[a] / wall[b] for name, (a, b) in ratios.items() if a in wall and b in wall}}
    out = report_folder(Path(args.out), args.smoke)
    save_json(out / "bench-compile.json", report)
    save_text(out / "bench-compile.md", markdown(report))
    print(markdown(report))


def markdown(r: dict) -> str:
    m = r["machine"]
    lines = ["# torch.compile vs eager, whole frames", "",
             f"`python benchmarks/compiled_frames.py`: {r['arch']} architecture (random layers, acceptance controlled "
             f"to {PAPER_ACCEPTANCE[r['tree_size']]} tokens/step at N={r['tree_size']}), {r['dtype']}, "
             f"{r['threads']} thread(s), {r['frames']} frames; {machine_text(m)}. Compiled: inductor with freezing, "
             "static shapes, forward only.", "",
             "| way | frame ms (wall, median) | frame ms (CPU) | tokens/step | first frame s (compiles) |",
             "|---|---|---|---|---|"]
    lines += [f"| {w} | {r['frame_wall_ms'][w]:.1f} | {r['frame_cpu_ms'][w]:.1f} | {r['tokens_per_step'][w]:.2f} | "
              f"{r['first_frame_s'][w]:.1f} |" for w in r["frame_wall_ms"]]
    lines += ["", "| ratio | value |", "|---|---|"] + [f"| {k} | {v:.2f}x |" for k, v in r["speedup"].items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
