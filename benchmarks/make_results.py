"""`python benchmarks/make_results.py`: regenerate docs/RESULTS.md from the measured outputs, next to the paper's figures.

JSON in, Markdown out; nothing is measured here and no figure is typed in by hand except the paper's.
Inputs (a missing one leaves its section saying which command measures it):
- benchmarks/results/eval.json          `rvqspec eval` (Tables 2 and 3, distribution check)
- rvqspec/standin/assets/trees/report.json  `rvqspec calibrate` of the shipped stand-in (predicted vs measured)
- benchmarks/results/bench.json         `rvqspec bench` (latency per N, speedup(N), chosen N,
                                        acceptance-controlled real-size runs, the Figure-4 plot)
- benchmarks/results/standin/bench.json `rvqspec bench` of the stand-in alone, at its own calibrated
                                        acceptance (STANDIN_BENCH below)
- benchmarks/results/round-profile.md   benchmarks/round_profile.py (where a round's time goes)
- benchmarks/results/bench-batch.json   `rvqspec bench --batch` (batched decoding: the policy vs batched AR
                                        and upstream); gpu/bench-batch.json the same on a lent GPU
                                        (benchmarks/gpu_check.sh)
"""

import json
import os
import re
import sys
from pathlib import Path

from rvqspec.cli import flags
from rvqspec.cli.main import Parser, UsageError, one_line
from rvqspec.core.checkpoint import relative_path, save_text
from rvqspec.core.errors import RvqspecError
from rvqspec.core.policy import report_size

RESULTS_DIR = Path("benchmarks/results")
OUT = Path("docs/RESULTS.md")
COMMAND = "python benchmarks/make_results.py"
STANDIN_BENCH = ("OMP_WAIT_POLICY=PASSIVE nice -n 10 rvqspec bench --archs '' --model rvqspec/standin/assets/model "
                 "--calibration rvqspec/standin/assets/trees --out benchmarks/results/standin --no-device-file "
                 "--rounds 200")
PROFILE = "OMP_WAIT_POLICY=PASSIVE python benchmarks/round_profile.py"

# Figure 4 and section 3.4 of the paper (Qwen3-TTS 0.6B, Apple Neural Engine, W8A16).
PAPER_DEVICES = [  # device, chosen N, speedup there, AR call ms, verify overhead at N = 32
    ("iPhone 17 Pro Max", 32, 2.34, 2.05, 0.053),
    ("MacBook M3 Pro", 32, 2.13, 2.2, 0.136),
    ("iPhone 12", 16, 1.82, None, None),
]


def read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise RvqspecError(f"{path} is not valid JSON ({e}): rerun the command that writes it") from None


def read_text(path: Path) -> str | None:
    return path.read_text() if path.is_file() else None


def without_title(markdown_text: str, depth: int = 3) -> str:
    """A report's Markdown without its `# title` line, to nest it under a section here: its `## ` headings become
    `depth` levels deep (3 under a `## ` section, 4 under a `### ` one) and the deeper ones follow, so that every
    benchmark stays one section of RESULTS.md."""
    lines, fenced = markdown_text.split("\n", 2)[2].strip().split("\n"), False
    for i, line in enumerate(lines):
        fenced ^= line.startswith("```")
        if not fenced and (heading := re.match(r"(#{2,}) ", line)):
            lines[i] = "#" * (len(heading.group(1)) - 2 + depth) + line[len(heading.group(1)):]
    return "\n".join(lines)


def not_measured(command: str) -> str:
    return f"Not yet measured: run `{command}`."


# ---------------------------------------------------------------- sections


