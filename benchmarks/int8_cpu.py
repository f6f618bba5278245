"""int8 weights on each x86 class this machine can stand in for (issue 45): natively and under the AVX2 caps
(ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2: rvqspec's AVX2 int8 GEMM, bfloat16 emulated), 1 thread, each class
in processes of its own (the caps are read when torch loads). A capped class is a stand-in: its kernels are the
class's, its memory system and clock are this machine's.

Per class:
- matmul: [M, 1024] x [1024, 3072], M = 1, 4, 9, 33, per scheme (and torch's weight-only kernel on float32, what
  w8a16 ran before), medians;
- floor: one row through the 0.6B predictor's decoder stack as the engine runs it, per scheme, against its matrices'
  bytes / the copy bandwidth, and 4 and 8 rows against one (`rvqspec.bench.floor`);
- predictor: the 0.6B predictor (random layers, heads set on the float model to the paper's 2.47 tokens/step at
  N = 32), the class's fastest float dtype (bfloat16 where oneDNN has it, else float32) and w8a8 of it: the AR frame,
  speculative frames at N = 4, 8, 16, 32, and the policy's choice from latencies measured now (as `rvqspec demo`);
  AR frames of 4 and 8 rows against one;
- end to end (`benchmarks/end_to_end.py`'s system, rvqspec.bench.systems: upstream's Qwen3-TTS at the 0.6B sizes,
  random weights, the released 12 Hz decoder): upstream's `generate_custom_voice` (float32), `rvqspec.Engine` in the float dtype and
  with `weights="w8a8", talker_weights="w8a8"` (tree "auto"), whole utterances, interleaved; and the talker step
  alone against its floor.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/int8_cpu.py [--quick]   # -> results/int8-cpu.{json,md}
    .venv/bin/python benchmarks/int8_cpu.py --smoke   # tiny sizes, the native class: seconds, a temporary folder
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import end_to_end as e2e  # noqa: E402 - its run, talker step and summary

import rvqspec  # noqa: E402
from rvqspec.bench.batched import batch_inputs  # noqa: E402
from rvqspec.bench.controlled import PAPER_ACCEPTANCE, calibrate_strength, controlled_predictor  # noqa: E402
from rvqspec.bench.floor import one_row_steps  # noqa: E402
from rvqspec.bench.systems import SIZES as SYSTEM_SIZES, SMOKE_PREDICTOR, controlled_heads, system_tts  # noqa: E402
from rvqspec.bench.timing import (CLASS_CAPS, SMOKE_HELP, finish_machine, machine, machine_text,  # noqa: E402
                                  per_class, report_folder, write_reports)
from rvqspec.cli.demo import LIVE_SIZES, live_sizes_policy  # noqa: E402
from rvqspec.core import cpu_class  # noqa: E402
from rvqspec.core.config import QWEN3_TTS_0_6B  # noqa: E402
from rvqspec.core.decode import decode_frames  # noqa: E402
from rvqspec.core.device_path import fastest_float, median_ms  # noqa: E402
from rvqspec.core.drafters import ReusedHeads  # noqa: E402
from rvqspec.core.quantize import Int8Matmul, quantize, quantize_rows  # noqa: E402
from rvqspec.core.sampling import Sampler  # noqa: E402
from rvqspec.core.tree import default_tree  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
MATMUL_ROWS = (1, 4, 9, 33)


@torch.inference_mode()
def matmuls(k: int = 1024, n: int = 3072) -> dict:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(n, k, generator=generator) / k ** 0.5
    q, scale = quantize_rows(weight)
    w8a16, w8a8, bf16 = Int8Matmul(weight, "w8a16"), Int8Matmul(weight, "w8a8"), weight.bfloat16()
    out = {}
    for rows in MATMUL_ROWS:
        x = torch.randn(rows, k, generator=generator)
        xb = x.bfloat16()
        out[str(rows)] = median_ms({"float32": lambda: F.linear(x, weight), "bfloat16": lambda: F.linear(xb, bf16),
                                    "w8a16": lambda: w8a16(x), "w8a8": lambda: w8a8(x),
                                    "torch w8a16 (float32)": lambda: torch._weight_int8pack_mm(x, q, scale)})
    return out


@torch.inference_mode()
def predictor_frames(frames: int, log, config=QWEN3_TTS_0_6B, iterations: int = 6) -> dict:
    dtype, sampler, tree = str(fastest_float()).removeprefix("torch."), Sampler(), default_tree(32)
    predictor = controlled_predictor(config, dtype=dtype)
    inputs = [batch_inputs(predictor, 1, r) for r in range(frames + 1)]
    calibrated = calibrate_strength(predictor, tree, PAPER_ACCEPTANCE[32], sampler,
                                    [(h[0], int(c)) for h, c in inputs[:8]], iterations=iterations, low=3.0, high=12.0)
    log(f"heads: {calibrated.measured:.2f} tokens/step at N=32 ({dtype})")
    models = {dtype: predictor.model, "w8a8": quantize(predictor.model, "w8a8")}
    out = {"dtype": dtype, "tokens_per_step_at_32": calibrated.measured, "schemes": {}}
    for name, model in models.items():
        policy = live_sizes_policy(model, [(h[0], int(c)) for h, c in inputs[1:5]], sampler)
        chosen = policy.choose(1)
        modes = {"ar": None} | {str(n): default_tree(n) for n in LIVE_SIZES}  # every size the policy may pick
        times = {mode: [] for mode in modes}
        for r, (h, c) in enumerate(inputs):  # the first: warm-up
            for mode, t in modes.items():
                start = time.perf_counter()
                decode_frames(model, h, c, sampler, torch.Generator().manual_seed(r), ReusedHeads(model) if t else None,
                              t)
                if r:
                    times[mode].append(1e3 * (time.perf_counter() - start))
        ms = {mode: statistics.median(t) for mode, t in times.items()}
        batch = {}
        for rows in (4, 8):
            h, c = batch_inputs(predictor, rows, 0)
            batch[str(rows)] = median_ms({"ar": lambda: decode_frames(model, h, c, sampler)}, 3)["ar"] / ms["ar"]
        out["schemes"][name] = {"ms": ms, "policy_size": chosen, "policy_ms": ms[str(chosen)] if chosen else ms["ar"],
                                "why": policy.explain(1), "ar_rows_over_one": batch}
        log(f"{name}: AR frame {ms['ar']:.0f} ms, " + ", ".join(f"N={n} {ms[str(n)]:.0f}" for n in LIVE_SIZES)
            + f"; policy {policy.explain(1)}")
    base = out["schemes"][dtype]
    out["w8a8_ar_over_float_ar"] = out["schemes"]["w8a8"]["ms"]["ar"] / base["ms"]["ar"]
    out["w8a8_policy_over_float_ar"] = out["schemes"]["w8a8"]["policy_ms"] / base["ms"]["ar"]
    return out


def end_to_end(frames: int, repeats: int, log, sizes: str = "0.6b") -> dict:
    """float32 throughout (upstream's model as loaded; the Engine decodes the model it is given in its dtype): the
    fastest float on AVX2; on classes with bfloat16, benchmarks/results/end-to-end.md has the bfloat16 figures."""
    e2e.REQUEST["max_new_tokens"] = frames + 1
    tts = system_tts(SYSTEM_SIZES[sizes], torch.float32)
    heads = controlled_heads(tts, SYSTEM_SIZES[sizes], torch.float32, log, iterations=1 if sizes == "smoke" else 6)
    engines = {"engine": rvqspec.Engine(tts, drafter=rvqspec.ReusedHeads(), tree="auto", seed=0),
               "engine-w8a8": rvqspec.Engine(tts, drafter=rvqspec.ReusedHeads(), tree="auto", weights="w8a8",
                                             talker_weights="w8a8", seed=0)}
    settings = ["upstream:whole", "engine:whole", "engine-w8a8:whole"]
    try:
        for setting in settings:
            e2e.run_once(tts, setting, 12, 3, engines)  # warm-up
        runs = {setting: [] for setting in settings}
        for repeat in range(repeats):
            for setting in settings if repeat % 2 == 0 else settings[::-1]:
                result = e2e.run_once(tts, setting, 12, 3, engines)
                log(f"{setting}: {result['seconds']:.1f} s for {result['audio_seconds']:.2f} s of audio")
                runs[setting].append(result)
        talkers = {"float32": (engines["engine"].model.talker, engines["engine"].model),
                   "w8a8": (engines["engine-w8a8"].model.talker, engines["engine-w8a8"].model)}
        step = e2e.talker_step(tts, talkers, 4 if sizes == "smoke" else 24, log, 0.02 if sizes == "smoke" else 1.0)
    finally:
        for engine in engines.values():
            engine.close()
    table = {setting: e2e.summarize(rows) for setting, rows in runs.items()}
    whole = {setting: row["seconds"] for setting, row in table.items()}
    return {"frames": frames, "repeats": repeats, "heads": heads, "table": table, "talker_step": step,
            "engine_dtype": "float32",
            "w8a8_over_float_engine": whole["engine:whole"] / whole["engine-w8a8:whole"],
            "w8a8_over_upstream": whole["upstream:whole"] / whole["engine-w8a8:whole"],
            "float_engine_over_upstream": whole["upstream:whole"] / whole["engine:whole"]}


def one_class(args) -> dict:
    torch.set_num_threads(1)
    e2e.pin(1)
    log = lambda text: print(f"[{time.strftime('%H:%M:%S')}] {cpu_class.cpu_class()}: {text}", flush=True)  # noqa
    smoke = dict(config=SMOKE_PREDICTOR, repeats=2) if args.smoke else {}
    report = {"cpu": cpu_class.describe(), "class": cpu_class.cpu_class(),
              "matmul_ms": matmuls(64, 128) if args.smoke else matmuls()}
    log(f"matmuls: {json.dumps(report['matmul_ms'])}")
    report["floor"] = one_row_steps(log=log, **smoke)
    report["predictor"] = predictor_frames(args.frames, log, *((SMOKE_PREDICTOR, 1) if args.smoke else ()))
    if not args.no_end_to_end:
        report["end_to_end"] = end_to_end(args.e2e_frames, args.repeats, log, "smoke" if args.smoke else "0.6b")
    return report


def to_markdown(report: dict) -> str:
    lines = ["# int8 weights per CPU class (issue 45)", "", f"`{report['command']}`, 1 thread, "
             f"{machine_text(report['machine'])}. A capped class is this CPU standing in for another: its kernels, "
             "this machine's memory and clock.", ""]
    for name, r in report["classes"].items():
        lines += [f"## {r['cpu']}", "", "### One matmul, [M, 1024] x [1024, 3072], ms (medians)", "",
                  "| M | " + " | ".join(r["matmul_ms"]["1"]) + " |", "|---|" + "---|" * len(r["matmul_ms"]["1"])]
        lines += [f"| {m} | " + " | ".join(f"{v:.3f}" for v in row.values()) + " |"
                  for m, row in r["matmul_ms"].items()]
        floor = r["floor"]
        lines += ["", "### One row through the 0.6B predictor's decoder stack as the engine runs it (`bench.floor`; "
                  "floor: a copy moving its matrices' bytes, timed between the calls)", "", "| scheme | kernel | one row ms | floor ms | of floor | "
                  "4 rows / 1 | 8 rows / 1 |", "|---|---|---|---|---|---|---|"]
        for scheme, s in floor["schemes"].items():
            if "refused" in s:
                lines.append(f"| {scheme} | {floor['kernels'][scheme]} | refused | | | | |")
                continue
            lines.append(f"| {scheme} | {floor['kernels'][scheme]} | {s['ms']['1']:.2f} | {s['floor_ms']:.2f} | "
                         f"{s['of_floor']:.0%} | {s['rows_over_one']['4']:.2f}x | {s['rows_over_one']['8']:.2f}x |")
        p = r["predictor"]
        sizes = [n for n in next(iter(p["schemes"].values()))["ms"] if n != "ar"]  # older reports timed fewer
        lines += ["", f"### The 0.6B predictor, one frame (15 codes), ms; heads at {p['tokens_per_step_at_32']:.2f} "
                  "tokens/step at N=32", "", "| model | AR | " + " | ".join(f"N={n}" for n in sizes)
                  + " | the policy's choice | AR, 4 rows / 1 | AR, 8 rows / 1 |",
                  "|---|---|" + "---|" * (len(sizes) + 3)]
        for scheme, s in p["schemes"].items():
            lines.append(f"| {scheme} | {s['ms']['ar']:.0f} | " + " | ".join(f"{s['ms'][n]:.0f}" for n in sizes)
                         + f" | {'N=' + str(s['policy_size']) if s['policy_size'] else 'AR'} ({s['policy_ms']:.0f}) | "
                         f"{s['ar_rows_over_one']['4']:.2f}x | {s['ar_rows_over_one']['8']:.2f}x |")
        lines += ["", f"w8a8 AR frame / {p['dtype']} AR frame: **{p['w8a8_ar_over_float_ar']:.2f}**; the w8a8 policy's "
                  f"frame / {p['dtype']} AR frame: **{p['w8a8_policy_over_float_ar']:.2f}**.", ""]
        for scheme, s in p["schemes"].items():
            lines.append(f"- {scheme}: {s['why']}")
        e = r.get("end_to_end")
        if e:
            step = e["talker_step"]
            lines += ["", f"### End to end: {e['frames']} frames, whole utterances, medians of {e['repeats']}", "",
                      "| setting | seconds | real-time factor | predictor s | decoder s | tokens/step |",
                      "|---|---|---|---|---|---|"]
            for setting, row in e["table"].items():
                lines.append(f"| {setting} | {row['seconds']:.2f} | {row['real_time_factor']:.2f} | "
                             f"{row['predictor_seconds']:.2f} | {row['decoder_seconds']:.2f} | "
                             f"{row['tokens_per_step']:.2f} |")
            lines += ["", f"Engine w8a8 (predictor and talker) over the Engine in {e['engine_dtype']}: "
                      f"**{e['w8a8_over_float_engine']:.2f}x**; over upstream's float32 generate_custom_voice: "
                      f"**{e['w8a8_over_upstream']:.2f}x** (the float Engine: {e['float_engine_over_upstream']:.2f}x).",
                      "", "Talker step, one row: " + ", ".join(f"{k} {v:.1f} ms" for k, v in step["ms"].items())
                      + "; of the floor (its weight bytes / copy bandwidth): "
                      + ", ".join(f"{k} {v:.0%}" for k, v in step["of_floor"].items()) + "."]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP + " (the native class only)")
    parser.add_argument("--classes", default=None, help="default: " + ",".join(CLASS_CAPS))
    parser.add_argument("--quick", action="store_true", help="6 predictor frames, 12-frame utterances, 2 repeats")
    parser.add_argument("--frames", type=int, default=None)
    parser.add_argument("--e2e-frames", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--no-end-to-end", action="store_true")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: this process measures its own class into FILE
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    args.frames = args.frames or (1 if args.smoke else 6 if args.quick else 12)
    args.e2e_frames = args.e2e_frames or (3 if args.smoke else 12 if args.quick else 25)
    args.repeats = args.repeats or (1 if args.smoke else 2 if args.quick else 3)
    args.classes = args.classes or ("native" if args.smoke else ",".join(CLASS_CAPS))
    if args.one:
        Path(args.one).write_text(json.dumps(one_class(args)))
        return
    info = machine()
    forwarded = ["--frames", str(args.frames), "--e2e-frames", str(args.e2e_frames), "--repeats", str(args.repeats)] \
        + ["--no-end-to-end"] * args.no_end_to_end + ["--smoke"] * args.smoke
    classes = per_class(__file__, args.classes.split(","), forwarded)
    report = {"classes": classes, "machine": finish_machine(info),
              "command": " ".join([".venv/bin/python benchmarks/int8_cpu.py", *(sys.argv[1:] if argv is None
                                                                                  else argv)])}
    write_reports(report, report_folder(args.out, args.smoke), "int8-cpu", to_markdown)


if __name__ == "__main__":
    main()
