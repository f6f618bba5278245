"""What a generator per row costs (issue 40, item 4: a seed is a seed in any batch), 1 thread.

- draws: a frame's 15 draws of the 0.6B predictor's codebooks (V = 2048, the deployed sampler) for B = 1, 4, 8 rows,
  from pre-computed logits: one batched torch.multinomial per code from one generator (before) against each row's
  noise block drawn from its own generator, then argmax(p~ / noise) per code (after: `context.frame_noise` and
  `RoundContext.sample`); medians of interleaved repeats;
- frames: whole frames through `decode_frames` on the 0.6B predictor (random layers, heads at a fixed peak strength,
  the CPU's fastest float), AR and speculative (ReusedHeads, default_tree(8)), B = 1, 4, 8: the base commit's code
  with one generator for the batch (before) against this tree's with a generator per row (after), each in processes
  of its own, alternated `--rounds` times; per config the median of the per-process medians.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/row_draws.py [--base 345a2b6] [--rounds 3]
    # -> results/row-draws.{json,md}
    .venv/bin/python benchmarks/row_draws.py --smoke   # HEAD against itself, a tiny predictor, 2 repeats: seconds, a
                                                       # temporary folder
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
BATCHES = (1, 4, 8)
STRENGTH = 6.0  # the heads' peak margin: some drafts win, as a trained predictor's do
SMOKE = ["--base", "HEAD", "--rounds", "1", "--reps", "2"]


def draws(reps: int) -> dict:
    """Median ms of a frame's draws, before and after, per batch size (module docstring)."""
    from rvqspec.core.config import QWEN3_TTS_0_6B
    from rvqspec.core.device_path import median_ms
    from rvqspec.core.sampling import Sampler, fill_noise

    sampler, codes, vocab = Sampler(), QWEN3_TTS_0_6B.num_residual_codes, QWEN3_TTS_0_6B.vocab_size
    rows = {}
    for batch in BATCHES:
        logits = torch.randn(codes, batch, vocab, generator=torch.Generator().manual_seed(batch)) * 3
        one, mine = torch.Generator().manual_seed(0), [torch.Generator().manual_seed(b) for b in range(batch)]

        def before():
            return [sampler.sample(logits[j], one) for j in range(codes)]

        def after():
            noise = fill_noise(torch.empty(batch, codes, vocab), mine)
            return [sampler.sample_noise(logits[j], noise[:, j]) for j in range(codes)]

        times = median_ms({"before": before, "after": after}, reps)
        rows[batch] = times | {"ratio": times["after"] / times["before"]}
    return rows


@torch.inference_mode()
def frames(reps: int, smoke: bool = False) -> dict:
    """Median ms of whole frames per (mode, batch), with this process's rvqspec (the worker of one round); `smoke`:
    a tiny predictor (its rvqspec is this tree's HEAD then)."""
    from rvqspec.bench.batched import batch_inputs
    from rvqspec.bench.controlled import controlled_predictor
    from rvqspec.core import sampling
    from rvqspec.core.config import QWEN3_TTS_0_6B
    from rvqspec.core.decode import decode_frames
    from rvqspec.core.device_path import fastest_float, median_ms
    from rvqspec.core.drafters import ReusedHeads
    from rvqspec.core.tree import default_tree

    if smoke:
        from rvqspec.bench.systems import SMOKE_PREDICTOR as config
    else:
        config = QWEN3_TTS_0_6B
    predictor = controlled_predictor(config, STRENGTH, dtype=fastest_float())
    model, sampler, per_row = predictor.model, sampling.Sampler(), hasattr(sampling, "fill_noise")
    calls, tokens = {}, {}
    for batch in BATCHES:
        inputs = [batch_inputs(predictor, batch, r) for r in range(reps + 1)]
        for mode, drafter, tree in (("ar", None, None), ("tree8", ReusedHeads(model), default_tree(8))):
            generators = [torch.Generator().manual_seed(b) for b in range(batch)]
            one = torch.Generator().manual_seed(0)
            state = {"rep": 0}

            def call(batch=batch, drafter=drafter, tree=tree, generators=generators, one=one, state=state,
                     inputs=inputs, key=f"{mode}/{batch}"):
                hidden, c0 = inputs[state["rep"] % len(inputs)]
                state["rep"] += 1
                result = decode_frames(model, hidden, c0, sampler, generators if per_row else one, drafter, tree)
                tokens.setdefault(key, []).append(result.tokens_per_step)

            calls[f"{mode}/{batch}"] = call
    times = median_ms(calls, reps)
    return {key: {"ms": ms, "tokens_per_step": statistics.mean(tokens[key])} for key, ms in times.items()}


