"""w8a8 per call (issue 51): rvqspec's AVX-512 VNNI int8 GEMM (`core/int8.cpp`: vnni_linear) against oneDNN's, the
kernel this class took before, in one process, interleaved, 1 thread; under the AVX2 caps (ONEDNN_MAX_CPU_ISA=AVX2
ATEN_CPU_CAPABILITY=avx2) rvqspec's AVX2 kernel alone (no VNNI there). Each class in a process of its own.

Per kernel, medians of interleaved rounds:
- matrices: 1, 4, 9, 17, 33 rows through the 0.6B predictor's 20 layer matrices (78 MB of int8, more than any cache:
  `bench.floor`); one row's fraction of the floor (`bench.floor`'s: the bytes over a copy's bandwidth, here a copy
  moving as many bytes, read + write) and of a float32 sum reading the same bytes, timed interleaved with the kernels
  (the machine's bandwidth varies with its other load); a verify call's (9 and 17 rows) fraction of its floor,
  max(one row's floor, its products at the class's measured w8a8 peak: the fastest kernel's GOP/s on PEAK_ROWS rows);
- predictor: the 0.6B predictor (random weights, w8a8 of bfloat16), one AR frame (15 one-row calls), ms per call;
- talker: the 0.6B talker (28 layers, w8a8 of bfloat16, after a 100-token prompt), one step with its c0 head;
- and first what `rvqspec inspect --device` reports for w8a8 (this class's kernel, the default thread count);
- last, rvqspec's kernel of the class on 1 and 2 threads, interleaved: one row through the matrices (the floor: a copy
  on 2 threads), the predictor's AR call, the talker step; alone and beside a busy process (a core taken, as by the
  speech decoder beside the frame loop: 2 threads must not cost more than 1 then).

- with `--base COMMIT`, first this class's kernel before and after a change: the same calls through the matrices and
  the talker's step in that commit's rvqspec and this tree's, processes of their own alternated `--rounds` times, the
  thread's CPU time (on a shared machine wall time mostly measures the wait for a core); per side the median over
  rounds of each process's median, and after / before per round.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/int8_calls.py   # -> results/int8-calls.{json,md}
    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/int8_calls.py --base main --classes native
    .venv/bin/python benchmarks/int8_calls.py --smoke   # tiny sizes, the native class: seconds, a temporary folder
"""

import argparse
import json
import multiprocessing
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from rvqspec.bench.floor import copy_of, one_row_steps, predictor_shapes
from rvqspec.bench.systems import SMOKE_PREDICTOR
from rvqspec.bench.timing import (CLASS_CAPS, SMOKE_HELP, finish_machine, machine, machine_text, per_class,
                                  report_folder, write_reports)
from rvqspec.core import cpu_class
from rvqspec.core.config import QWEN3_TTS_0_6B
from rvqspec.core.decode import decode_frames
from rvqspec.core.model import MultiCodeDecoder
from rvqspec.core.quantize import PACKERS, Int8Matmul, QuantizedLinear, quantize, quantize_linears, w8a8_kernel
from rvqspec.core.sampling import Sampler
from rvqspec.core.talker import RowCache, Talker, TalkerConfig, prefill, step

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
ROWS = (1, 4, 9, 17, 33)
VERIFY_ROWS = (9, 17)  # the rows whose distance from the floor the report states
CHANGE_ROWS = (1, 2, 4, 5, 9, 17, 33)  # --base: a frame's prefill (2), the policy's verify calls at N = 4 and 8
PEAK_ROWS = 256  # a call of these rows is bound by its products: the class's w8a8 peak
TALKER_0_6B = TalkerConfig(1024, 3072, 28, 16, 8, 128, 3072)
SMOKE_TALKER = TalkerConfig(64, 128, 2, 4, 2, 16, 3072)
PROMPT = 100


