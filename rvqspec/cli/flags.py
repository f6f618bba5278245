"""Flags that several subcommands share, as argparse parent parsers: one spelling, one meaning, one check.

    --model     a checkpoint folder (config.json + *.safetensors), official or stand-in
    --drafter   reused | offsets | medusa | FILE: `reused` (the frozen heads, nothing trained), a kind (what
                `train-offsets` trains), or a trained drafter file (offsets or Medusa heads, .safetensors)
"""

import argparse
import math
import os
from pathlib import Path

from rvqspec.core.drafters import KINDS
from rvqspec.core.errors import RvqspecError


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


# Argument types that refuse bad values at parse time (one line, exit 2), before any work starts.

def bounded_int(low: int, high: int | None = None):
    def check(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{value} is out of range: use " +
                                             (f"{low}..{high}" if high is not None else f"an integer >= {low}"))
        return value
    check.__name__ = "integer"
    return check


positive_int = bounded_int(1)
non_negative_int = bounded_int(0)
seed = bounded_int(0, 2 ** 63 - 1)  # torch generators take a signed 64-bit seed
chunk_frames = bounded_int(1, 300)  # rvqspec.core.frame_loop.MAX_CHUNK_FRAMES


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text} must be a finite number > 0")
    return value


def fraction(text: str) -> float:
    value = positive_float(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"{text} must lie strictly between 0 and 1")
    return value


def threads(text: str) -> int:
    """A torch thread count this machine has cores for (OpenMP crashes far beyond them)."""
    return bounded_int(1, os.cpu_count() or 1)(text)


def device(text: str) -> str:
    """cpu, cuda or cuda:N, refused when this machine has no such device."""
    import torch

    if text == "cpu":
        return text
    if text.split(":")[0] == "cuda":
        count = torch.cuda.device_count()
        index = text.partition(":")[2]
        if count and (not index or (index.isdigit() and int(index) < count)):
            return text
        raise argparse.ArgumentTypeError(f"{text}: this machine has {count} CUDA device(s) (use cpu)")
    raise argparse.ArgumentTypeError(f"{text!r} is not a device: use cpu or cuda[:N]")


def out_file(text: str) -> str:
    """An output file: a regular file (replaced) or nothing yet (its folder is made). Refused: a folder, a device
    (/dev/full), a FIFO or a socket, which an atomic rename would replace, and a path whose folder cannot be made
    (a file is in the way). A symlink is written through: its target, returned, is checked and replaced, the link
    kept."""
    path = Path(text)
    if path.is_symlink():
        try:
            path = path.resolve()
        except (OSError, RuntimeError) as e:  # a loop: RuntimeError up to Python 3.12, OSError from 3.13
            raise argparse.ArgumentTypeError(f"{text} is a symlink that cannot be followed ({e}): name a file") from None
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder: name the file to write")
    if path.exists() and not path.is_file():
        raise argparse.ArgumentTypeError(f"{text} is not a regular file (a device, FIFO or socket): name a file to "
                                         "write")
    blocking = next((p for p in path.absolute().parents if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise argparse.ArgumentTypeError(f"{text}: {blocking} is a file, so no folder can hold the output")
    return str(path)


def out_folder(text: str) -> str:
    """An output folder: refused when it names an existing file, or when it cannot be written (checked on the
    nearest folder that exists), so that the error comes before the work, not after."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file, not a folder: name a folder to write into")
    existing = next(p for p in (path.absolute(), *path.absolute().parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text}: cannot write into {existing} (permissions): pick a writable folder")
    return text


def require_extra(command: str, extra: str, *modules: str) -> None:
    """Refuse, before any work, a command whose optional extra is not installed: one line naming what to install."""
    import importlib.util

    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        raise RvqspecError(f"{command} needs {', '.join(missing)}: pip install 'rvqspec[{extra}]'")
