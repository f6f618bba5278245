"""Write the decoding policy's built-in latency tables (rvqspec/core/latency_default.json) from `rvqspec bench --batch`
reports: the tables a machine that has not run the bench falls back on (with a larger margin, see rvqspec.core.policy).
The reports' settings replace those already there (CPU keys name their class, so each class's tables stay).

    python benchmarks/latency_default.py benchmarks/results/bench-batch.json benchmarks/results/gpu/bench-batch.json
    python benchmarks/latency_default.py --smoke   # results/bench-batch.json into a temporary copy of the tables
"""

import argparse
import json
import tempfile
from pathlib import Path

from rvqspec.bench.batched import latency_entries
from rvqspec.bench.timing import RESULTS, SMOKE_HELP
from rvqspec.core.checkpoint import save_json
from rvqspec.core.policy import DEFAULT_TABLES


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP + " (the package's tables stay as they are)")
    parser.add_argument("reports", nargs="*", help="bench-batch.json files")
    args = parser.parse_args(argv)
    if not args.reports and not args.smoke:
        parser.error("name at least one bench-batch.json report")
    reports = args.reports or [RESULTS / "bench-batch.json"]
    out = Path(tempfile.mkdtemp(prefix="rvqspec-smoke-")) / DEFAULT_TABLES.name if args.smoke else DEFAULT_TABLES
    tables = json.loads(DEFAULT_TABLES.read_text())
    for report in reports:
        tables |= latency_entries(json.loads(Path(report).read_text()))
    save_json(out, dict(sorted(tables.items())))
    print(f"wrote {out}: {', '.join(sorted(tables))}")


if __name__ == "__main__":
    main()