def interleaved(calls: dict, rounds: int, repeats: int) -> dict:
    """Median ms of each call, `rounds` rounds of `repeats` calls each, the calls' order alternating per round."""
    times = {name: [] for name in calls}
    for name, call in calls.items():
        call()  # warm-up: packed layouts made
    for i in range(rounds):
        for name in (list(calls) if i % 2 == 0 else list(calls)[::-1]):
            for _ in range(repeats):
                start = time.perf_counter()
                calls[name]()
                times[name].append(1e3 * (time.perf_counter() - start))
    return {name: statistics.median(t) for name, t in times.items()}


def on_threads(threads: int, call):
    """`call` on `threads` threads (interleaved runs of several thread counts set theirs each time)."""
    def run():
        torch.set_num_threads(threads)
        return call()
    return run


def spin(busy) -> None:
    """A busy process's loop: spins while `busy` is set (a shared flag), else sleeps 1 ms at a time."""
    while busy.value >= 0:
        if busy.value:
            start = time.perf_counter()
            while time.perf_counter() - start < 1e-3:
                pass
        else:
            time.sleep(1e-3)


def beside_busy(busy, call):
    """`call` while the busy process spins."""
    def run():
        busy.value = 1
        try:
            return call()
        finally:
            busy.value = 0
    return run


def with_kernel(kernel: str, matmuls: list[Int8Matmul], call, threads: int = 1, busy=None):
    """`call` on `threads` threads with every one of `matmuls` on `kernel` (each keeps the one it was given, and
    every kernel's form beside the others': an Int8Matmul holds one, and interleaved runs would repack each time),
    beside the busy process where `busy` (its flag) is given."""
    def run():
        for matmul in matmuls:
            matmul.kernel = kernel
            if kernel not in matmul.forms:
                matmul.forms = {**matmul.forms, kernel: PACKERS[kernel](*matmul.rows())}
        return call()
    return on_threads(threads, run if busy is None else beside_busy(busy, run))


def int8_matmuls(model) -> list[Int8Matmul]:
    """The layers' matmuls of a quantized model, and its heads' where it has int8 heads."""
    heads = getattr(model, "head_weights", None)
    return [m.matmul for m in model.modules() if isinstance(m, QuantizedLinear)] + (heads.matmuls if heads else [])


