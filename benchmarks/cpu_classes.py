"""Every CPU class this machine can stand in for, measured in one run: natively and under each reachable ISA cap
(`rvqspec.core.cpu_class`), `rvqspec bench --batch` (the policy's latency tables, for bfloat16 and, where the class
runs it, w8a8) and then `rvqspec bench --weights bfloat16,w8a16,w8a8` (AR, speculative and the policy's frames per
scheme, the policy reading the tables just measured as built-in ones). Writes one folder per class under
benchmarks/results/cpu-classes/, the built-in tables (rvqspec/core/latency_default.json, merged) and
benchmarks/results/cpu-classes.md with the class x scheme table.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/cpu_classes.py [--quick] [--threads 1,2]
    python benchmarks/cpu_classes.py --smoke   # seconds: the native class found, the commands printed, not run (each
                                               # a `rvqspec bench`, which the suite runs), the table re-rendered from
                                               # results/cpu-classes.json into a temporary folder

Each class runs in its own processes (the caps are read when torch loads). A capped class is a stand-in for that
class on this CPU: its kernels are the ones the class would use, its memory system and clock are this machine's.
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from rvqspec.bench.batched import latency_entries
from rvqspec.bench.timing import SMOKE_HELP, report_folder
from rvqspec.core import cpu_class
from rvqspec.core.checkpoint import save_json, save_text
from rvqspec.core.policy import DEFAULT_TABLES

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
CAPS = {  # the caps that make an AVX-512 VNNI machine stand in for each class (cpu_class's docstring)
    "native": {},
    "avx512-vnni": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI"},
    "avx512": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
}


def rvqspec(args: list[str], caps: dict) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")}
    print(f"$ {' '.join(f'{k}={v}' for k, v in caps.items())} rvqspec {' '.join(args)}", flush=True)
    subprocess.run([sys.executable, "-m", "rvqspec.cli", *args], env=env | caps | {"OMP_WAIT_POLICY": "PASSIVE"},
                   check=True, cwd=ROOT)


def class_of(caps: dict) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")} | caps
    return subprocess.run([sys.executable, "-c", "from rvqspec.core import cpu_class; print(cpu_class.cpu_class())"],
                          env=env, capture_output=True, text=True, check=True, cwd=ROOT).stdout.strip()


def measure_tables(folder: Path, caps: dict, cls: str, threads: list[int], quick: bool) -> dict:
    """bench --batch for the class's float dtype (bfloat16 where oneDNN has it, else float32: `fastest_float`) and
    w8a8 of it (every x86 class runs w8a8 since rvqspec's AVX2 kernel) at each thread count: the class's tables."""
    dtype, tables = "bfloat16" if cls.startswith(("avx512", "amx")) else "float32", {}
    for weights in [dtype] + (["w8a8"] if cls in cpu_class.NEEDS else []):
        for t in threads:
            out = folder / f"batch-{weights}-{t}t"
            extra = ["--weights", "w8a8"] if weights == "w8a8" else []
            rvqspec(["bench", "--batch", "1,2,4,8,16", "--dtype", dtype, "--threads", str(t), *extra,
                     "--no-device-file", "--out", str(out)] + (["--quick"] if quick else []), caps)
            report = json.loads(next(out.glob("bench-batch*.json")).read_text())
            tables |= latency_entries(report)
    return tables


def smoke(threads: list[int]) -> None:
    """The native class, the commands a run would start, and the table re-rendered from the committed results."""
    cls = class_of(CAPS["native"])
    print(f"native class {cls}; a run would start, per class:")
    print(f"  rvqspec bench --batch 1,2,4,8,16 --threads {threads[0]} --no-device-file --out ...; rvqspec bench "
          f"--weights bfloat16,w8a16,w8a8 --threads {','.join(map(str, threads))} --out ...")
    out = report_folder(RESULTS, smoke=True) / "cpu-classes.md"
    save_text(out, markdown(json.loads((RESULTS / "cpu-classes.json").read_text())))
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    parser.add_argument("--quick", action="store_true", help="the benches' quick settings")
    parser.add_argument("--threads", default="1,2", help="thread counts of the native class (capped: the first)")
    args = parser.parse_args(argv)
    threads = [int(t) for t in args.threads.split(",")]
    if args.smoke:
        return smoke(threads)
    rows = {}
    for name, caps in CAPS.items():
        cls = class_of(caps)
        if name != "native" and cls != name:
            print(f"{name}: this CPU cannot stand in for it (the cap gives {cls}); skipped", flush=True)
            continue
        folder = RESULTS / "cpu-classes" / cls
        tables = measure_tables(folder, caps, cls, threads if name == "native" else threads[:1], args.quick)
        save_json(DEFAULT_TABLES, dict(sorted((json.loads(DEFAULT_TABLES.read_text()) | tables).items())))
        rvqspec(["bench", "--weights", "bfloat16,w8a16,w8a8", "--threads",
                 ",".join(map(str, threads if name == "native" else threads[:1])), "--out", str(folder)]
                + (["--quick"] if args.quick else []), caps)
        rows[cls] = json.loads(next(folder.glob("bench-weights*.json")).read_text()) | {"caps": caps}
    save_json(RESULTS / "cpu-classes.json", rows)
    write_markdown(rows)


def write_markdown(rows: dict) -> None:
    save_text(RESULTS / "cpu-classes.md", markdown(rows))
    print(f"wrote {RESULTS / 'cpu-classes.md'}")


def markdown(rows: dict) -> str:
    lines = ["# Frame times per CPU class", "",
             "`OMP_WAIT_POLICY=PASSIVE python benchmarks/cpu_classes.py`: per class, natively or as a stand-in under "
             "ISA caps on one machine, `rvqspec bench --batch` (the policy's built-in tables) then `rvqspec bench "
             "--weights bfloat16,w8a16,w8a8` (0.6B architecture, random layers, heads at the paper's 2.47 tokens/step "
             "at N = 32; medians of frames interleaved in one run). Ratios are against that class's bfloat16 AR frame "
             "in the same run; spec: the fastest of N = 8, 16, 32; policy: what tree=\"auto\" deploys without a device "
             "file (the class's built-in table).", "",
             "| class | CPU (caps) | threads | weights | AR ms | spec ms (N) | policy | AR / bf16 AR | spec / bf16 AR | "
             "policy / bf16 AR |", "|---|---|---|---|---|---|---|---|---|---|"]
    for cls, report in rows.items():
        cpu = report["machine"]["cpu"] + ("" if report["caps"] else " (native)")  # cpu_class.describe(): caps included
        for threads, schemes in report["by_threads"].items():
            for scheme, r in schemes.items():
                policy = f"N={r['policy_tree_size']}" if r["policy_tree_size"] else "AR"
                lines.append(f"| {cls} | {cpu} | {threads} | {scheme} | "
                             f"{r['ar_frame_ms']:.1f} | {r['spec_frame_ms']:.1f} ({r['spec_tree_size']}) | {policy} | "
                             f"{r['ar_over_bf16_ar']:.2f}x | {r['spec_over_bf16_ar']:.2f}x | "
                             f"{r['policy_over_bf16_ar']:.2f}x |")
        for scheme, why in report.get("skipped", {}).items():
            lines.append(f"| {cls} | | | {scheme} | skipped: {why} | | | | | |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
