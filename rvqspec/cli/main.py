"""`rvqspec` command line: speculative decoding of RVQ depth decoders (Qwen3-TTS, Sesame CSM).

The entry point: each command is a module of this package with `add_cli(subparsers)` (its flags and a `run(args)`
that calls into the core, integrations, tuning, standin, bench, runtime or serve packages)."""

import argparse
import errno
import importlib
import os
import sys

from rvqspec.core.errors import RvqspecError

# Modules that register subcommands, in the order `rvqspec --help` lists them.
COMMAND_MODULES = ["demo", "train", "calibrate", "tune", "synth", "serve", "standin", "eval", "bench", "inspect"]
# Modules that add a command to the `rvqspec corpus` group.
CORPUS_MODULES = ["synth", "standin"]
# Errors of a write that ran out of room: the work failed (exit 1), the input was fine (a refusal is exit 2).
DISK_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


class UsageError(Exception):
    pass


class Parser(argparse.ArgumentParser):
    """argparse, except that a bad argument is one line on stderr (`rvqspec CMD: error: ...`, exit 2), not a usage
    block: the same shape as every other error of the CLI."""

    def error(self, message: str):
        raise UsageError(one_line(f"{self.prog}: error: {message}"))


def one_line(message: str) -> str:
    """A message as one line, whatever the user's values held (a newline in a path or a number)."""
    return message.replace("\r", "\\r").replace("\n", "\\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="rvqspec", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(f"rvqspec.cli.{name}").add_cli(subparsers)
    corpus = subparsers.add_parser("corpus", help="build corpora: speech (the stand-in's), codes from audio")
    group = corpus.add_subparsers(dest="corpus_command", required=True)
    for name in CORPUS_MODULES:
        importlib.import_module(f"rvqspec.cli.{name}").add_corpus_cli(group)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except UsageError as e:
        print(e, file=sys.stderr)
        return 2
    os.environ["HF_HUB_OFFLINE"] = "1"  # the CLI never downloads: upstream's loaders read the local cache only
    try:
        return args.run(args) or 0
    except RvqspecError as e:
        print(one_line(f"rvqspec {args.command}: error: {e}"), file=sys.stderr)
        return 2
    except OSError as e:  # a path the user gave cannot be read or written (missing, a file, permissions, disk full)
        where = f": {e.filename}" if e.filename else ""
        full = e.errno in DISK_FULL
        fix = ": free some space, or write elsewhere" if full else ""
        print(one_line(f"rvqspec {args.command}: error: {e.strerror or e}{where}{fix}"), file=sys.stderr)
        return 1 if full else 2
    except KeyboardInterrupt:
        print(f"rvqspec {args.command}: interrupted", file=sys.stderr)
        return 130


# OpenMP workers that sleep between parallel regions: beside another job, spinning ones make 2 threads 1.4-2.5x
# slower than 1, sleeping ones about even; on a quiet machine spinning is faster (benchmarks/results/threads.md).
WAIT_POLICY = "PASSIVE"


def entry() -> int:
    """The `rvqspec` console command: `main()` with OMP_WAIT_POLICY=PASSIVE unless the user set a wait policy.
    libgomp reads it when torch loads, which is before this runs, so the command starts itself once more with it."""
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["OMP_WAIT_POLICY"] = WAIT_POLICY
        os.execv(sys.executable, [sys.executable, "-m", "rvqspec.cli", *sys.argv[1:]])
    return main()


if __name__ == "__main__":
    sys.exit(main())