def run_worker(source: Path, reps: int, smoke: bool) -> dict:
    from rvqspec.bench.timing import worker_result

    return worker_result(source, [__file__, "--worker", "--reps", str(reps), *["--smoke"] * smoke],
                         env={"RVQSPEC_FUSED": "0"} if smoke else None)  # an extracted commit builds its own kernels


def markdown(report: dict) -> str:
    from rvqspec.bench.timing import machine_text

    lines = ["# A generator per row: the draws' cost", "", f"{machine_text(report['machine'])}; 1 thread; "
             f"`benchmarks/row_draws.py` (base {report['base']}).", "",
             "## A frame's 15 draws (V = 2048, top-k 50, temperature 0.9), medians of interleaved repeats", "",
             "| rows | one generator, batched multinomial (ms) | a generator per row: noise + argmax (ms) | ratio |",
             "|---:|---:|---:|---:|"]
    lines += [f"| {b} | {r['before']:.3f} | {r['after']:.3f} | {r['ratio']:.2f} |" for b, r in report["draws"].items()]
    lines += ["", f"## Whole frames through decode_frames, 0.6B predictor ({report['dtype']}), median of "
              f"{report['rounds']} alternated processes' medians", "",
              "| mode | rows | before: base, one generator (ms) | after: a generator per row (ms) | ratio | "
              "tokens/step before / after |", "|---|---:|---:|---:|---:|---|"]
    for key, row in report["frames"].items():
        mode, batch = key.split("/")
        lines.append(f"| {mode} | {batch} | {row['before']:.2f} | {row['after']:.2f} | {row['ratio']:.3f} | "
                     f"{row['tokens_before']:.2f} / {row['tokens_after']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="HEAD against itself, tiny: seconds, a temporary folder")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--base", default="345a2b6", help="the commit before per-row draws")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.smoke and not args.worker:
        args = parser.parse_args([*SMOKE, *argv])
    torch.set_num_threads(1)
    if args.worker:
        print(json.dumps(frames(args.reps, args.smoke)))
        return
    sys.path.insert(0, str(ROOT))
    from rvqspec.bench.timing import finish_machine, machine, report_folder, sources_at, write_reports
    from rvqspec.core.device_path import fastest_float

    info = machine()
    report = {"machine": info, "base": args.base, "rounds": args.rounds, "dtype": str(fastest_float()),
              "draws": draws(5 if args.smoke else 51)}
    with sources_at(args.base, ROOT) as base:
        runs = {"before": [], "after": []}
        for _ in range(args.rounds):
            runs["before"].append(run_worker(base, args.reps, args.smoke))
            runs["after"].append(run_worker(ROOT, args.reps, args.smoke))
    report["frames"] = {}
    for key in runs["after"][0]:
        ms = {side: statistics.median(run[key]["ms"] for run in runs[side]) for side in runs}
        tokens = {side: statistics.mean(run[key]["tokens_per_step"] for run in runs[side]) for side in runs}
        report["frames"][key] = {"before": ms["before"], "after": ms["after"], "ratio": ms["after"] / ms["before"],
                                 "tokens_before": tokens["before"], "tokens_after": tokens["after"]}
    report["machine"] = finish_machine(info)
    for path in write_reports(report, report_folder(args.out, args.smoke), "row-draws", markdown):
        print(f"wrote {path}")
    print(markdown(report))


if __name__ == "__main__":
    main()
