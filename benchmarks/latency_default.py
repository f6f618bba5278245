"""Write the decoding policy's built-in latency tables (rvqspec/core/latency_default.json) from `rvqspec bench --batch`
reports: the tables a machine that has not run the bench falls back on (with a larger margin, see rvqspec.core.policy).
The reports' settings replace those already there (CPU keys name their class, so each class's tables stay).

    python benchmarks/latency_default.py benchmarks/results/bench-batch.json benchmarks/results/gpu/bench-batch.json
"""

import argparse
import json
from pathlib import Path

from rvqspec.bench.batched import latency_entries
from rvqspec.core.checkpoint import save_json
from rvqspec.core.policy import DEFAULT_TABLES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", help="bench-batch.json files")
    args = parser.parse_args()
    tables = json.loads(DEFAULT_TABLES.read_text())
    for report in args.reports:
        tables |= latency_entries(json.loads(Path(report).read_text()))
    save_json(DEFAULT_TABLES, dict(sorted(tables.items())))
    print(f"wrote {DEFAULT_TABLES}: {', '.join(sorted(tables))}")


if __name__ == "__main__":
    main()