def matrices(runs: dict, rounds: int, shapes: list[tuple[int, int]], rows=ROWS) -> dict:
    """`runs`: name -> (kernel, threads); the floors on the most threads of them."""
    generator = torch.Generator().manual_seed(0)
    matmuls = [Int8Matmul(torch.randn(shape, generator=generator) / shape[1] ** 0.5, "w8a8") for shape in shapes]
    inputs = {n: {k: torch.randn(n, k, generator=generator).bfloat16() for k in {s[1] for s in shapes}} for n in ROWS}
    nbytes = sum(a * b for a, b in shapes)
    read = torch.ones(nbytes // 4)
    most = max(threads for _, threads, *_ in runs.values())
    floor = {"floor: a copy of the bytes": on_threads(most, copy_of(nbytes)),
             "a sum reading the bytes": on_threads(most, read.sum)}
    ms = {}
    for n in rows:
        calls = {name: with_kernel(kernel, matmuls, lambda x=inputs[n]: [m(x[m.in_features]) for m in matmuls], *how)
                 for name, (kernel, *how) in runs.items()}
        ms[str(n)] = interleaved(calls | (floor if n == 1 else {}), rounds, 2)
    one = ms["1"]
    report = {"ms": ms, "bytes": nbytes, "floor_ms": one["floor: a copy of the bytes"],
              "of_floor": {name: one["floor: a copy of the bytes"] / one[name] for name in runs},
              "of_read": {name: one["a sum reading the bytes"] / one[name] for name in runs}}
    return report | verify_floors(report, runs, matmuls, generator) if set(VERIFY_ROWS) <= set(rows) else report


def rows_worker(rounds: int, smoke: bool) -> dict:
    """This process's rvqspec (a base commit's or this tree's): w8a8 calls through the matrices on 1 thread, the
    median CPU ms per rows (only what every commit's rvqspec has: Int8Matmul on its class's kernel)."""
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    shapes = [(96, 64), (64, 96)] if smoke else predictor_shapes("0.6b")
    matmuls = [Int8Matmul(torch.randn(shape, generator=generator) / shape[1] ** 0.5, "w8a8") for shape in shapes]
    inputs = {n: {k: torch.randn(n, k, generator=generator).bfloat16() for k in {s[1] for s in shapes}}
              for n in CHANGE_ROWS}
    calls = {str(n): lambda x=x: [m(x[m.in_features]) for m in matmuls] for n, x in inputs.items()}
    times = {name: [] for name in [*calls, "talker step"]}
    with torch.inference_mode():
        config = SMOKE_TALKER if smoke else TALKER_0_6B
        calls["talker step"] = stepper(talker_w8a8(config), config)
        for _ in range(3 * rounds + 1):  # the first: warm-up
            for name, call in calls.items():
                start = time.thread_time()
                call()
                times[name].append(1e3 * (time.thread_time() - start))
    return {"kernel": w8a8_kernel(), "ms": {name: statistics.median(t[1:]) for name, t in times.items()}}


def before_after(base: str, rounds: int, smoke: bool) -> dict:
    """rows_worker in `base`'s rvqspec and this tree's, alternated `rounds` times (smoke: this tree twice)."""
    from rvqspec.bench.timing import sources_at, tree_commit, worker_result

    runs = {"before": [], "after": []}
    argv = [__file__, "--rows-worker", "--rounds", str(rounds)] + ["--smoke"] * smoke
    with nullcontext(ROOT) if smoke else sources_at(base, ROOT) as tree:
        for _ in range(rounds):
            for side, source in (("before", tree), ("after", ROOT)):
                runs[side].append(worker_result(source, argv, env={"OMP_WAIT_POLICY": "PASSIVE"}))
    ratios = {n: [a["ms"][n] / b["ms"][n] for b, a in zip(runs["before"], runs["after"])]
              for n in runs["after"][0]["ms"]}
    side = lambda name: {n: statistics.median(r["ms"][n] for r in runs[name]) for n in ratios}  # noqa: E731
    return {"base": "this tree (--smoke)" if smoke else base, "after_commit": tree_commit(ROOT),
            "kernel": runs["after"][0]["kernel"],
            "before": side("before"), "after": side("after"), "ratios": ratios,
            "ratio": {n: statistics.median(r) for n, r in ratios.items()}}


def verify_floors(report: dict, runs: dict, matmuls: list[Int8Matmul], generator) -> dict:
    """The class's w8a8 peak (GOP/s: the fastest of `runs` on PEAK_ROWS rows through the matrices) and each verify
    call's fraction of its floor, max(one row's floor, its products at that peak)."""
    x = {k: torch.randn(PEAK_ROWS, k, generator=generator).bfloat16() for k in {m.in_features for m in matmuls}}
    calls = {name: with_kernel(kernel, matmuls, lambda: [m(x[m.in_features]) for m in matmuls], *how)
             for name, (kernel, *how) in runs.items()}
    ops = 2 * PEAK_ROWS * report["bytes"]
    peak = max(ops / ms / 1e6 for ms in interleaved(calls, 2, 1).values())
    floors = {n: max(report["floor_ms"], 2 * n * report["bytes"] / peak / 1e6) for n in VERIFY_ROWS}
    return {"peak_gop_s": peak, "verify_floor_ms": {str(n): f for n, f in floors.items()},
            "verify_of_floor": {str(n): {name: f / report["ms"][str(n)][name] for name in runs}
                                for n, f in floors.items()}}


def predictor(runs: dict, rounds: int, config) -> dict:
    torch.manual_seed(0)
    model = quantize(MultiCodeDecoder(config).bfloat16().eval(), "w8a8")
    hidden, c0 = torch.randn(1, config.talker_hidden_size).bfloat16(), torch.tensor([5])
    sampler = Sampler(do_sample=False)
    calls = {name: with_kernel(kernel, int8_matmuls(model), lambda: decode_frames(model, hidden, c0, sampler), *how)
             for name, (kernel, *how) in runs.items()}
    frame = interleaved(calls, rounds, 1)
    return {"ar_frame_ms": frame, "ar_call_ms": {k: v / 15 for k, v in frame.items()}}


def talker_w8a8(config: TalkerConfig):
    """The talker of `config`, random (seed 0), in bfloat16 quantized to w8a8."""
    torch.manual_seed(0)
    model = Talker(config).bfloat16().eval()
    quantize_linears(model, "w8a8")
    return model


def stepper(model, config: TalkerConfig):
    """A call that runs one decode step and the c0 head, on a cache of its own holding a PROMPT-token prefill."""
    cache = RowCache(model)
    prefill(model, cache, cache.add(), torch.randn(PROMPT, config.hidden_size).bfloat16() * 0.05, torch.arange(PROMPT))
    x = torch.randn(1, config.hidden_size).bfloat16() * 0.05
    return lambda: model.codec_head(step(model, cache, x, torch.tensor(cache.lengths)))


def talker(runs: dict, rounds: int, config: TalkerConfig) -> dict:
    model = talker_w8a8(config)
    steps = {name: stepper(model, config) for name in runs}
    calls = {name: with_kernel(kernel, int8_matmuls(model), steps[name], *how) for name, (kernel, *how) in runs.items()}
    int8_bytes = sum(m.matmul.in_features * m.matmul.out_features for m in model.modules() if hasattr(m, "matmul"))
    return {"step_ms": interleaved(calls, rounds, 3), "int8_bytes": int8_bytes}


def one_class(args) -> dict:
    kernels = ["avx2"] if w8a8_kernel() == "avx2" else ["onednn", "vnni"]
    log = lambda text: print(f"[{time.strftime('%H:%M:%S')}] {cpu_class.cpu_class()}: {text}", flush=True)  # noqa
    shapes = [(96, 64), (64, 96)] if args.smoke else predictor_shapes("0.6b")
    smoke = dict(config=SMOKE_PREDICTOR, repeats=2) if args.smoke else {}
    report = {"cpu": cpu_class.describe(), "class": cpu_class.cpu_class(), "kernels": kernels,
              "inspect": one_row_steps(schemes=("w8a8",), log=log, **smoke)}  # what `rvqspec inspect --device` prints
    threads, runs = torch.get_num_threads(), {kernel: (kernel, 1) for kernel in kernels}
    with torch.inference_mode():
        report |= sizes(runs, args, shapes, ROWS)
        log(f"1 thread: {json.dumps(report)}")
        ours = kernels[-1]  # rvqspec's kernel on this class
        busy = multiprocessing.get_context("spawn").Value("i", 0)
        spinner = multiprocessing.get_context("spawn").Process(target=spin, args=(busy,), daemon=True)
        spinner.start()
        try:
            runs = {"1 thread": (ours, 1), "2 threads": (ours, 2), "1 thread, a busy core": (ours, 1, busy),
                    "2 threads, a busy core": (ours, 2, busy)}
            report["two_threads"] = sizes(runs, args, shapes, (1,))
        finally:
            busy.value = -1
            spinner.join()
        log(f"1 and 2 threads: {json.dumps(report['two_threads'])}")
    torch.set_num_threads(threads)
    return report


def sizes(runs: dict, args, shapes: list[tuple[int, int]], rows) -> dict:
    """The matrices, the predictor's AR call and the talker step, each of `runs` (name -> (kernel, threads))."""
    return {"matrices": matrices(runs, args.rounds, shapes, rows),
            "predictor": predictor(runs, args.rounds, SMOKE_PREDICTOR if args.smoke else QWEN3_TTS_0_6B),
            "talker": talker(runs, args.rounds, SMOKE_TALKER if args.smoke else TALKER_0_6B)}


def to_markdown(report: dict) -> str:
    lines = ["# w8a8 per call: rvqspec's VNNI int8 GEMM against oneDNN's (issue 51)", "",
             f"`{report['command']}`, 1 thread, {machine_text(report['machine'])}. Medians of interleaved rounds "
             "within one process per class; a capped class is this CPU standing in for another.", ""]
    for r in report["classes"].values():
        m, kernels = r["matrices"], r["kernels"]
        lines += [f"## {r['cpu']}", "", "One call through the 0.6B predictor's 20 layer matrices "
                  f"({m['bytes'] / 1e6:.0f} MB), ms; one row's floor (a copy moving as many bytes) "
                  f"{m['floor_ms']:.2f} ms, interleaved", "",
                  "| rows | " + " | ".join(kernels) + " |", "|---|" + "---|" * len(kernels)]
        lines += [f"| {n} | " + " | ".join(f"{row[k]:.2f}" for k in kernels) + " |" for n, row in m["ms"].items()]
        lines += ["| one row, of the floor | " + " | ".join(f"{m['of_floor'][k]:.0%}" for k in kernels) + " |",
                  "| one row, of a sum reading the bytes | " + " | ".join(f"{m['of_read'][k]:.0%}" for k in kernels)
                  + " |"]
        lines += [f"| {n} rows, of the floor ({m['verify_floor_ms'][n]:.2f} ms) | "
                  + " | ".join(f"{m['verify_of_floor'][n][k]:.0%}" for k in kernels) + " |"
                  for n in m["verify_of_floor"]]
        lines += ["", f"A verify call's floor: max(one row's floor, its products at this class's measured w8a8 peak, "
                  f"{m['peak_gop_s']:.0f} GOP/s: the fastest kernel on {PEAK_ROWS} rows through the matrices).", "",
                  "| 0.6B, bfloat16 activations, one row | " + " | ".join(kernels) + " |",
                  "|---|" + "---|" * len(kernels),
                  "| predictor AR call, ms | " + " | ".join(f"{r['predictor']['ar_call_ms'][k]:.2f}" for k in kernels)
                  + " |", "| talker step + c0 head, ms | " + " | ".join(f"{r['talker']['step_ms'][k]:.1f}"
                                                                        for k in kernels) + " |", ""]
        lines += summary(r) + two_threads(r)
        inspect = r["inspect"]
        w8a8 = inspect["schemes"]["w8a8"]
        lines += [f"`rvqspec inspect --device` (its defaults: {inspect['threads']} threads, the floor a copy of as many "
                  f"bytes timed between its calls, {w8a8['bandwidth_gb_s']:.1f} GB/s): w8a8 one row "
                  f"{w8a8['ms']['1']:.2f} ms, **{w8a8['of_floor']:.0%} of the floor**; 4 rows "
                  f"{w8a8['rows_over_one']['4']:.2f}x, 8 rows "
                  f"{w8a8['rows_over_one']['8']:.2f}x ({inspect['kernels']['w8a8']}).", ""]
    return "\n".join(lines + changed(report.get("before_after")))


def changed(b: dict | None) -> list[str]:
    """The before/after section (`--base`), where it was measured."""
    if b is None:
        return []
    lines = [f"## Before and after: {b['base']} -> {b['after_commit']} ({b['kernel']}, native, 1 thread)", "",
             "Rows through the 0.6B predictor's 20 layer matrices in one call each, and the 0.6B talker's step with "
             "its c0 head; ms of the thread's CPU time; each side in processes of its own, alternated "
             f"{len(b['ratios']['1'])} times.", "",
             "| call | before | after | after / before | per round |", "|---|---:|---:|---:|---|"]
    label = lambda n: {"1": "1 row"}.get(n, f"{n} rows" if n.isdigit() else n)  # noqa: E731
    lines += [f"| {label(n)} | {b['before'][n]:.2f} | {b['after'][n]:.2f} | **{b['ratio'][n]:.2f}** | "
              + ", ".join(f"{r:.2f}" for r in b["ratios"][n]) + " |" for n in b["ratio"]]
    return lines + [""]


def summary(r: dict) -> list[str]:
    """The talker step against its floor, and the VNNI kernel's speed-up over oneDNN's where both ran."""
    m, kernels, step_ms = r["matrices"], r["kernels"], r["talker"]["step_ms"]
    talker_floor = r["talker"]["int8_bytes"] / m["bytes"] * m["floor_ms"]
    lines = [f"The talker's int8 weights ({r['talker']['int8_bytes'] / 1e6:.0f} MB) at the matrices' copy rate: "
             f"{talker_floor:.1f} ms; its step reaches "
             + ", ".join(f"{k} {talker_floor / step_ms[k]:.0%}" for k in kernels) + " of that floor.", ""]
    if len(kernels) == 2:
        old, new = kernels
        ratio = lambda figures: figures[old] / figures[new]  # noqa: E731
        lines += [f"{new} over {old}: one row through the matrices **{ratio(m['ms']['1']):.2f}x**, 33 rows "
                  f"{ratio(m['ms']['33']):.2f}x, the predictor's AR call **{ratio(r['predictor']['ar_call_ms']):.2f}x**"
                  f", the talker step **{ratio(step_ms):.2f}x**.", ""]
    return lines


def two_threads(r: dict) -> list[str]:
    """rvqspec's kernel of the class on 1 and 2 threads (torch.set_num_threads), interleaved."""
    t, ours = r["two_threads"], r["kernels"][-1]
    m, names = t["matrices"], list(t["matrices"]["of_floor"])
    figures = {"one row through the matrices, ms": m["ms"]["1"], "predictor AR call, ms": t["predictor"]["ar_call_ms"],
               "talker step + c0 head, ms": t["talker"]["step_ms"]}
    pairs = list(zip(names[::2], names[1::2]))  # (1 thread, 2 threads), alone and beside a busy core
    ratios = [f"{one} / {two}" for one, two in pairs]
    lines = [f"{ours} on 1 and 2 threads, interleaved (the floor: a copy of the matrices' bytes on 2 threads, "
             f"{m['floor_ms']:.2f} ms; a busy core: a process spinning beside the call, as the speech decoder does "
             "beside the frame loop)", "", "| one row | " + " | ".join(names + ratios) + " |",
             "|---|" + "---|" * (len(names) + len(ratios))]
    lines += [f"| {what} | " + " | ".join([f"{v[n]:.2f}" for n in names] + [f"{v[one] / v[two]:.2f}x"
                                                                          for one, two in pairs]) + " |"
              for what, v in figures.items()]
    return lines + ["| matrices, of the floor | " + " | ".join(f"{m['of_floor'][n]:.0%}" for n in names)
                    + " |" * len(ratios) + " |", ""]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP + " (the native class only)")
    parser.add_argument("--classes", default=None, help="default: " + ",".join(CLASS_CAPS))
    parser.add_argument("--rounds", type=int, default=None, help="default 6 (--smoke: 1)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: this process measures its own class into FILE
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--base", help="also this class's kernel at a commit before a change, against this tree")
    parser.add_argument("--rows-worker", action="store_true", help=argparse.SUPPRESS)  # internal: rows_worker's JSON
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (1 if args.smoke else 6)
    args.classes = args.classes or ("native" if args.smoke else ",".join(CLASS_CAPS))
    if args.one:
        Path(args.one).write_text(json.dumps(one_class(args)))
        return
    if args.rows_worker:
        print(json.dumps(rows_worker(args.rounds, args.smoke)))
        return
    info = machine()
    changes = before_after(args.base, args.rounds, args.smoke) if args.base else None
    classes = per_class(__file__, args.classes.split(","), ["--rounds", str(args.rounds)] + ["--smoke"] * args.smoke)
    report = {"classes": classes, "before_after": changes, "machine": finish_machine(info), "command": " ".join(
        [".venv/bin/python benchmarks/int8_calls.py", *(sys.argv[1:] if argv is None else argv)])}
    write_reports(report, report_folder(args.out, args.smoke), "int8-calls", to_markdown)


if __name__ == "__main__":
    main()
