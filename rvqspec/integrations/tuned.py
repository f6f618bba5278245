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

A folder tuned for another checkpoint, architecture or dtype is refused, naming the mismatch. Every file read here
is checked for type, shape and range first (a damaged one: one RvqspecError naming the file, the field and the
`rvqspec tune --force STAGE` that writes it again), so a damaged folder fails at `accelerate`, not mid-generate.
"""

import hashlib
from pathlib import Path

import torch
from torch import Tensor

from rvqspec.core.errors import RvqspecError
from rvqspec.core.files import read_json
from rvqspec.core.model import MultiCodeDecoder
from rvqspec.core.policy import MEASURED_MARGIN, LatencyTable, check_latency_tables, setting_key
from rvqspec.core.tree import Tree

IDENTITY, DRAFTER, TREES, LATENCY = "tune.json", Path("train") / "offsets.safetensors", "trees", "latency.json"


def architecture(model: MultiCodeDecoder) -> str:
    return setting_key(model).split("/")[3]  # device/dtype/threads/ARCHITECTURE, then a CPU class on a CPU


PROBES = 16  # elements of a weight that `weights_digest` reads


def probe(weight: Tensor) -> Tensor:
    """A copy of PROBES elements spread evenly over `weight` (integer indices: exact at any size)."""
    flat = weight.detach().reshape(-1)
    where = torch.arange(PROBES, device=flat.device) * (len(flat) - 1) // (PROBES - 1)
    return flat[where].clone()


def weights_digest(model: MultiCodeDecoder) -> str:
    """A digest of a few elements of every weight (`probe`), upcast: equal for the same checkpoint loaded
    in any dtype that holds its values, different after fine-tuning."""
    values = torch.cat([probe(t).double().cpu().reshape(-1) for _, t in sorted(model.state_dict().items())])
    return hashlib.sha256(values.numpy().tobytes()).hexdigest()[:16]


def identity_of(model: MultiCodeDecoder, kind: str) -> dict:
    return {"kind": kind, "architecture": architecture(model), "dtype": str(model.dtype).removeprefix("torch."),
            "weights_digest": weights_digest(model)}


IDENTITY_FIELDS = ("kind", "architecture", "dtype", "weights_digest")


def redo(folder: Path, stage: str) -> str:
    """The fix for a damaged file of `folder`: the tune command that writes it again."""
    return f"redo it with `rvqspec tune --model CKPT --out {folder} --force {stage}`"


def read_identity(folder: Path) -> dict:
    """tune.json, checked: an object with the identity strings, and a drafter that is "reused" or a file in train/."""
    path = folder / IDENTITY
    if not path.is_file():
        raise RvqspecError(f"{folder} is not a folder `rvqspec tune` wrote ({IDENTITY} missing): tune one with "
                           f"`rvqspec tune --model CKPT --out {folder}`")
    fix = redo(folder, "synthesize")
    identity = read_json(path, fix)
    if not isinstance(identity, dict):
        raise RvqspecError(f"{path} must hold a JSON object, got {type(identity).__name__}: {fix}")
    for name in IDENTITY_FIELDS:
        if not isinstance(identity.get(name), str):
            raise RvqspecError(f"{path}: {name} must be a string, got {str(identity.get(name))[:40]!r}: {fix}")
    drafter = identity.get("drafter", str(DRAFTER))
    if not (drafter == "reused" or isinstance(drafter, str) and drafter.endswith(".safetensors")
            and Path(drafter).parent == DRAFTER.parent):
        raise RvqspecError(f"{path}: drafter must be \"reused\" or a file train/NAME.safetensors, got "
                           f"{str(drafter)[:40]!r}: {redo(folder, 'calibrate')}")
    return identity


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
    from rvqspec.core.drafters import Drafter, ReusedHeads

    name = read_identity(folder).get("drafter", str(DRAFTER))  # checked there: "reused" or train/NAME.safetensors
    if name == "reused":
        return ReusedHeads(model)
    if not (folder / name).exists():
        raise RvqspecError(f"{folder} is not finished ({name} missing): rerun the same `rvqspec tune` command "
                           "(finished stages are skipped)")
    return Drafter.load(folder / name, model)


def check_trees(folder: Path, model: MultiCodeDecoder, depth: int) -> None:
    """trees/report.json lists trees (`Tree.load` checks each) that fit the drafter's depth and the vocabulary."""
    path = folder / TREES / "report.json"
    fix = redo(folder, "calibrate")
    report = read_json(path, fix)
    rows = report.get("trees") if isinstance(report, dict) else None
    if not isinstance(rows, list) or not rows:
        raise RvqspecError(f"{path}: trees must be a non-empty list of {{size, file}}: {fix}")
    for row in rows:
        name = row.get("file") if isinstance(row, dict) else None
        if not isinstance(name, str) or Path(name).name != name or not name:
            raise RvqspecError(f"{path}: a tree's file must be a file name in {TREES}/, got {str(name)[:40]!r}: {fix}")
        try:
            Tree.load(folder / TREES / name).check_fits(depth, model.config.vocab_size)
        except RvqspecError as e:
            raise RvqspecError(f"{folder / TREES / name}: {e}; {fix}") from None


def read_latency(folder: Path, model: MultiCodeDecoder) -> LatencyTable | None:
    """latency.json, checked like the device file's tables; None where it was measured for another setting (thread
    count, device): the policy then takes the device file's."""
    path = folder / LATENCY
    if not path.exists():
        return None
    entry = read_json(path, redo(folder, "bench"))
    key = str(entry.get("key")) if isinstance(entry, dict) else "None"  # a list there would be no dict key
    try:
        check_latency_tables({key: entry}, path)
    except RvqspecError as e:
        raise RvqspecError(f"{e}; or {redo(folder, 'bench')}") from None
    if key != setting_key(model):
        return None
    return LatencyTable.from_json(entry, f"measured by rvqspec tune: {entry.get('measured_on')}", MEASURED_MARGIN)


def load_tuned(folder: str | Path, model: MultiCodeDecoder, kind: str):
    """(drafter, calibration folder, latency table or None) of a tuned folder, checked against `model`."""
    folder = Path(folder)
    check_identity(folder, model, kind)
    if not (folder / TREES / "report.json").exists():
        raise RvqspecError(f"{folder} is not finished ({TREES}/report.json missing): rerun the same `rvqspec tune` "
                           "command (finished stages are skipped)")
    drafter = tuned_drafter(folder, model)
    check_trees(folder, model, drafter.depth)
    return drafter, folder / TREES, read_latency(folder, model)
