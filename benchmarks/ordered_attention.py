"""The predictor's attention alone (issue 51, item 4): `fused.attention_in_order` against SDPA as the predictor ran it
before (`packing.attention`, queries padded to the measured floor), at the 0.6B predictor's heads (16 query heads,
8 KV heads, head_dim 128) for an AR step (1 query over 16 slots) and verify calls of N = 4, 16, 32 (N + 1 queries over
16 + N + 1 slots, a tree's mask) and talker steps (the 0.6B talker has the same heads: one query per row over its
own length), in bfloat16 and float32, the output in the layout the output projection reads; 1 thread, interleaved
calls, medians. Per layer: a predictor call runs 5 (0.6B), a talker step 28.

    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=. .venv/bin/python benchmarks/ordered_attention.py
    # -> benchmarks/results/ordered-attention-<class>.{json,md}
    .venv/bin/python benchmarks/ordered_attention.py --smoke   # the smoke predictor's heads, 3 repeats: seconds
"""

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rvqspec.bench.systems import smoke_config  # noqa: E402
from rvqspec.bench.timing import SMOKE_HELP, finish_machine, machine, machine_text, report_folder, write_reports  # noqa: E402,E501
from rvqspec.core import cpu_class, fused, packing  # noqa: E402
from rvqspec.core.config import QWEN3_TTS_0_6B  # noqa: E402
from rvqspec.core.context import build_plan  # noqa: E402
from rvqspec.core.device_path import median_ms, prepare  # noqa: E402
from rvqspec.core.model import MultiCodeDecoder  # noqa: E402
from rvqspec.core.tree import default_tree  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
ATTENTIONS = {"sdpa": packing.attention, "ordered": fused.attention_in_order}
K = 7  # the rows' committed codes: c1..c7


def shapes(groups: int) -> dict:
    """Per call, the visible slots [B, T, S] of an AR step and of verify calls of a tree of N nodes (one row), and of
    talker steps (one query per row over its own length, rows of different lengths)."""
    out = {"AR": (torch.arange(groups)[None, :] <= K + 1)[None]}
    for budget in (4, 16, 32):
        out[f"N={budget}"] = build_plan(default_tree(budget), groups, torch.device("cpu"), torch.float32).masks[K][None]
    for rows, slots in ((1, 128), (1, 1024), (4, 512)):
        lengths = slots - 10 - 7 * torch.arange(rows)
        out[f"talker step, {rows} row(s), {slots} slots"] = torch.arange(slots)[None, None, :] < lengths[:, None, None]
    return out


@torch.inference_mode()
def costs(dtype: torch.dtype, reps: int, smoke: bool) -> dict:
    c, generator = smoke_config(QWEN3_TTS_0_6B) if smoke else QWEN3_TTS_0_6B, torch.Generator().manual_seed(0)
    prepare(MultiCodeDecoder(c).to(dtype))  # the measured query floor SDPA's calls take
    calls = {}
    for name, visible in shapes(c.num_code_groups).items():
        rows, length, slots = visible.shape
        q = torch.randn(rows, c.num_attention_heads, length, c.head_dim, generator=generator).to(dtype)
        k, v = (torch.randn(rows, c.num_key_value_heads, slots, c.head_dim, generator=generator).to(dtype)
                for _ in range(2))
        mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf"))
        mask = mask[0] if rows == 1 and not name.startswith("talker") else mask[:, None]
        for kind, attend in ATTENTIONS.items():
            calls[(name, kind)] = lambda q=q, k=k, v=v, mask=mask, attend=attend: \
                attend(q, k, v, mask).transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)
    times, rows = median_ms(calls, reps), {}
    for (name, kind), ms in times.items():
        rows.setdefault(name, {})[f"{kind} us"] = round(ms * 1e3, 2)
    for row in rows.values():
        row["ordered / sdpa"] = round(row["ordered us"] / row["sdpa us"], 3)
    return rows


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = [f"# The predictor's attention: in position order against SDPA, {m['cpu_class']}", "",
             f"{machine_text(m)}; 1 thread; `benchmarks/ordered_attention.py`; medians of {report['reps']} "
             "interleaved calls, one layer's attention at the 0.6B predictor's (and talker's) heads.", "",
             "| dtype | call | SDPA (us) | ordered (us) | ordered / SDPA |", "|---|---|---:|---:|---:|"]
    for dtype, rows in report["costs"].items():
        lines += [f"| {dtype} | {name} | {r['sdpa us']:.1f} | {r['ordered us']:.1f} | {r['ordered / sdpa']:.2f} |"
                  for name, r in rows.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=101)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args(argv)
    args.reps = 3 if args.smoke else args.reps
    torch.set_num_threads(1)
    info = machine()
    report = {"machine": info, "reps": args.reps, "costs": {}}
    for dtype in (torch.bfloat16, torch.float32):
        report["costs"][str(dtype).removeprefix("torch.")] = costs(dtype, args.reps, args.smoke)
    finish_machine(info)
    for path in write_reports(report, report_folder(args.out, args.smoke), f"ordered-attention-{cpu_class.cpu_class()}",
                              markdown):
        print("wrote", path)


if __name__ == "__main__":
    main()