def eval_sections(report: dict | None) -> list[str]:
    from rvqspec.standin.evaluate import (PAPER_TABLE2, PAPER_TABLE3, distribution_markdown, table2_markdown,
                                          table3_markdown)

    if report is None:
        missing = not_measured("nice -n 10 rvqspec eval")
        table2 = "Paper: " + "; ".join(f"{name} {row['tokens_per_step']:.2f} tokens/step, {row['added_parameters']} "
                                       "added parameters" for name, row in PAPER_TABLE2.items()) + "."
        table3 = "Paper (speculative tokens/step, AR WER %, speculative WER %): " + "; ".join(
            f"{lang} {tps}, {ar}, {spec}" for lang, (tps, ar, spec) in PAPER_TABLE3.items()) + "."
        return ["## Table 2: drafters (tokens/step, added parameters)", "", table2, "", missing, "",
                "## Table 3: per language, AR vs speculative", "", table3, "", missing, "",
                "## Distribution check on real decoding", "", missing]
    return ["## Table 2: drafters (tokens/step, added parameters)", "",
            f"Stand-in model `{relative_path(report.get('model', '?'))}`, free-running synthesis of the held-out test sentences "
            f"({report['sampler']}). From `{report.get('command', 'rvqspec eval')}`.", "", table2_markdown(report), "",
            "## Table 3: per language, AR vs speculative", "", table3_markdown(report), "",
            "## Distribution check on real decoding", "",
            "Per codebook, the histograms of the codes of AR and speculative synthesis over the test set (not the "
            "codes themselves: a free-running talker makes every run diverge). Chi-square test of the 2 x K table; "
            "the verdict uses permutation p-values that swap the AR/speculative labels of whole utterances (frames "
            "of one utterance are dependent), Holm-corrected over the codebooks. The paper reports WER parity only.",
            "", distribution_markdown(report)]


def calibration_section(report: dict | None, path: Path) -> list[str]:
    from rvqspec.bench.controlled import PAPER_ACCEPTANCE

    lines = ["## Calibration: predicted vs measured tokens/step per tree size N", ""]
    if report is None:
        return lines + ["Paper (Figure 4): " + ", ".join(f"{a:.2f} at N = {n}" for n, a in PAPER_ACCEPTANCE.items())
                        + " tokens/step.", "", not_measured("rvqspec standin build --from calibrate --to calibrate")]
    lines += [f"Drafter `{report['drafter']['kind']}`, acceptance from {report['frames']} free-running frames, "
              f"measured on {report['eval_frames']} held-out frames (`{path}`). Predicted: the expected calls per "
              "frame from the per-position acceptance. Paper: the acceptance curve of Figure 4.", "",
              "| N | depth | predicted tokens/step | measured tokens/step | measured calls/frame | paper tokens/step |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {report_size(t)} | {t['depth']} | {t['predicted_tokens_per_step']:.3f} | "
              f"{t['measured_tokens_per_step']:.3f} | {t['measured_calls_per_frame']:.2f} | "
              f"{PAPER_ACCEPTANCE.get(report_size(t), '-')} |" for t in report["trees"]]
    top1 = report.get("target_top1")
    if top1:
        lines += ["", "Why the stand-in accepts fewer drafts: the mean top-1 probability of its target distribution "
                  "per codebook c1..c15 is " + ", ".join(f"{p:.2f}" for p in top1) + "."]
    return lines


