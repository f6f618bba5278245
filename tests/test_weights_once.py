"""A quantized model holds each weight once (`core/quantize.py`, Memory): after decoding, with every form its calls
made on first use, the int8 bytes reachable from the model are one copy of its int8 rows (the state_dict's), and no
float copy of a quantized matrix is left beside them."""

import pytest
import torch
from torch import Tensor

from rvqspec import Sampler, decode_frames, default_tree, quantize
import rvqspec.core.quantize as quantize_module
from rvqspec.core import cpu_class
from rvqspec.core.drafters import ReusedHeads
from rvqspec.core.quantize import SCHEMES, VNNI_ROWS, Int8Matmul, QuantizedLinear, quantize_linears, w8a8_kernel
from rvqspec.core.talker import RowCache, Talker, TalkerConfig, prefill, step

from helpers.tiny import random_frames, tiny_model

needs_w8a8 = pytest.mark.skipif(w8a8_kernel() is None, reason="w8a8 needs int8 dot products or rvqspec's AVX2 kernel")
HERE = [pytest.param(s, marks=needs_w8a8) if s == "w8a8" else s for s in SCHEMES]


def reachable(root) -> dict[object, Tensor]:
    """Every tensor reachable from `root` through modules, rvqspec's objects, dicts, lists and tuples, one per storage
    (oneDNN's prepacked tensors, which have none, by identity)."""
    found, seen, todo = {}, set(), [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, Tensor):
            found[("opaque", id(obj)) if obj.is_mkldnn else obj.untyped_storage().data_ptr()] = obj
        elif isinstance(obj, dict):
            todo += obj.values()
        elif isinstance(obj, (list, tuple)):
            todo += obj
        elif hasattr(obj, "__dict__") and type(obj).__module__.startswith(("rvqspec", "torch.nn")):
            todo += vars(obj).values()
    return found


def held_bytes(root, dtype: torch.dtype) -> int:
    return sum(t.numel() * t.element_size() if t.is_mkldnn else t.untyped_storage().nbytes()
               for t in reachable(root).values() if t.dtype == dtype)


def matmuls(root) -> list[Int8Matmul]:
    heads = getattr(root, "head_weights", None)
    return [m.matmul for m in root.modules() if isinstance(m, QuantizedLinear)] + (heads.matmuls if heads else [])


def call_every_matmul(root, dtype: torch.dtype) -> None:
    """One row and a long call (a prefill's, past VNNI_ROWS) through each int8 matrix: every form a call makes."""
    for matmul in matmuls(root):
        for rows in (1, VNNI_ROWS + 3):
            matmul(torch.randn(rows, matmul.in_features).to(dtype))


def check_held_once(root, dtype: torch.dtype, scheme: str, copies: int | None = None) -> None:
    """One copy of the int8 rows (shapes with no padding: multiples of 16), two only where the class keeps oneDNN's
    form beside the VNNI kernel's (AMX's long calls); no float tensor of a quantized matrix's shape."""
    copies = copies or (2 if scheme == "w8a8" and w8a8_kernel() == "vnni" and cpu_class.cpu_class() == "amx" else 1)
    weights = matmuls(root)
    assert held_bytes(root, torch.int8) == copies * sum(m.out_features * m.in_features for m in weights)
    shapes = {(m.out_features, m.in_features) for m in weights}
    floats = [t for t in reachable(root).values() if t.is_floating_point() and tuple(t.shape[-2:]) in shapes]
    assert floats == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("scheme", HERE)
def test_a_quantized_predictor_holds_each_weight_once(scheme, dtype):
    model = quantize(tiny_model(seed=3, dtype=dtype, hidden=64, vocab=64), scheme)
    frames = random_frames(model, 3, seed=4)
    hidden, c0 = torch.stack([h for h, _ in frames]), torch.tensor([c for _, c in frames])
    with torch.inference_mode():
        decode_frames(model, hidden, c0, Sampler(do_sample=False), drafter=ReusedHeads(model), tree=default_tree(8))
        call_every_matmul(model, dtype)
    check_held_once(model, dtype, scheme)
    int8_rows = sum(t.numel() for t in model.state_dict().values() if t.dtype == torch.int8)
    assert int8_rows == sum(m.out_features * m.in_features for m in matmuls(model))  # unpacked again for saving


@pytest.mark.skipif(not cpu_class.has_int8_dot(), reason="needs oneDNN's int8 dot products (VNNI, AMX)")
def test_on_onednns_classes_its_prepacked_weight_is_the_only_copy_and_saves_the_same_rows(monkeypatch):
    """AVX-VNNI CPUs (oneDNN's kernel for every call): the opaque prepacked tensor is the one copy, and the rows a
    state_dict holds come back out of it bit for bit."""
    model = tiny_model(seed=3, dtype=torch.bfloat16, hidden=64, vocab=64)
    expected = quantize(model, "w8a8").state_dict()
    monkeypatch.setattr(quantize_module, "w8a8_kernel", lambda: "onednn")
    quantized = quantize(model, "w8a8")
    with torch.inference_mode():
        call_every_matmul(quantized, torch.bfloat16)
    assert all(set(m.forms) == {"onednn"} for m in matmuls(quantized))
    check_held_once(quantized, torch.bfloat16, "w8a8", copies=1)
    state = quantized.state_dict()
    assert set(state) == set(expected) and all(torch.equal(state[k], expected[k]) for k in state)


@needs_w8a8
def test_a_quantized_talker_holds_each_weight_once():
    torch.manual_seed(0)
    talker = Talker(TalkerConfig(64, 128, 2, 4, 2, 16, 320)).bfloat16().eval()
    quantize_linears(talker, "w8a8")
    cache = RowCache(talker)
    with torch.inference_mode():
        prefill(talker, cache, cache.add(), torch.randn(VNNI_ROWS + 5, 64).bfloat16(), torch.arange(VNNI_ROWS + 5))
        step(talker, cache, torch.randn(1, 64).bfloat16(), torch.tensor(cache.lengths))
        call_every_matmul(talker, torch.bfloat16)
    check_held_once(talker, torch.bfloat16, "w8a8")
