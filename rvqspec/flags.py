"""Flags that several subcommands share, as argparse parent parsers: one spelling, one meaning, one check.

    --model     a checkpoint folder (config.json + *.safetensors), official or stand-in
    --drafter   reused | offsets | medusa | FILE: `reused` (the frozen heads, nothing trained), a kind (what
                `train-offsets` trains), or a trained drafter file (offsets or Medusa heads, .safetensors)
"""

import argparse
from pathlib import Path

KINDS = ("reused", "offsets", "medusa")


def drafter_spec(allowed: tuple[str, ...]):
    """An argparse type: one of `allowed` (kinds, 'file' for a drafter file) checked at parse time."""
    def check(text: str) -> str:
        if text in KINDS:
            if text in allowed:
                return text
            if "file" in allowed and text != "reused":
                raise argparse.ArgumentTypeError(f"an untrained {text} drafter drafts exactly like 'reused': pass "
                                                 "the trained file that `rvqspec train-offsets` wrote, or 'reused'")
            raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(a for a in allowed if a != 'file')}")
        if "file" not in allowed:
            raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(allowed)}")
        if not Path(text).is_file():
            raise argparse.ArgumentTypeError(f"drafter file {text} does not exist (or use 'reused')")
        return text
    return check


def model_flag(required: bool = True, default: str | None = None,
               help: str = "checkpoint folder (config.json + *.safetensors), official or stand-in"
               ) -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--model", required=required, default=default, help=help)
    return parent


def drafter_flag(allowed: tuple[str, ...] = ("reused", "file"), required: bool = False, default: str | None = "reused",
                 help: str = "'reused' (the frozen heads) or a trained drafter file (offsets or Medusa heads)"
                 ) -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--drafter", type=drafter_spec(allowed), required=required, default=default, help=help)
    return parent
