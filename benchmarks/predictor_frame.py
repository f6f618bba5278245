"""The Engine's speculative predictor frame at the real 0.6B sizes (w8a8, 1 thread), split into its parts, before and
after a change (issue 51: "the policy's speculative predictor frame <= 30 ms").

The predictor as `benchmarks/end_to_end.py`'s engine-w8a8 runs it: the acceptance-controlled 0.6B predictor
(`rvqspec.bench.controlled`, the heads' strength end_to_end calibrated to the paper's 2.47 tokens/step at N = 32) in
bfloat16, quantized to w8a8, ReusedHeads drafts, the decoding policy's tree for a batch of one, the deployed sampler
with one seeded generator per frame, and `decode_checked` (the call the Engine's scheduler makes per frame step) on
random talker states. Each frame is timed whole (no wrappers; wall and the thread's CPU time: on a loaded machine
wall time mostly measures the wait for a core), then again with the core's pieces wrapped in CPU-time timers
(exclusive time per piece; "frame glue" is the rest): the native stack (`int8_layers`), the forward's Python around
it, embeddings, drafts, heads, draws, the walk, the cache move, the frame's noise, the cache, the host read. Frames
alternate plain and wrapped; the split's total over the plain frame shows what the wrappers add. `--tiny`: the same
frame with the layers at a tiny width and N = 4 (the glue, almost without the matrices' time).

The base commit's rvqspec and this tree's run in processes of their own (1 intra-op thread, OMP_WAIT_POLICY=PASSIVE),
alternated `--rounds` times; per side the median over rounds of each process's median frame, and the ratio after /
before per round (below 1: faster). The machine is shared: compare within one run.

    .venv/bin/python benchmarks/predictor_frame.py [--base 30997a6] [--rounds 5]   # -> results/predictor-frame.*
    .venv/bin/python benchmarks/predictor_frame.py --tiny   # -> results/predictor-frame-tiny.*
    .venv/bin/python benchmarks/predictor_frame.py --smoke   # this tree against itself, tiny sizes: seconds
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
STRENGTH = 6.13  # the heads' peak that end_to_end's calibration found (end-to-end.json: heads.strength)
SMOKE = ["--rounds", "1", "--frames", "6"]
TINY_TREE = 4  # the 0.6B policy's N at one stream here (a tiny predictor's policy would weigh other latencies)
# (module, owner, attribute, piece): what the split wraps, where a commit has it (innermost pieces are exclusive)
PIECES = [("rvqspec.core.decode", None, "decode_checked", "frame glue"),
          ("rvqspec.core.model", "MultiCodeDecoder", "forward", "forward: Python around the native stack"),
          ("rvqspec.core.model", "MultiCodeDecoder", "embed_codes", "embeddings"),
          ("rvqspec.core.model", "MultiCodeDecoder", "embed_talker_hidden", "embeddings"),
          ("rvqspec.core.model", "MultiCodeDecoder", "head_logits", "heads (drafts, walk, prefill)"),
          ("rvqspec.core.model", "MultiCodeDecoder", "new_cache", "cache: new"),
          ("rvqspec.core.model", "KVCache", "move", "cache: move"),
          ("rvqspec.core.drafters", "Drafter", "candidates", "drafts: top-m and glue"),
          ("rvqspec.core.context", "RoundContext", "sample", "draws"),
          ("rvqspec.core.context", None, "frame_noise", "noise"),
          ("rvqspec.core.decode", None, "walk", "walk: matching and glue"),
          ("rvqspec.core.decode", None, "read_round", "host read")]
NATIVE = "forward: native stack (int8_layers)"


class Split:
    """Exclusive CPU time per piece over the frames timed with it on (`PIECES` wrapped in place)."""

    def __init__(self):
        self.on, self.stack, self.ms = False, [], {}

    def wrap(self, func, piece: str):
        def timed(*args, **kwargs):
            if not self.on:
                return func(*args, **kwargs)
            self.stack.append(0.0)
            start = time.thread_time()
            try:
                return func(*args, **kwargs)
            finally:
                spent = (time.thread_time() - start) * 1e3
                inner = self.stack.pop()
                self.ms[piece] = self.ms.get(piece, 0.0) + spent - inner
                if self.stack:
                    self.stack[-1] += spent
        return timed

    def install(self) -> None:
        import importlib

        from rvqspec.core import fused

        for module_name, owner, name, piece in PIECES:
            module = importlib.import_module(module_name)
            target = getattr(module, owner) if owner else module
            if name in vars(target):
                setattr(target, name, self.wrap(getattr(target, name), piece))
        ops, split = fused.kernels(), self

        class Ops:  # the compiled module, its whole-stack call timed
            def __getattr__(self, name):
                call = getattr(ops, name)
                return split.wrap(call, NATIVE) if name == "int8_layers" else call

        fused._state["module"] = Ops()


def frames_worker(frames: int, tiny: bool) -> dict:
    """This process's rvqspec: per-frame ms (plain), the split per frame (wrapped frames), calls and tokens/step."""
    import torch

    from rvqspec.bench.controlled import controlled_predictor
    from rvqspec.bench.systems import smoke_config
    from rvqspec.core import decode, device_path
    from rvqspec.core.config import ARCHITECTURES
    from rvqspec.core.drafters import ReusedHeads
    from rvqspec.core.frame_loop import decoding_policy
    from rvqspec.core.quantize import quantize
    from rvqspec.core.sampling import Sampler
    from rvqspec.core.tree import default_tree

    torch.set_num_threads(1)
    config = smoke_config(ARCHITECTURES["0.6b"]) if tiny else ARCHITECTURES["0.6b"]
    predictor = controlled_predictor(config, strength=STRENGTH, dtype="bfloat16")
    model = quantize(predictor.model, "w8a8")
    device_path.prepare(model)
    drafter = ReusedHeads(model)
    tree = default_tree(TINY_TREE) if tiny else decoding_policy(model, drafter, "auto", None).tree_for(1)
    decode.fit_speculation(model, drafter, tree)
    split, plain, cpu, calls = Split(), [], [], 0
    split.install()
    inputs = predictor.frames(frames + 4)
    with torch.inference_mode():
        for i, (hidden, c0) in enumerate(inputs):
            for wrapped in (False, True):
                split.on = wrapped and i >= 4
                generator = [torch.Generator().manual_seed(i)]
                start = time.perf_counter(), time.thread_time()
                result = decode.decode_checked(model, hidden[None], torch.tensor([c0]), Sampler(), generator,
                                               drafter, tree)
                if i >= 4 and not wrapped:  # 4 warm-up frames
                    plain.append((time.perf_counter() - start[0]) * 1e3)
                    cpu.append((time.thread_time() - start[1]) * 1e3)
                    calls += result.calls
    pieces = {piece: ms / frames for piece, ms in split.ms.items()}  # decode_checked's own: the frame glue
    return {"frame_ms": statistics.median(plain), "frame_cpu_ms": statistics.median(cpu), "split_ms": pieces,
            "split_total_ms": sum(pieces.values()), "calls_per_frame": calls / frames,
            "tokens_per_step": 15 * frames / calls, "tree": tree.size}


