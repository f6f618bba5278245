"""Every file format rvqspec reads, damaged at random (hypothesis): a JSON value replaced by junk, bytes flipped, the
file cut short. Reading it either works or raises one RvqspecError line (the CLI's exit 2), never another error."""

import json
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

from rvqspec import MultiCodeDecoder, RvqspecError, Tree, default_tree
from rvqspec.core.drafters import Drafter
from rvqspec.core.policy import Policy, find_latency_table, setting_key

from helpers.tiny import random_offsets, tiny_model

JUNK = st.sampled_from([None, -1, 0, 1.5, float("nan"), 1e308, 10 ** 30, "x", "", [], {}, [[0]], {"a": {"b": 1}},
                        True, "../../etc/passwd"])


def paths_in(obj, prefix=()):
    """Every (path of keys/indices) to a value inside a JSON object."""
    yield prefix
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for key, value in items:
        yield from paths_in(value, prefix + (key,))


def replaced(obj, path, value):
    if not path:
        return value
    obj = json.loads(json.dumps(obj))
    parent = obj
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    return obj


def damage_json(text: str, pick: float, junk) -> str:
    obj = json.loads(text)
    paths = list(paths_in(obj))
    return json.dumps(replaced(obj, paths[int(pick * (len(paths) - 1))], junk))


def damage_bytes(data: bytes, cut: float, flips) -> bytes:
    data = bytearray(data)
    for where, value in flips:
        data[int(where * (len(data) - 1))] = value
    return bytes(data[:max(1, int(cut * len(data)))])


def refused_or_read(read) -> None:
    try:
        read()
    except RvqspecError as e:
        assert "\n" not in str(e)


FLIPS = st.lists(st.tuples(st.floats(0, 1), st.integers(0, 255)), max_size=3)
FUZZ = settings(max_examples=40, deadline=None)


@FUZZ
@given(mode=st.sampled_from(["json", "bytes"]), pick=st.floats(0, 1), junk=JUNK, cut=st.floats(0, 1), flips=FLIPS)
def test_tree_files(mode, pick, junk, cut, flips):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "tree.json"
        default_tree(8).save(path)
        text = path.read_text()
        path.write_bytes(damage_json(text, pick, junk).encode() if mode == "json"
                         else damage_bytes(text.encode(), cut, flips))
        refused_or_read(lambda: Tree.load(path))


@FUZZ
@given(pick=st.floats(0, 1), junk=JUNK, cut=st.floats(0.5, 1), flips=FLIPS, mode=st.sampled_from(["meta", "bytes"]))
def test_drafter_files(pick, junk, cut, flips, mode):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    model = tiny_model()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "d.safetensors"
        random_offsets(model, 3, seed=1).save(path)
        if mode == "meta":
            with safe_open(path, "pt") as f:
                meta = f.metadata()
            key = sorted(meta)[int(pick * (len(meta) - 1))]
            save_file(load_file(path), path, metadata={**meta, key: json.dumps(junk)})
        else:
            path.write_bytes(damage_bytes(path.read_bytes(), cut, flips))
        refused_or_read(lambda: Drafter.load(path, model))


@FUZZ
@given(mode=st.sampled_from(["json", "bytes"]), pick=st.floats(0, 1), junk=JUNK, cut=st.floats(0, 1), flips=FLIPS)
def test_device_files(mode, pick, junk, cut, flips):
    model = tiny_model(dtype=torch.bfloat16)
    key = setting_key(model)
    with tempfile.TemporaryDirectory() as folder, pytest.MonkeyPatch.context() as patch:
        patch.setenv("RVQSPEC_CACHE", folder)
        path = Path(folder) / "device.json"
        text = json.dumps({"format": "rvqspec-device/1", "latency": {key: {"ms": {"1": {"0": 2.0, "4": 3.0},
                                                                              "2": {"0": 2.5, "4": 4.0}}}}})
        path.write_bytes(damage_json(text, pick, junk).encode() if mode == "json"
                         else damage_bytes(text.encode(), cut, flips))
        refused_or_read(lambda: Policy.for_model(model).choose(2))
        refused_or_read(lambda: find_latency_table(key))


@FUZZ
@given(mode=st.sampled_from(["json", "bytes"]), pick=st.floats(0, 1), junk=JUNK, cut=st.floats(0, 1), flips=FLIPS)
def test_calibration_reports(mode, pick, junk, cut, flips):
    model = tiny_model()
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        tree = default_tree(4)
        tree.save(folder / "tree-N4.json")
        text = json.dumps({"acceptance_per_position": torch.full((14, 3, 4), 0.1).tolist(),
                           "trees": [{"budget": 4, "file": "tree-N4.json", "measured_frame_calls": [5, 6, 7]}]})
        (folder / "report.json").write_bytes(damage_json(text, pick, junk).encode() if mode == "json"
                                              else damage_bytes(text.encode(), cut, flips))
        refused_or_read(lambda: Policy.for_model(model, folder).explain(1))


@FUZZ
@given(mode=st.sampled_from(["json", "bytes"]), pick=st.floats(0, 1), junk=JUNK, cut=st.floats(0, 1), flips=FLIPS)
def test_checkpoint_configs(mode, pick, junk, cut, flips):
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        tiny_model(dtype=torch.float32).save_pretrained(folder)
        text = (folder / "config.json").read_text()
        (folder / "config.json").write_bytes(damage_json(text, pick, junk).encode() if mode == "json"
                                             else damage_bytes(text.encode(), cut, flips))
        refused_or_read(lambda: MultiCodeDecoder.from_pretrained(folder))