def int_keys(obj):
    """JSON turns bench's int tree sizes into string keys; turn digit keys back into ints (recursively)."""
    if isinstance(obj, dict):
        return {int(k) if isinstance(k, str) and k.isdigit() else k: int_keys(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [int_keys(v) for v in obj]
    return obj


def paper_rows(sizes: list[int]) -> list[str]:
    """The paper's per-device figures in the columns of `sizes` (only what section 3.4 states)."""
    rows = []
    for device, n, speedup, ar_ms, overhead in PAPER_DEVICES:
        cells = {n: f"{f'{overhead:+.1%} -> ' if overhead is not None else ''}{speedup:.2f}x"}
        if device == "iPhone 12":
            cells[64] = "1.21x"
        rows.append(f"| paper: {device} (ANE, W8A16) | {ar_ms if ar_ms else '-'} | "
                    + " | ".join(cells.get(size, "") for size in sizes) + " |")
    return rows


def bench_section(bench: dict | None, bench_dir: Path, out: Path) -> list[str]:
    from rvqspec.bench.controlled import PAPER_ACCEPTANCE
    from rvqspec.bench.report import markdown, setting_name

    lines = ["## Latency per call, speed-up vs tree size N, chosen N (Figure 4)", ""]
    if bench is None:
        return lines + ["Paper (Apple Neural Engine): " + "; ".join(
            f"{device}: {speedup:.2f}x at N = {n}" for device, n, speedup, _, _ in PAPER_DEVICES) + ".", "",
            not_measured("OMP_WAIT_POLICY=PASSIVE nice -n 10 rvqspec bench")]
    bench = int_keys(bench)
    sizes, tokens = bench["plan"]["sizes"], bench["tokens_per_step_by_size"]
    lines += ["Verify overhead t(N)/t(AR) - 1 and predicted speed-up tokens/step / (1 + overhead), ours per setting "
              "(random-weight real architectures and the stand-in, this CPU) beside the paper's per device "
              "(Apple Neural Engine). Tokens/step used for ours: " + bench["tokens_per_step_source"] + ".", "",
              "| setting | AR call ms | " + " | ".join(f"N={n}" for n in sizes) + " |",
              "|---|---|" + "---|" * len(sizes),
              "| paper tokens/step | | " + " | ".join(f"{PAPER_ACCEPTANCE[n]:.2f}" if n in PAPER_ACCEPTANCE else ""
                                                   for n in sizes) + " |",
              "| our tokens/step | | " + " | ".join(f"{tokens[n]:.2f}" if n in tokens else "" for n in sizes) + " |",
              *paper_rows(sizes)]
    for s in bench["settings"]:
        latency, speedup = s["latency"], s["predicted_speedup"]
        lines.append(f"| ours: {setting_name(s)} | {latency['ar']['wall_ms']:.2f} | " + " | ".join(
            f"{latency['spec'][n]['overhead']:+.0%}" + (f" -> {speedup[n]:.2f}x" if n in speedup else "")
            for n in sizes) + " |")
    lines += ["", "Chosen N and realized speed-ups, ours beside the paper's:", "",
              "| | N | tokens/step | speed-up |", "|---|---|---|---|"]
    lines += [f"| paper: {device} (chosen N) | {n} | {PAPER_ACCEPTANCE[n]:.2f} | {speedup:.2f}x (on device) |"
              for device, n, speedup, _, _ in PAPER_DEVICES]
    chosen, paper_run = bench.get("chosen"), bench.get("paper_acceptance")
    if chosen:
        lines.append(f"| ours: chosen for this CPU ({chosen['model']}, {chosen['dtype']}, {chosen['threads']} "
                     f"thread(s)) | {chosen['tree_size']} | {chosen['tokens_per_step']:.2f} | "
                     f"{chosen['predicted_speedup']:.2f}x (predicted) |")
    if paper_run:
        lines.append(f"| ours: {paper_run['model']}, best setting ({paper_run['dtype']}, {paper_run['threads']} "
                     f"thread(s)) | {paper_run['tree_size']} | {paper_run['tokens_per_step']:.2f} | "
                     f"{paper_run['speedup']:.2f}x realized ({paper_run['predicted_speedup']:.2f}x predicted) |")
    for s in bench["settings"]:
        if s.get("stand_in"):
            r = s["stand_in"]
            lines.append(f"| ours: stand-in ({setting_name(s)}) | {r['tree_size']} | {r['tokens_per_step']:.2f} | "
                         f"{r['realized_speedup']:.2f}x realized (ceiling {r['ceiling']:.2f}x) |")
    figure = bench_dir / "bench.png"
    if figure.is_file():
        lines += ["", f"![Figure 4 style: verify overhead and speed-up vs tree size]({link(figure, out)})"]
    return lines + ["", "### Details from `rvqspec bench`", "", without_title(markdown(bench), 4)]


def batch_section(reports: dict[str, dict | None], results_dir: Path, out: Path) -> list[str]:
    """Batched decoding: the policy's frames/s over our batched AR and over upstream's batched generate, per B."""
    from rvqspec.bench.report import batch_markdown, markdown

    lines = ["## Batched decoding: the decoding policy against batched AR", ""]
    measured = {where: report for where, report in reports.items() if report}
    if not measured:
        return lines + [not_measured("OMP_WAIT_POLICY=PASSIVE rvqspec bench --batch 1,2,4,8,16")]
    lines += ["Frames per second of a batch of B frames (15 codes per row), the real 0.6B architecture at the paper's "
              "acceptance (acceptance-controlled heads): the policy's choice (N, or AR) over our batched AR, and over "
              "upstream qwen-tts's batched `code_predictor.generate` on the same weights where it was installed. "
              "Targets: policy / AR >= 1.0 at every B, policy >= upstream, >= 1.7 at B = 1.", "",
              "| where | setting | " + " | ".join(f"B={b}" for b in (1, 2, 4, 8, 16)) + " | switches to AR at |",
              "|---|---|" + "---|" * 6]
    for where, report in measured.items():
        for setting in report["settings"]:
            cells = {}
            for r in setting["frames"]:
                choice = f"N={r['tree_size']}" if r["tree_size"] else "AR"
                versus = f", {r['policy_over_upstream']:.2f}x upstream" if r["policy_over_upstream"] else ""
                cells[r["batch"]] = f"{r['policy_over_ar']:.2f}x ({choice}{versus})"
            lines.append(f"| {where} | {setting['dtype']} {setting['threads']}t | " +
                         " | ".join(cells.get(b, "") for b in (1, 2, 4, 8, 16)) +
                         f" | {setting['switch_to_ar_at'] or 'never'} |")
    gpu_bench = read_json(results_dir / "gpu" / "bench.json")
    if gpu_bench:
        lines += ["", "### GPU (H200): one stream, `rvqspec bench` (benchmarks/gpu_check.sh)", "",
                  without_title(markdown(int_keys(gpu_bench)), 4)]
    for where, report in measured.items():
        folder = results_dir if where == "CPU" else results_dir / "gpu"
        figure = folder / "bench-batch.png"
        lines += ["", f"### {where}: details from `{report.get('command', 'rvqspec bench --batch')}`", ""]
        if figure.is_file():
            lines += [f"![frames/s against batch size]({link(figure, out)})", ""]
        lines.append(without_title(batch_markdown(report), 4))
    return lines


def standin_bench_section(bench: dict | None, bench_dir: Path, out: Path) -> list[str]:
    """The stand-in's own bench run: its calls are tiny, so this shows how far per-round overhead eats the
    calls it saves (realized inner-loop speed-up beside the ceiling tokens/step / (1 + overhead))."""
    from rvqspec.bench.report import markdown

    lines = ["## The stand-in on this CPU: inner-loop speed-up at its own acceptance", ""]
    if bench is None:
        return lines + [not_measured(STANDIN_BENCH)]
    figure = bench_dir / "bench.png"
    plot = [f"![stand-in: verify overhead and speed-up vs tree size]({link(figure, out)})", ""] if figure.is_file() \
        else []
    return lines + [f"From `{STANDIN_BENCH}`.", "", *plot, without_title(markdown(int_keys(bench)))]


CSM_BENCH = "OMP_WAIT_POLICY=PASSIVE rvqspec bench --archs 0.6b,csm-1b --dtype bfloat16 --out benchmarks/results/csm"


def csm_section(csm_dir: Path) -> list[str]:
    """Sesame CSM-1B's depth decoder (31 calls per frame) beside the 0.6B: one stream, batched, draft depth K."""
    from rvqspec.bench.report import batch_markdown, markdown

    lines = ["## Sesame CSM-1B's depth decoder (31 calls per frame), beside Qwen3-TTS 0.6B", ""]
    bench, batch = read_json(csm_dir / "bench.json"), read_json(csm_dir / "bench-batch.json")
    depth = read_text(csm_dir / "draft-depth.md")
    if not (bench or batch or depth):
        return lines + [not_measured(CSM_BENCH)]
    lines += ["The real CSM-1B depth-decoder architecture (random layers) with its heads' acceptance set to the drafts "
              "accepted per round that the 0.6B shows at the paper's tokens/step (the same drafts; a frame of 31 "
              "codes instead of 15, so fewer rounds are cut short by the frame end).", ""]
    if bench:
        lines += ["### One stream", "", without_title(markdown(int_keys(bench)), 4), ""]
    if batch:
        lines += ["### Batched", "", without_title(batch_markdown(batch), 4), ""]
    if depth:
        lines += ["### Draft depth K", "", without_title(depth, 4)]
    return lines


FUSED = "OMP_WAIT_POLICY=PASSIVE python benchmarks/fused_path.py --frames 32 --sizes 16,32"


def profile_section(profile_markdown: str | None, fused_markdown: str | None) -> list[str]:
    """The CPU fast path before/after (fused-path.md) and where a speculative round's time goes next to an AR step
    (round-profile.md), both without their titles; the analysis is docs/cpu-fast-path.md, written by hand."""
    lines = ["## The CPU fast path, and where a round's time goes", "",
             "Where a frame's time goes on a CPU and why the kernels are built as they are: "
             "[cpu-fast-path.md](cpu-fast-path.md).", "",
             "### Before and after, same run", ""]
    lines += [without_title(fused_markdown, 4) if fused_markdown else not_measured(FUSED), "",
              "### Where a round's time goes", ""]
    return lines + [without_title(profile_markdown, 4) if profile_markdown else not_measured(PROFILE)]


WEIGHTS = "OMP_WAIT_POLICY=PASSIVE rvqspec bench --weights bfloat16,w8a16,w8a8 --threads 1,2"
QUALITY = "OMP_WAIT_POLICY=PASSIVE python benchmarks/quantization_quality.py"


TALKER = "OMP_WAIT_POLICY=PASSIVE python benchmarks/talker_weights.py"
THREADS = "python benchmarks/threads.py"
INT4 = "python benchmarks/int4_probe.py"


def weights_section(bench_dir: Path) -> list[str]:
    """Quantized weights (bench-weights, quantization-quality, talker-weights, threads, int4-probe), without their
    titles."""
    lines = ["## Quantized weights (W8A16, W8A8)", "",
             "A quantized model is a different model: speculation is exact relative to it, and its distance from the "
             "bfloat16 model is measured below."]
    for title, name, command in (("Frame times per scheme", "bench-weights.md", WEIGHTS),
                                 ("Distance from the bfloat16 model", "quantization-quality.md", QUALITY),
                                 ("The talker with int8 weights (opt-in)", "talker-weights.md", TALKER),
                                 ("Threads and OpenMP's waiting", "threads.md", THREADS),
                                 ("A 4-bit scheme?", "int4-probe.md", INT4)):
        report = read_text(bench_dir / name)
        lines += ["", f"### {title}", "", without_title(report, 4) if report else not_measured(command)]
    return lines


CPU_CLASSES = "OMP_WAIT_POLICY=PASSIVE python benchmarks/cpu_classes.py"


def cpu_classes_section(bench_dir: Path) -> list[str]:
    """Frame times per CPU class (cpu-classes.md), without its title."""
    report = read_text(bench_dir / "cpu-classes.md")
    return ["## CPU classes: each class's kernels, tables and frame times", "",
            "The sections after this one were measured on an Intel Xeon with AMX (class amx) unless they say "
            "otherwise; this one measures every class the development machine reaches natively or under ISA caps.",
            "", without_title(report) if report else not_measured(CPU_CLASSES)]


INT8_CPU = "OMP_WAIT_POLICY=PASSIVE python benchmarks/int8_cpu.py"


def int8_cpu_section(bench_dir: Path) -> list[str]:
    """int8 weights per class, natively and under the AVX2 caps (int8-cpu.md), without its title."""
    report = read_text(bench_dir / "int8-cpu.md")
    return ["## int8 on every x86 class: rvqspec's AVX2 kernel, the memory floor, end to end", "",
            without_title(report) if report else not_measured(INT8_CPU)]


END_TO_END = "python benchmarks/end_to_end.py"
TUNE = "python benchmarks/tune_standin.py"


def end_to_end_section(bench_dir: Path) -> list[str]:
    """A whole generate call, streamed and not (end-to-end.md; at the 1.7B sizes end-to-end-1.7b.md), without its
    title."""
    report, large = read_text(bench_dir / "end-to-end.md"), read_text(bench_dir / "end-to-end-1.7b.md")
    return ["## End to end and streaming: a whole qwen-tts call at the 0.6B sizes", "",
            without_title(report) if report else not_measured(END_TO_END), "",
            "### At the 1.7B sizes (a talker of width 2048)", "",
            without_title(large, 4) if large else not_measured(f"{END_TO_END} --size 1.7b")]


SERVE_LOAD = "python benchmarks/serve_load.py"


def serve_section(bench_dir: Path) -> list[str]:
    """`rvqspec serve` under concurrent streaming clients (serve-load.md, serve-load-0.6b.md), without their titles."""
    standin, real_size = read_text(bench_dir / "serve-load.md"), read_text(bench_dir / "serve-load-0.6b.md")
    return ["## Serving over HTTP: concurrent streaming clients", "",
            "Each request's audio is made from its codes in the engine's codec workers (the stand-in: HiFi-GAN with "
            "context frames on both sides of each chunk; the 0.6B table below predates them: its audio was made in "
            "the server's request threads); where that costs more than decoding, audio s/s follows the vocoder and "
            "frames/s shows what the engine's batching does.", "", "### The stand-in", "",
            without_title(standin, 4) if standin else not_measured(SERVE_LOAD), "",
            "### qwen-tts at the 0.6B sizes (random weights)", "",
            without_title(real_size, 4) if real_size else not_measured(f"{SERVE_LOAD} --model 0.6b")]


CONCURRENCY = "python benchmarks/concurrency.py"
CONCURRENCY_REPORTS = [  # (heading, report, the command that writes it)
    ("Many requests against one at a time: the tiny qwen-tts", "concurrency.md", CONCURRENCY),
    ("Many requests against one at a time: the stand-in", "concurrency-standin.md",
     f"{CONCURRENCY} --models standin --requests 1,2,4,8 --repeats 2 --name concurrency-standin"),
    ("Many requests against one at a time: qwen-tts at the 0.6B sizes", "concurrency-0.6b.md",
     f"{CONCURRENCY} --models 0.6b --cores 1 --requests 1,4 --name concurrency-0.6b"),
    ("A codec on a batch of chunks, or on each in turn", "codec-batch.md", "python benchmarks/codec_batch.py"),
    ("The streaming 12 Hz codecs of several requests in one call (float32)", "codec-batch-streaming.md",
     "python benchmarks/codec_batch.py --streaming"),
    ("The streaming 12 Hz codecs of several requests in one call (bfloat16)", "codec-batch-streaming-bfloat16.md",
     "python benchmarks/codec_batch.py --streaming --dtype bfloat16"),
    ("Chunked prefill: a running stream's gaps while requests arrive", "prefill-gap.md",
     "python benchmarks/prefill_gap.py"),
    ("A generator per row: the draws' cost", "row-draws.md", "python benchmarks/row_draws.py"),
    ("Admission's prior against measured frame steps", "capacity-prior.md", "python benchmarks/capacity_prior.py"),
    ("A frame step before and after issue 43's changes", "frame-step.md",
     "python benchmarks/frame_step.py --rounds 10 --frames 60")]


def concurrency_section(bench_dir: Path) -> list[str]:
    """Issue 40's reports (the thread budget, codec workers, chunked prefill, per-row seeds), without their titles."""
    return reports_section(bench_dir, "Concurrency",
                           "The thread budget (rvqspec/runtime/threads.py) and the codec workers "
                           "(runtime/codec_worker.py) against decoding one request at a time; whether a codec gains "
                           "from batching; chunked prefill; per-row draws; admission's prior; a frame step's cost "
                           "across the house's changes.", CONCURRENCY_REPORTS)


def reports_section(bench_dir: Path, title: str, intro: str, reports: list[tuple[str, str, str]]) -> list[str]:
    """A section of whole reports, each under its own heading (or the command that writes it, where not measured)."""
    lines = [f"## {title}", "", intro]
    for heading, name, command in reports:
        text = read_text(bench_dir / name)
        lines += ["", f"### {heading}", "", without_title(text, 4) if text else not_measured(command)]
    return lines


REAL_TIME_REPORTS = [  # issue 51: every part of the frame at its floor, two cores
    ("One stream on one and two cores", "two-cores.md",
     "OMP_WAIT_POLICY=PASSIVE python benchmarks/two_cores.py --frames 42 --repeats 3"),
    ("One stream on one and two cores, 10 s of audio", "two-cores-125-frames.md",
     "OMP_WAIT_POLICY=PASSIVE python benchmarks/two_cores.py --frames 125 --repeats 2"),
    ("The decoder beside the frame loop: GIL or machine", "codec-beside.md",
     "OMP_WAIT_POLICY=PASSIVE python benchmarks/codec_beside.py --frames 42 --repeats 3"),
    ("int8 matmuls per call against the memory floor", "int8-calls.md",
     "OMP_WAIT_POLICY=PASSIVE python benchmarks/int8_calls.py --rounds 7"),
    ("Resident memory of an Engine, bfloat16 and int8, 0.6B and 1.7B", "memory.md",
     "python benchmarks/memory.py --base 30997a6"),
    ("The speculative predictor frame (w8a8, 0.6B, 1 thread), split, before and after its glue was cut",
     "predictor-frame.md", "python benchmarks/predictor_frame.py --rounds 5 --frames 30"),
    ("The same frame's glue alone (the 0.6B predictor's layers at a tiny width)", "predictor-frame-tiny.md",
     "python benchmarks/predictor_frame.py --tiny --rounds 5 --frames 30"),
    ("bfloat16: a verify call of N rows against the one-row call", "bf16-rows.md",
     "OMP_WAIT_POLICY=PASSIVE python benchmarks/bf16_rows.py --frames 12"),
    ("The streamed 12 Hz decoder against a whole-utterance decode", "decoder-stream.md",
     "python benchmarks/decoder_stream.py --frames 24 --chunks 1,3,12 --repeats 3"),
    ("Speculative int8 rounds against AR, bit for bit (avx512-vnni-bf16)", "exact-rounds-avx512-vnni-bf16.md",
     "python benchmarks/exact_rounds.py"),
    ("Speculative int8 rounds against AR, bit for bit (avx2, capped)", "exact-rounds-avx2.md",
     "ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 python benchmarks/exact_rounds.py"),
    ("Attention in position order against SDPA (avx512-vnni-bf16)", "ordered-attention-avx512-vnni-bf16.md",
     "python benchmarks/ordered_attention.py"),
    ("Attention in position order against SDPA (avx2, capped)", "ordered-attention-avx2.md",
     "ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 python benchmarks/ordered_attention.py")]
LIVE_REPORTS = [  # issues 52 and 54
    ("Text streamed in as an LLM writes it", "live-speech.md",
     "python benchmarks/live_speech.py --frames 30 --repeats 3"),
    ("The WebSocket against the HTTP route, and sentence mode", "live-serve.md", "python benchmarks/live_serve.py"),
    ("The stand-in's speech rate and the frame budget", "speech-rate.md", "python benchmarks/speech_rate.py --seeds 3")]


def tune_section(bench_dir: Path) -> list[str]:
    """`rvqspec tune` on the stand-in (tune/tune-standin.md), without its title."""
    report = read_text(bench_dir / "tune" / "tune-standin.md")
    return ["## rvqspec tune: drafters from the model's own speech (the stand-in)", "",
            without_title(report) if report else not_measured(TUNE)]


def results_markdown(eval_report: dict | None, calibration: dict | None, calibration_path: Path,
                     bench: dict | None, bench_dir: Path, out: Path, standin_bench: dict | None = None,
                     profile_markdown: str | None = None, batch: dict[str, dict | None] | None = None) -> str:
    sections = "\n".join([
        *cpu_classes_section(bench_dir), "", *int8_cpu_section(bench_dir), "",
        *eval_sections(eval_report), "",
        *calibration_section(calibration, calibration_path), "",
        *bench_section(bench, bench_dir, out), "", *batch_section(batch or {}, bench_dir, out), "",
        *csm_section(bench_dir / "csm"), "",
        *profile_section(profile_markdown, read_text(bench_dir / "fused-path.md")), "",
        *weights_section(bench_dir), "", *end_to_end_section(bench_dir), "", *serve_section(bench_dir), "",
        *concurrency_section(bench_dir), "",
        *reports_section(bench_dir, "Real time on small CPUs", "Issue 51: the Engine's one stream on one and two "
                         "cores, each part of the frame against its floor, and int8 rounds bit for bit.",
                         REAL_TIME_REPORTS), "",
        *reports_section(bench_dir, "Live speech and frame budgets", "Issues 52 and 54: text that arrives over "
                         "time, and the default frame budget of a text.", LIVE_REPORTS), "",
        *tune_section(bench_dir), "",
        *standin_bench_section(standin_bench, bench_dir / "standin", out), ""])
    return "\n".join([
        "# Results", "",
        f"Generated by `{COMMAND}` from the JSON written by `rvqspec eval`, `rvqspec bench` and `rvqspec calibrate` "
        "(the stand-in's shipped calibration); do not edit by hand. Every figure is measured on this project's "
        "2-core CPU machine unless marked as the paper's.", "",
        "The paper's figures are for Qwen3-TTS 0.6B with trained weights (Fleurs, Apple devices). Ours are for the "
        "stand-in (a small model trained here on CPU, far less confident than the real one, hence its lower "
        "acceptance) and for the real 0.6B/1.7B architectures with random weights (latency), see docs/design.md, section 5.",
        "", *summary(sections), "", sections])


CPUS = {"Intel(R) Xeon(R) Processor": "Intel Xeon", "AMD EPYC": "AMD EPYC", "H200": "NVIDIA H200 (GPU)"}
CPU_CLASS = re.compile(r"(Intel\(R\) Xeon\(R\) Processor|AMD EPYC): ([a-z0-9-]+)( \(capped)?")  # as the reports name it


def summary(sections: str) -> list[str]:
    """The table at the top: one row per section (a link to it) and the machines and CPU classes its reports name
    ("capped": the class stood in for under ISA caps on that machine)."""
    lines = ["| section | measured on: CPU, class |", "|---|---|"]
    for section in re.split(r"^(?=## )", sections, flags=re.M)[1:]:
        title = section.split("\n", 1)[0][3:]
        lines.append(f"| [{title}](#{anchor(title)}) | {measured_on(section)} |")
    return lines


def measured_on(text: str) -> str:
    """'Intel Xeon: amx, avx2 (capped); AMD EPYC: ...' from the machine lines the reports write."""
    classes: dict[str, list[str]] = {CPUS[key]: [] for key in CPUS if key in text}
    for cpu, cls, capped in CPU_CLASS.findall(text):
        named = cls + (" (capped)" if capped else "")
        if named not in classes[CPUS[cpu]]:
            classes[CPUS[cpu]].append(named)
    if not classes:
        return "not yet measured" if "Not yet measured" in text else "not named in the report"
    return "; ".join(cpu + (": " + ", ".join(names) if names else "") for cpu, names in classes.items())


def anchor(title: str) -> str:
    """The link target GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def regenerate(results_dir: Path = RESULTS_DIR, calibration_path: Path | None = None, out: Path = OUT) -> str:
    from rvqspec.standin.settings import TREES_DIR

    calibration_path = calibration_path or TREES_DIR / "report.json"
    try:
        text = results_markdown(read_json(results_dir / "eval.json"), read_json(calibration_path),
                                relative_path(calibration_path), read_json(results_dir / "bench.json"), results_dir,
                                out, read_json(results_dir / "standin" / "bench.json"),
                                read_text(results_dir / "round-profile.md"),
                                {"CPU": read_json(results_dir / "bench-batch.json"),
                                 "GPU (H200)": read_json(results_dir / "gpu" / "bench-batch.json")})
    except (KeyError, TypeError, IndexError, AttributeError) as e:  # nothing is written: `out` stays as it was
        raise RvqspecError(f"a report in {results_dir} (or {calibration_path}) is not one that rvqspec eval, bench or "
                           f"calibrate wrote ({type(e).__name__}: {e}): rerun the command that writes it") from None
    save_text(out, text)
    return text


def link(target: Path, markdown_file: Path) -> str:
    """The relative link from `markdown_file` to `target`."""
    return Path(os.path.relpath(Path(target).resolve(), Path(markdown_file).resolve().parent)).as_posix()


def main(argv: list[str] | None = None) -> int:
    """A repository tool, not an rvqspec command: it reads this checkout's benchmarks/results/ and writes its docs/."""
    parser = Parser(prog="make_results.py", description=__doc__.splitlines()[0])  # a bad flag: one line, exit 2
    parser.add_argument("--results", default=str(RESULTS_DIR), help="folder holding eval.json and bench.json")
    parser.add_argument("--calibration", help="calibration report.json (default: the shipped stand-in's)")
    parser.add_argument("--out", type=flags.out_file, default=str(OUT), help="the Markdown file to write")
    try:
        args = parser.parse_args(argv)
        if not Path(args.results).is_dir():
            raise RvqspecError(f"--results {args.results} is not a folder: pass the folder holding eval.json and "
                               "bench.json (default benchmarks/results)")
        if args.calibration and not Path(args.calibration).is_file():
            raise RvqspecError(f"--calibration {args.calibration} does not exist: pass a calibration report.json")
        regenerate(Path(args.results), Path(args.calibration) if args.calibration else None, Path(args.out))
    except UsageError as e:
        print(e, file=sys.stderr)
        return 2
    except RvqspecError as e:
        print(one_line(f"make_results.py: error: {e}"), file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
