"""Concurrency against one at a time (issue 40): N requests streamed from N caller threads, together or staggered,
against the same N requests decoded one after another by the same engine, at default settings (no thread flags),
on 1 and 2 cores (the process pinned). Models: the tiny random qwen-tts of the tests (its codec and frame loop
both matter) and the shipped stand-in (its HiFi-GAN vocoder dominates).

    .venv/bin/python benchmarks/concurrency.py [--cores 1,2] [--requests 1,2,3,4,8] [--repeats 3]

Reports benchmarks/results/concurrency.{json,md}: per model, cores and N, the medians over interleaved repeats of
the wall time over serial's, aggregate audio seconds per second, p50/p95 time to first audio, and the largest gap
between two chunks of a stream (and the same for serial).
"""

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from rvqspec.bench.timing import cpu_name, write_reports  # noqa: E402
from rvqspec.runtime import Engine  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
TEXTS = ["hello there, how are you today", "a second sentence for the batch", "the third one is short",
         "four requests decoding together", "five and counting along", "six of them now in flight",
         "seven streams at once", "and the eighth sentence"]


def tiny_qwen():
    from helpers.upstream_tts import tiny_qwen3_tts

    tts = tiny_qwen3_tts(seed=0)
    return Engine(tts), lambda i: dict(kind="custom_voice", text=TEXTS[i], speaker="tiny", language="English",
                                       max_new_tokens=40, do_sample=False, subtalker_dosample=False)


def standin():
    return Engine("standin"), lambda i: dict(kind="speech", text=TEXTS[i], language="en", do_sample=False,
                                             subtalker_dosample=False)


MODELS = {"tiny-qwen-tts": tiny_qwen, "standin": standin}
MODES = ("serial", "together", "staggered")


def stream(engine, arguments: dict, start: float, out: dict) -> None:
    """Stream one request's audio; record its first-audio time, largest chunk gap and samples."""
    arguments = dict(arguments)
    request = engine.submit(arguments.pop("kind"), **arguments)
    last, gap, samples = None, 0.0, 0
    for chunk in request:
        now = time.perf_counter()
        gap = max(gap, now - last) if last is not None else gap
        if last is None:
            out["first"] = now - start
        last, samples = now, samples + len(chunk)
    out.update(gap=gap, audio=samples / engine.sample_rate)


def together(engine, requests: list[dict], stagger: float) -> dict:
    outs = [{} for _ in requests]
    start = time.perf_counter()
    threads = []
    for i, arguments in enumerate(requests):
        if i and stagger:
            time.sleep(stagger)
        threads.append(threading.Thread(target=stream, args=(engine, arguments, time.perf_counter(), outs[i])))
        threads[-1].start()
    for thread in threads:
        thread.join()
    return summary(outs, time.perf_counter() - start)


def serial(engine, requests: list[dict]) -> dict:
    """One at a time: request i starts when i-1 ended; its first audio counts from when it could have arrived
    (all at time 0), as a server decoding one at a time would give it."""
    outs, start = [{} for _ in requests], time.perf_counter()
    for i, arguments in enumerate(requests):
        stream(engine, arguments, start, outs[i])
    return summary(outs, time.perf_counter() - start)


def summary(outs: list[dict], seconds: float) -> dict:
    firsts = [o["first"] for o in outs]
    audio = sum(o["audio"] for o in outs)
    return {"seconds": seconds, "audio_per_second": audio / seconds, "first_p50": float(np.percentile(firsts, 50)),
            "first_p95": float(np.percentile(firsts, 95)), "largest_gap": max(o["gap"] for o in outs)}