def run_worker(source: Path, frames: int, tiny: bool) -> dict:
    from rvqspec.bench.timing import worker_result

    return worker_result(source, [__file__, "--worker", "--frames", str(frames), *["--tiny"] * tiny],
                         env={"OMP_WAIT_POLICY": "PASSIVE"})


def summary(runs: list[dict]) -> dict:
    """Medians over a side's rounds: the frame, and each piece of the split."""
    pieces = sorted({piece for run in runs for piece in run["split_ms"]})
    return {"frame_ms": statistics.median(run["frame_ms"] for run in runs),
            "frame_cpu_ms": statistics.median(run["frame_cpu_ms"] for run in runs),
            "split_ms": {p: statistics.median(run["split_ms"].get(p, 0.0) for run in runs) for p in pieces},
            "split_total_ms": statistics.median(run["split_total_ms"] for run in runs),
            "calls_per_frame": statistics.median(run["calls_per_frame"] for run in runs),
            "tokens_per_step": statistics.median(run["tokens_per_step"] for run in runs), "tree": runs[0]["tree"]}


def markdown(report: dict) -> str:
    from rvqspec.bench.timing import machine_text

    before, after = report["before"], report["after"]
    sizes = "the 0.6B's layers at a tiny width: the glue" if report["tiny"] else "0.6B"
    lines = [f"# The Engine's speculative predictor frame, split (w8a8, {sizes}, 1 thread)", "",
             f"`{report['command']}` ({report['native']}): {machine_text(report['machine'])}; "
             f"base {report['base']}, after {report['after_commit']}.", "",
             f"{report['frames']} random frames per process, "
             + ("a tree of" if report["tiny"] else "the policy's tree for one row,") + f" N={after['tree']}, "
             "the deployed sampler; processes alternated "
             f"{report['rounds']} times, medians over rounds.", "",
             "| per frame, ms | before | after | after / before |", "|---|---:|---:|---:|",
             f"| **frame, CPU time** | {before['frame_cpu_ms']:.2f} | {after['frame_cpu_ms']:.2f} | "
             f"**{report['ratio']:.2f}** |",
             f"| frame, wall time | {before['frame_ms']:.2f} | {after['frame_ms']:.2f} | "
             f"{report['wall_ratio']:.2f} |"]
    for piece in sorted(set(before["split_ms"]) | set(after["split_ms"]), key=lambda p: -after["split_ms"].get(p, 0)):
        b, a = before["split_ms"].get(piece, 0.0), after["split_ms"].get(piece, 0.0)
        lines.append(f"| {piece} | {b:.2f} | {a:.2f} | {a / b if b else float('nan'):.2f} |")
    glue = [side["split_total_ms"] - side["split_ms"].get(NATIVE, 0.0) for side in (before, after)]
    lines += [f"| split total (wrapped frames, CPU time) | {before['split_total_ms']:.2f} | "
              f"{after['split_total_ms']:.2f} | |",
              f"| **split total but the native stack** | {glue[0]:.2f} | {glue[1]:.2f} | **{glue[1] / glue[0]:.2f}** |",
              f"| calls per frame | {before['calls_per_frame']:.2f} | {after['calls_per_frame']:.2f} | |",
              f"| tokens per step | {before['tokens_per_step']:.2f} | {after['tokens_per_step']:.2f} | |", "",
              f"Per round, after / before (CPU time): {', '.join(f'{r:.2f}' for r in report['ratios'])}; wall time: "
              f"{', '.join(f'{r:.2f}' for r in report['wall_ratios'])}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="this tree against itself, tiny: seconds, a temporary "
                        "folder")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--base", default="30997a6", help="the commit before the change")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--frames", type=int, default=40)
    parser.add_argument("--tiny", action="store_true", help="the 0.6B predictor's layers at a tiny width "
                        "(`smoke_config`): the frame's glue, almost without the matrices' time")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.smoke and not args.worker:
        args = parser.parse_args([*SMOKE, *argv])
    args.tiny = args.tiny or args.smoke
    if args.worker:
        print(json.dumps(frames_worker(args.frames, args.tiny)))
        return
    sys.path.insert(0, str(ROOT))
    from rvqspec.bench.timing import machine, report_folder, run_record, sources_at, tree_commit, write_reports

    info = machine()
    runs = {"before": [], "after": []}
    with nullcontext(ROOT) if args.smoke else sources_at(args.base, ROOT) as base:  # smoke: no build of its own
        for _ in range(args.rounds):
            runs["before"].append(run_worker(base, args.frames, args.tiny))
            runs["after"].append(run_worker(ROOT, args.frames, args.tiny))
    ratios = {key: [a[key] / b[key] for b, a in zip(runs["before"], runs["after"])]
              for key in ("frame_cpu_ms", "frame_ms")}
    report = {**run_record("predictor_frame.py", argv, info), "base": args.base,
              "after_commit": tree_commit(ROOT), "rounds": args.rounds,
              "tiny": args.tiny,
              "frames": args.frames, "before": summary(runs["before"]), "after": summary(runs["after"]),
              "ratios": ratios["frame_cpu_ms"], "ratio": statistics.median(ratios["frame_cpu_ms"]),
              "wall_ratios": ratios["frame_ms"], "wall_ratio": statistics.median(ratios["frame_ms"]), "runs": runs}
    name = "predictor-frame-tiny" if args.tiny and not args.smoke else "predictor-frame"
    for path in write_reports(report, report_folder(args.out, args.smoke), name, markdown):
        print(f"wrote {path}")
    print(markdown(report))


if __name__ == "__main__":
    main()
