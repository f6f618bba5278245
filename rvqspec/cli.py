"""`rvqspec` command line. Each subcommand lives beside the code it runs, as `add_cli(subparsers)`."""

import argparse
import importlib
import sys

from rvqspec.errors import RvqspecError

# Modules that register subcommands, in the order `rvqspec --help` lists them.
COMMAND_MODULES = ["rvqspec.demo", "rvqspec.train", "rvqspec.calibrate", "rvqspec.synth", "rvqspec.standin.build", "rvqspec.eval", "rvqspec.bench", "rvqspec.results", "rvqspec.inspect_cmd"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rvqspec", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_cli(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args) or 0
    except RvqspecError as e:
        print(f"rvqspec {args.command}: error: {e}", file=sys.stderr)
        return 2
    except (FileNotFoundError, PermissionError, IsADirectoryError) as e:
        print(f"rvqspec {args.command}: error: {e.strerror or e}: {e.filename}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"rvqspec {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
