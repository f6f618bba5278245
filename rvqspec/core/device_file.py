"""The device file ($RVQSPEC_CACHE/device.json, default ~/.cache/rvqspec): the call latencies `rvqspec bench --batch`
measured on this machine, which the decoding policy reads (`policy.find_latency_table`).

    {"format": "rvqspec-device/1",
     "latency": {"cpu/bfloat16/1t/h1024-l5-v2048-g16": {"ms": {"1": {"0": 5.1, "16": 7.2, ...}, ...}, ...}}}
                                               # ms per call at (batch, N); N = 0 is AR

Each bench run updates its own setting keys and keeps the rest.
"""

import json
import os
from pathlib import Path

from rvqspec.core.checkpoint import save_json
from rvqspec.core.errors import RvqspecError

DEVICE_FORMAT = "rvqspec-device/1"


def cache_dir() -> Path:
    return Path(os.environ.get("RVQSPEC_CACHE") or Path.home() / ".cache" / "rvqspec")


def device_file_path() -> Path:
    return cache_dir() / "device.json"


def read_device_file() -> dict | None:
    path = device_file_path()
    if not path.is_file():
        return None
    try:
        info = json.loads(path.read_text())
        if info.get("format") != DEVICE_FORMAT or not isinstance(info.get("latency", {}), dict):
            raise ValueError
    except (json.JSONDecodeError, ValueError, AttributeError, UnicodeDecodeError):
        raise RvqspecError(f"{path} is not a device file written by `rvqspec bench`: delete it or rerun "
                           "`rvqspec bench`") from None
    return info


def update_device_file(fields: dict) -> Path:
    """Merge `fields` into the device file (a `latency` dict merges key by key) and write it atomically."""
    info = read_device_file() or {"format": DEVICE_FORMAT}
    latency = info.get("latency", {}) | fields.get("latency", {})
    info.update(fields, written_by="rvqspec bench")
    if latency:
        info["latency"] = latency
    save_json(device_file_path(), info)
    return device_file_path()
