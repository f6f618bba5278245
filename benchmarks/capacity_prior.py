"""Admission's prior against measured frame steps: how a frame step's period grows with the batch's rows.

With one batch size measured, `runtime/capacity.py` predicts the others by the decoding policy's scaling (its
predicted predictor time per frame at each batch size, from call latencies measured on this CPU); before, in
proportion to the rows. This runs the Engine (default settings but `realtime=False`, so every size is reached) on
`--rounds` passes of 1, 2, 3 and 4 greedy requests together, then compares each size's measured median period,
over one row's, with both priors.

    .venv/bin/python benchmarks/capacity_prior.py [--model standin] [--rounds 2]   # -> results/capacity-prior.{json,md}
    .venv/bin/python benchmarks/capacity_prior.py --smoke   # 1 and 2 short requests once: seconds, a temporary folder
"""

import argparse
from pathlib import Path

from rvqspec.bench.timing import (RESULTS, SMOKE_HELP, finish_machine, machine, machine_text, report_folder,
                                  write_reports)
from rvqspec.runtime import Engine

TEXTS = ["hello there, how are you today, and what a day it is", "a second sentence for the batch, a longer one",
         "the third one is short, or not so short", "four requests decoding together, to the end"]
BATCHES = (1, 2, 3, 4)


def measure(model: str, rounds: int, batches: tuple = BATCHES, texts: list = TEXTS) -> dict:
    engine = Engine(model, realtime=False, seed=0, max_batch=max(batches))
    try:
        for _ in range(rounds):
            for batch in batches:
                requests = [engine.submit("speech", text=text, language="en", do_sample=False,
                                          subtalker_dosample=False) for text in texts[:batch]]
                for request in requests:
                    request.wait()
        periods, scaling = engine.capacity.medians(), engine.capacity.scaling
        return {"frame_seconds": engine.model.frame_seconds, "policy": engine.explain(1),
                "sizes": {str(batch): {"period_ms": 1e3 * periods[batch], "measured": periods[batch] / periods[1],
                                       "policy_prior": scaling(batch) / scaling(1) if scaling else None,
                                       "proportional": float(batch)}
                          for batch in batches if batch in periods}}
    finally:
        engine.close()


def markdown(report: dict) -> str:
    lines = ["# Admission's prior against measured frame steps", "",
             f"{machine_text(report['machine'])}; the Engine's default threads; model {report['model']}; "
             f"`benchmarks/capacity_prior.py --rounds {report['rounds']}`. The policy at one row: {report['policy']}.",
             "", "A frame step's median period at B rows over one row's: measured, the decoding policy's prior "
             "(used now), and proportional (before).", "",
             "| rows | period (ms) | measured | policy prior | proportional |", "|---:|---:|---:|---:|---:|"]
    for batch, size in report["sizes"].items():
        prior = "-" if size["policy_prior"] is None else f"{size['policy_prior']:.2f}"
        lines.append(f"| {batch} | {size['period_ms']:.1f} | {size['measured']:.2f} | {prior} | "
                     f"{size['proportional']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    parser.add_argument("--model", default="standin")
    parser.add_argument("--rounds", type=int, default=None, help="default 2 (--smoke: 1)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    rounds = args.rounds or (1 if args.smoke else 2)
    info = machine()
    smoke = dict(batches=(1, 2), texts=["hello", "a short one"]) if args.smoke else {}
    report = {"machine": info, "model": args.model, "rounds": rounds} | measure(args.model, rounds, **smoke)
    report["machine"] = finish_machine(info)
    for path in write_reports(report, report_folder(args.out, args.smoke), "capacity-prior", markdown):
        print(f"wrote {path}")
    print(markdown(report))


if __name__ == "__main__":
    main()
