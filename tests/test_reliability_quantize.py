"""Quantized models kept, copied and checked (issue 36, cases 6, 13, 14): a quantized MultiCodeDecoder's
state_dict holds its int8 weights and loads back exactly (another scheme or shape refused whole), it pickles,
deep-copies and saves (also after a w8a8 decode has packed its weights for oneDNN); weights holding NaN or inf
are refused when quantized, naming the tensor; float64 models quantize and decode."""

import copy
import io
import pickle

import pytest
import torch
from safetensors.torch import load_file, load_model, save_file, save_model

import rvqspec
from rvqspec import RvqspecError, Sampler, Tree, decode_frames, quantize
from rvqspec.core.drafters import ReusedHeads
from rvqspec.core.quantize import SCHEMES, Int8Matmul, QuantizedLinear, quantize_linears, quantize_rows, w8a8_kernel

from helpers.csm_models import tiny_csm
from helpers.tiny import random_frames, tiny_model

GREEDY = Sampler(do_sample=False)
W8A8 = w8a8_kernel() is not None  # w8a8 is refused without int8 dot products or rvqspec's AVX2 kernel
RUNNABLE = [pytest.param(s, marks=pytest.mark.skipif(not W8A8, reason="w8a8 needs int8 dot products or rvqspec's "
                                                                       "AVX2 kernel"))
            if s == "w8a8" else s for s in SCHEMES]
CONFIG = dict(vocab=24, talker_hidden=48)  # heads of 24 rows: w8a16 pads them; an input projection (int8 too)


