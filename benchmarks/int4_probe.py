"""Would a 4-bit scheme pay? torch's CPU int4 weight-only kernel (`torch._weight_int4pack_mm_for_cpu`, what torchao's
`Int4WeightOnlyConfig` with its CPU layout calls) beside our kernels, on one [M, 1024] x [1024, 3072] matmul (a
predictor MLP's shape): M = 1 (an AR step) and M = 33 (a verify call at N = 32), 1 thread, interleaved, medians.
(torchao's 8-bit-activation, 4-bit-weight kernel is KleidiAI's, for Arm CPUs only.)

    .venv/bin/python benchmarks/int4_probe.py   # -> benchmarks/results/int4-probe.{json,md}
    .venv/bin/python benchmarks/int4_probe.py --smoke   # 10 calls: seconds, a temporary folder
"""

import argparse
import statistics
import time
from pathlib import Path

import torch

from rvqspec.bench.timing import SMOKE_HELP, finish_machine, machine, machine_text, report_folder, write_reports
from rvqspec.core.packing import Linear
from rvqspec.core.quantize import Int8Matmul

RESULTS = Path(__file__).resolve().parent / "results"
OUT_FEATURES, IN_FEATURES = 3072, 1024


def int4_matmul(weight: torch.Tensor, group: int):
    """Asymmetric 4-bit weights, one scale and zero per `group` inputs (torchao's int4 weight-only scheme)."""
    rows, cols = weight.shape
    grouped = weight.float().view(rows, cols // group, group)
    low, high = grouped.amin(-1, keepdim=True), grouped.amax(-1, keepdim=True)
    scale = ((high - low) / 15).clamp(min=1e-6)
    q = ((grouped - low) / scale).round().clamp(0, 15).to(torch.int32).view(rows, cols)
    packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
    scales_zeros = torch.stack([scale.view(rows, -1).t(), (low + 8 * scale).view(rows, -1).t()], -1)
    scales_zeros = scales_zeros.contiguous().to(torch.bfloat16)
    return lambda x: torch._weight_int4pack_mm_for_cpu(x, packed, group, scales_zeros)


def measure(calls: int) -> dict:
    torch.manual_seed(0)
    linear = Linear(IN_FEATURES, OUT_FEATURES, bias=False).to(torch.bfloat16).requires_grad_(False)
    kernels = {"bfloat16 (packed)": linear, "w8a16": Int8Matmul(linear.weight, "w8a16"),
               "w8a8": Int8Matmul(linear.weight, "w8a8"), "int4 g32": int4_matmul(linear.weight, 32),
               "int4 g128": int4_matmul(linear.weight, 128)}
    out = {}
    for rows in (1, 33):
        x = torch.randn(rows, IN_FEATURES, dtype=torch.bfloat16)
        reference = x.float() @ linear.weight.float().t()
        times = {name: [] for name in kernels}
        with torch.inference_mode():
            for i in range(calls + calls // 10):  # the first tenth warms up
                for name, kernel in kernels.items():
                    start = time.perf_counter()
                    kernel(x)
                    if i >= calls // 10:
                        times[name].append(time.perf_counter() - start)
            out[f"M={rows}"] = {name: {"ms": 1e3 * statistics.median(times[name]), "relative_error": float(
                (kernel(x).float() - reference).norm() / reference.norm())} for name, kernel in kernels.items()}
    return out


def markdown(report: dict) -> str:
    lines = ["# A 4-bit scheme?", "", f"`python benchmarks/int4_probe.py`: {machine_text(report['machine'])}. One "
             f"[M, {IN_FEATURES}] x [{IN_FEATURES}, {OUT_FEATURES}] matmul, 1 thread, medians of {report['calls']} "
             "interleaved calls; error: |out - float32 product| / |float32 product|.", "",
             "| kernel | M=1 ms | M=33 ms | M=1 error |", "|---|---|---|---|"]
    one, many = report["kernels"]["M=1"], report["kernels"]["M=33"]
    lines += [f"| {name} | {one[name]['ms']:.3f} | {many[name]['ms']:.3f} | {one[name]['relative_error']:.4f} |"
              for name in one]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    parser.add_argument("--calls", type=int, default=None, help="default 300 (--smoke: 10)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    args.calls = args.calls or (10 if args.smoke else 300)
    torch.set_num_threads(1)
    info = machine()
    report = {"calls": args.calls, "kernels": measure(args.calls)}
    report["machine"] = finish_machine(info)
    write_reports(report, report_folder(args.out, args.smoke), "int4-probe", markdown)
    print(markdown(report))


if __name__ == "__main__":
    main()