def measure(model: str, cores: int, counts: list[int], repeats: int, stagger: float, log) -> list[dict]:
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:cores])
    engine, arguments = MODELS[model]()
    try:
        log(f"{model} on {cores} core(s): budget {engine.budget}, {engine.explain(1)}")
        together(engine, [arguments(0)], 0.0)  # warm-up
        runs = {(mode, n): [] for n in counts for mode in (("serial",) if n == 1 else MODES)}
        for repeat in range(repeats):
            for mode, n in (list(runs) if repeat % 2 == 0 else list(runs)[::-1]):
                requests = [arguments(i) for i in range(n)]
                result = serial(engine, requests) if mode == "serial" else \
                    together(engine, requests, stagger if mode == "staggered" else 0.0)
                runs[(mode, n)].append(result)
                log(f"  {mode} x{n}: {result['seconds']:.2f} s, {result['audio_per_second']:.2f} audio s/s")
    finally:
        engine.close()
    rows = []
    for n in counts:
        base = {key: statistics.median(r[key] for r in runs[("serial", n)]) for key in runs[("serial", n)][0]}
        if n == 1:
            rows.append({"model": model, "cores": cores, "requests": 1, "mode": "alone", **base, "over_serial": 1.0,
                         "serial": base})
        for mode in MODES[1:] if n > 1 else ():
            med = {key: statistics.median(r[key] for r in runs[(mode, n)]) for key in runs[(mode, n)][0]}
            ratios = [r["seconds"] / s["seconds"] for r, s in zip(runs[(mode, n)], runs[("serial", n)])]
            rows.append({"model": model, "cores": cores, "requests": n, "mode": mode, **med,
                         "over_serial": statistics.median(ratios), "serial": base})
    return rows


def markdown(report: dict) -> str:
    lines = ["# Concurrency against one at a time", "",
             f"Measured on {report['cpu']} ({report['native']}), torch {report['torch']}, default Engine settings "
             f"(the thread budget's split of the pinned cores); medians of {report['repeats']} interleaved repeats; "
             f"staggered: a request every {report['stagger']} s. `{report['command']}`.", "",
             "Wall / serial: the N requests' wall time over the same engine decoding them one after another (below "
             "1: concurrency pays). First audio of serial counts from time 0 for every request (all arrived then).",
             "", "| model | cores | N | mode | wall / serial | audio s/s | vs serial | first audio p50 / p95 (s) | "
             "serial p95 (s) | largest gap (s) | serial's (s) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        s = r["serial"]
        lines.append(f"| {r['model']} | {r['cores']} | {r['requests']} | {r['mode']} | {r['over_serial']:.2f} | "
                     f"{r['audio_per_second']:.2f} | {r['audio_per_second'] / s['audio_per_second']:.2f}x | "
                     f"{r['first_p50']:.2f} / {r['first_p95']:.2f} | {s['first_p95']:.2f} | {r['largest_gap']:.2f} | "
                     f"{s['largest_gap']:.2f} |")
    worst = max((r["over_serial"] for r in report["rows"] if r["requests"] > 1), default=float("nan"))
    three = [r["over_serial"] for r in report["rows"] if r["requests"] == 3 and r["mode"] == "together"
             and r["model"] == "tiny-qwen-tts" and r["cores"] == 2]
    lines += ["", "Targets (issue 40), this run:", "",
              f"- 3 concurrent tiny-model requests, 2 cores: {three[0]:.2f}x serial's wall time (target <= 0.8x): "
              f"{'met' if three[0] <= 0.8 else 'NOT met'}" if three else "- 3 tiny requests on 2 cores: not run",
              f"- the slowest concurrency over serial, any row of 2 or more requests: {worst:.2f}x (target <= 1.0x: never slower): "
              f"{'met' if worst <= 1.0 else 'NOT met'}"]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--cores", default="1,2")
    parser.add_argument("--requests", default="1,2,3,4,8")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--stagger", type=float, default=0.3, help="seconds between staggered submits")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    counts = [int(n) for n in args.requests.split(",")]
    log = lambda text: print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)  # noqa: E731
    capped = "ONEDNN_MAX_CPU_ISA" in os.environ or "ATEN_CPU_CAPABILITY" in os.environ
    report = {"cpu": cpu_name(), "native": "capped" if capped else "native", "torch": torch.__version__,
              "repeats": args.repeats, "stagger": args.stagger, "rows": [],
              "command": " ".join([".venv/bin/python benchmarks/concurrency.py", *sys.argv[1:]])}
    every = sorted(os.sched_getaffinity(0))
    for model in args.models.split(","):
        for cores in [int(c) for c in args.cores.split(",")]:
            os.sched_setaffinity(0, every)
            report["rows"] += measure(model, cores, counts, args.repeats, args.stagger, log)
    write_reports(report, args.out, "concurrency", markdown)
    print(markdown(report))


if __name__ == "__main__":
    main()
