"""Why `rvqspec.core.packing.linear` prepacks large weights for oneDNN: F.linear vs the packed path, per row count.

    python benchmarks/packed_linear.py [--threads 1] [--rounds 30]
    python benchmarks/packed_linear.py --smoke   # 2 rounds: seconds

One 0.6B MLP weight (6144 x 1024) at the row counts decoding uses (AR: 1, speculative: N+1), interleaved,
median CPU time per call. Prints a Markdown table.
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from rvqspec.bench.timing import SMOKE_HELP
from rvqspec.core.packing import PACK_ROWS_HINT

ROWS = (1, 5, 17, 33, 65)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP + " (this script prints, writes nothing)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=None, help="default 30 (--smoke: 2)")
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (2 if args.smoke else 30)
    torch.set_num_threads(args.threads)
    print("| dtype | rows | F.linear ms | packed ms | packed speed-up |\n|---|---|---|---|---|")
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            weight = (torch.randn(6144, 1024) * 0.02).to(dtype)
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT)
            inputs = {rows: torch.randn(1, rows, 1024, dtype=dtype) for rows in ROWS}
            calls = {("plain", r): (lambda x=x: F.linear(x, weight)) for r, x in inputs.items()}
            calls |= {("packed", r): (lambda x=x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
                      for r, x in inputs.items()}
            times: dict = {key: [] for key in calls}
            for _ in range(args.rounds):
                for key, call in calls.items():
                    start = time.process_time()
                    call()
                    times[key].append(time.process_time() - start)
            for r in ROWS:
                plain, fast = (statistics.median(times[(kind, r)]) * 1e3 for kind in ("plain", "packed"))
                print(f"| {str(dtype).removeprefix('torch.')} | {r} | {plain:.3f} | {fast:.3f} | {plain / fast:.2f}x |")


if __name__ == "__main__":
    main()
