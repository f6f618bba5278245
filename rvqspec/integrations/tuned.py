"""A folder `rvqspec tune` wrote, as `accelerate(model, tuned=FOLDER)` reads it:

    tune.json          what it was tuned for (model kind, architecture, dtype, a digest of the weights) and the stages
    corpus/            the model's own synthesis, per frame the state conditioning the depth decoder and all codes
    train/offsets.safetensors   the trained drafter (train/position-offsets.safetensors with --offsets per-position;
                       the trainer's folder: checkpoint, metrics.json)
    trees/             the calibration of the drafter in use: report.json (predicted vs measured), tree-N*.json;
                       trees-other/ the other candidate's. tune.json names the drafter in use ("drafter"): the trained
                       one, or "reused" where the frozen heads measured more tokens/step on held-out frames
    latency.json       this device's latency table for the architecture (absent with --no-bench)
    report.json, README.md   what was measured

A folder tuned for another checkpoint, architecture or dtype is refused, naming the mismatch.
"""

import hashlib
import json
from pathlib import Path

import torch

from rvqspec.engine.errors import RvqspecError
from rvqspec.engine.model import MultiCodeDecoder
from rvqspec.engine.packing import probe
from rvqspec.engine.policy import MEASURED_MARGIN, LatencyTable, setting_key

IDENTITY, DRAFTER, TREES, LATENCY = "tune.json", Path("train") / "offsets.safetensors", "trees", "latency.json"


def architecture(model: MultiCodeDecoder) -> str:
    return setting_key(model).split("/")[-1]


def weights_digest(model: MultiCodeDecoder) -> str:
    """A digest of a few elements of every weight (`packing.probe`), upcast: equal for the same checkpoint loaded
    in any dtype that holds its values, different after fine-tuning."""
    values = torch.cat([probe(t).double().cpu().reshape(-1) for _, t in sorted(model.state_dict().items())])
    return hashlib.sha256(values.numpy().tobytes()).hexdigest()[:16]


def identity_of(model: MultiCodeDecoder, kind: str) -> dict:
    return {"kind": kind, "architecture": architecture(model), "dtype": str(model.dtype).removeprefix("torch."),
            "weights_digest": weights_digest(model)}


def read_identity(folder: Path) -> dict:
    try:
        return json.loads((folder / IDENTITY).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise RvqspecError(f"{folder} is not a folder `rvqspec tune` wrote ({IDENTITY}: {e}): tune one with "
                           f"`rvqspec tune --model CKPT --out {folder}`") from None


def check_identity(folder: Path, model: MultiCodeDecoder, kind: str) -> None:
    """Refuse `folder` unless it was tuned for this model (kind, architecture, dtype, weights)."""
    tuned, ours = read_identity(folder), identity_of(model, kind)
    for field, what in (("kind", "model type"), ("architecture", "architecture"), ("dtype", "dtype"),
                        ("weights_digest", "checkpoint (its weights differ)")):
        if tuned.get(field) != ours[field]:
            fix = (f"load the model in {tuned.get(field)}" if field == "dtype"
                   else "tune this model with `rvqspec tune --model CKPT --out NEW_FOLDER`")
            raise RvqspecError(f"{folder} was tuned for another {what}: {tuned.get(field)} there, {ours[field]} "
                               f"here: {fix}")


def tuned_drafter(folder: Path, model: MultiCodeDecoder):
    """The drafter a tuned folder uses: its trained file, or the reused heads where those measured better."""
    from rvqspec.engine.drafters import Drafter, ReusedHeads

    name = read_identity(folder).get("drafter", str(DRAFTER))
    if name == "reused":
        return ReusedHeads(model)
    if not (folder / name).exists():
        raise RvqspecError(f"{folder} is not finished ({name} missing): rerun the same `rvqspec tune` command "
                           "(finished stages are skipped)")
    return Drafter.load(folder / name, model)


def load_tuned(folder: str | Path, model: MultiCodeDecoder, kind: str):
    """(drafter, calibration folder, latency table or None) of a tuned folder, checked against `model`."""
    folder = Path(folder)
    check_identity(folder, model, kind)
    if not (folder / TREES / "report.json").exists():
        raise RvqspecError(f"{folder} is not finished ({TREES}/report.json missing): rerun the same `rvqspec tune` "
                           "command (finished stages are skipped)")
    drafter = tuned_drafter(folder, model)
    latency = None
    if (folder / LATENCY).exists():
        entry = json.loads((folder / LATENCY).read_text())
        if entry.get("key") == setting_key(model):  # another thread count or device: the device file's table
            latency = LatencyTable.from_json(entry, f"measured by rvqspec tune: {entry.get('measured_on')}",
                                             MEASURED_MARGIN)
    return drafter, folder / TREES, latency