def frames(model, count: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = random_frames(model, count, seed=7)
    return torch.stack([h for h, _ in pairs]), torch.tensor([c for _, c in pairs])


def codes(model, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy AR codes and speculative ones (which also run the heads on rows of several codebooks)."""
    hidden, c0 = inputs
    return (decode_frames(model, hidden, c0, GREEDY).codes,
            decode_frames(model, hidden, c0, GREEDY, drafter=ReusedHeads(model), tree=Tree.chain(3)).codes)


def assert_same_codes(got, expected) -> None:
    assert all(torch.equal(g, e) for g, e in zip(got, expected))


def snapshot(model) -> dict:
    return {key: value.clone() for key, value in model.state_dict().items()}


def assert_state(model, expected: dict) -> None:
    state = model.state_dict()
    assert list(state) == list(expected)
    for key, value in expected.items():
        assert state[key].dtype == value.dtype and torch.equal(state[key], value), key


def int8_matmuls(model) -> list[Int8Matmul]:
    return [m.matmul for m in model.modules() if isinstance(m, QuantizedLinear)] + model.head_weights.matmuls


@pytest.mark.parametrize("scheme", RUNNABLE)
def test_the_state_dict_holds_the_int8_weights_and_loads_them_exactly(scheme):
    float_model = tiny_model(seed=1, dtype=torch.float32, **CONFIG)
    quantized, inputs = quantize(float_model, scheme), frames(float_model)
    state, floats = quantized.state_dict(), float_model.state_dict()
    assert bytes(state["scheme"].tolist()).decode() == scheme and state["scheme"].dtype == torch.uint8
    linears = [name for name, m in quantized.named_modules() if isinstance(m, QuantizedLinear)]
    assert len(linears) == 4 * 2 + 1  # each layer's 4 and the input projection
    entries = [(f"{n}.weight_int8", f"{n}.weight_scale", f"{n}.weight") for n in linears]
    for int8, scale, weight in entries + [("heads_int8", "heads_scale", "heads")]:
        rows = floats[weight].reshape(-1, floats[weight].shape[-1])
        expected_q, expected_scale = quantize_rows(rows)  # the documented form: no padding, float32 scales
        assert state[int8].dtype == torch.int8 and state[int8].shape == floats[weight].shape
        assert state[scale].dtype == torch.float32 and state[scale].shape == floats[weight].shape[:-1]
        assert torch.equal(state[int8].reshape(rows.shape), expected_q)
        assert torch.equal(state[scale].reshape(-1), expected_scale)
    assert set(state) - set(floats) == {"scheme"} | {key for entry in entries for key in entry[:2]} | {
        "heads_int8", "heads_scale"}
    assert all(torch.equal(state[k], v) for k, v in floats.items() if k in state)  # norms, tables

    other = quantize(tiny_model(seed=2, dtype=torch.float32, **CONFIG), scheme)
    before = codes(other, inputs)  # w8a8: packs other's weights for oneDNN, which loading must drop
    assert not torch.equal(before[0], codes(quantized, inputs)[0])
    other.load_state_dict(state)
    assert_state(other, state)
    assert_same_codes(codes(other, inputs), codes(quantized, inputs))


def test_a_state_dict_of_another_scheme_or_shape_is_refused_whole(tmp_path):
    w8a16 = quantize(tiny_model(seed=1, dtype=torch.float32, **CONFIG), "w8a16")
    kept = snapshot(w8a16)
    w8a8_state = {**quantize(tiny_model(seed=2, dtype=torch.float32, **CONFIG), "w8a16").state_dict(),
                  "scheme": torch.tensor(list(b"w8a8"), dtype=torch.uint8)}  # the same entries as w8a8 writes
    float_model = tiny_model(seed=3, dtype=torch.float32, **CONFIG)
    wide = quantize(tiny_model(seed=4, dtype=torch.float32, vocab=32, talker_hidden=48), "w8a16")
    int8_as_float = {**kept, "layers.0.attn.wo.weight_int8": kept["layers.0.attn.wo.weight_int8"].float()}
    refusals = [
        (w8a8_state, r"holds w8a8 weights and the model w8a16 ones: load it into a model of the same config "
                     r"quantized alike \(rvqspec.quantize\(model, 'w8a8'\)\)"),
        (float_model.state_dict(), r"holds float weights and the model w8a16 ones: load it into the float model, "
                                   r"then quantize that \(rvqspec.quantize\(model, 'w8a16'\)\)"),
        (wide.state_dict(), r"heads_int8 is \(15, 32, 32\) torch.int8 in this state_dict and \(15, 24, 32\) "
                            r"torch.int8 in the model: load a state_dict of a model of the same config"),
        ({k: v for k, v in kept.items() if k != "heads_int8"}, r"lacks 1 of the model's entries \['heads_int8'\]"),
        (int8_as_float, r"layers.0.attn.wo.weight_int8 is \(32, 32\) torch.float32 in this state_dict and "
                        r"\(32, 32\) torch.int8 in the model"),
    ]
    for state, message in refusals:
        with pytest.raises(RvqspecError, match=message):
            w8a16.load_state_dict(state)
        assert_state(w8a16, kept)  # nothing loaded
    with pytest.raises(RvqspecError, match="holds w8a16 weights and the model float ones"):
        float_model.load_state_dict(kept)
    save_file(w8a8_state, tmp_path / "w8a8.safetensors")
    with pytest.raises(RvqspecError, match="holds w8a8 weights and the model w8a16 ones"):
        load_model(w8a16, tmp_path / "w8a8.safetensors")  # safetensors loads with strict=False: the scheme counts
    assert_state(w8a16, kept)
    w8a16.load_state_dict({"norm.weight": kept["norm.weight"] * 2}, strict=False)  # a partial state, as asked
    assert torch.equal(w8a16.norm.weight, kept["norm.weight"] * 2)


@pytest.mark.parametrize("scheme", RUNNABLE)
def test_a_quantized_model_pickles_copies_and_saves_after_decoding(tmp_path, scheme):
    quantized = quantize(tiny_model(seed=1, dtype=torch.float32, **CONFIG), scheme)
    inputs = frames(quantized)
    expected, state = codes(quantized, inputs), snapshot(quantized)  # w8a8: oneDNN's packed (opaque) weights now
    buffer = io.BytesIO()
    torch.save(quantized, buffer)
    copies = {"pickle": pickle.loads(pickle.dumps(quantized)), "deepcopy": copy.deepcopy(quantized),
              "torch.save": torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)}
    for how, clone in copies.items():
        assert clone.weights == scheme, how
        assert_state(clone, state)
        for ours, theirs in zip(int8_matmuls(quantized), int8_matmuls(clone)):
            held, their_held = (next(iter(m.forms.values()))[0] for m in (ours, theirs))  # the weight's one form
            assert their_held is not held and theirs.lock is not ours.lock, how
        assert_same_codes(codes(clone, inputs), expected)
    assert_same_codes(codes(quantized, inputs), expected)  # the original decodes as before

    save_model(quantized, tmp_path / "q.safetensors")  # every weight, the int8 ones included
    saved = load_file(tmp_path / "q.safetensors")
    assert sorted(saved) == sorted(state) and all(torch.equal(saved[k], v) for k, v in state.items())
    other = quantize(tiny_model(seed=2, dtype=torch.float32, **CONFIG), scheme)
    load_model(other, tmp_path / "q.safetensors")
    assert_same_codes(codes(other, inputs), expected)
    with pytest.raises(RvqspecError, match="needs the float model"):  # a checkpoint in upstream's layout: float only
        quantized.save_pretrained(tmp_path / "checkpoint")
    assert not (tmp_path / "checkpoint").exists()


def poisoned(value: float, where: str):
    model = tiny_model(seed=1, dtype=torch.float32)
    with torch.no_grad():
        model.get_parameter(where).view(-1)[5] = value
    return model


def test_non_finite_weights_are_refused_when_quantized_naming_the_tensor():
    for value, where, kind in [(float("nan"), "layers.1.mlp.w_down.weight", "NaN"), (float("inf"), "heads", "inf"),
                               (-float("inf"), "code_embed.weight", "inf")]:
        for scheme in SCHEMES if W8A8 else ("w8a16",):
            with pytest.raises(RvqspecError, match=rf"^{where} holds {kind}: 1 of its \d+ values are not finite; "
                                                   "quantize a model with finite weights"):
                quantize(poisoned(value, where), scheme)

    net = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Sequential(torch.nn.Linear(16, 16)))
    with torch.no_grad():
        net[1][0].weight[3, 3] = float("nan")
    with pytest.raises(RvqspecError, match=r"^1.0.weight holds NaN"):
        quantize_linears(net, "w8a16")
    assert [type(m) for m in (net[0], net[1][0])] == [torch.nn.Linear, torch.nn.Linear]  # nothing left swapped


def test_accelerate_refuses_non_finite_weights_naming_the_tensor():
    """CSM: the depth decoder's weights (weights=) and the backbone's (talker_weights=); the model stays as it was."""
    model = tiny_csm(dtype=torch.float32)
    generate = model.depth_decoder.generate
    with torch.no_grad():
        model.depth_decoder.model.layers[1].mlp.down_proj.weight[0, 0] = float("nan")
    with pytest.raises(RvqspecError, match=r"^layers.1.mlp.w_down.weight holds NaN"):
        rvqspec.accelerate(model, weights="w8a16")  # checked first: before the widths w8a16 wants
    with torch.no_grad():
        model.depth_decoder.model.layers[1].mlp.down_proj.weight[0, 0] = 0
        model.backbone_model.layers[0].mlp.up_proj.weight[1, 1] = float("inf")
    with pytest.raises(RvqspecError, match=r"layers.0.mlp.up_proj.weight holds inf"):
        rvqspec.accelerate(model, talker_weights="w8a16")
    assert model.depth_decoder.generate == generate
    assert not any(isinstance(m, QuantizedLinear) for m in model.modules())


@pytest.mark.parametrize("scheme", RUNNABLE)
def test_float64_models_quantize_and_decode_in_float32_matmuls(scheme):
    """torch's w8a16 kernel takes 32- and 16-bit floats: float64 activations are multiplied in float32 and cast back,
    as w8a8 does; speculation stays exact relative to the quantized model."""
    weight, x = torch.randn(40, 32, generator=torch.Generator().manual_seed(0)), torch.randn(5, 32).double()
    matmul = Int8Matmul(weight, scheme)
    out = matmul(x)
    assert out.dtype == torch.float64 and torch.equal(out, matmul(x.float()).double())
    quantized = quantize(tiny_model(seed=3), scheme)  # float64
    assert quantized.dtype == torch.float64
    ar, speculative = codes(quantized, frames(quantized, 6))
    assert torch.equal(ar, speculative)
