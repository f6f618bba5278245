"""Saves while accelerated keep upstream's weights (issue 36, case 5): with `talker_weights=` on, the talker's
(CSM: the backbone's) layers are int8 copies of ours, and the model's state_dict() and save_pretrained still
give the float weights, every key and value as the unaccelerated model has them."""

import pytest
import torch

import rvqspec
from rvqspec.core.quantize import QuantizedLinear

from helpers.csm_models import tiny_csm
from helpers.upstream_models import upstream_available


def float_state(model: torch.nn.Module) -> dict:
    return {key: value.clone() for key, value in model.state_dict().items()}


def assert_same_state(state: dict, reference: dict) -> None:
    assert list(state) == list(reference)
    for key, value in reference.items():
        assert state[key].dtype == value.dtype and torch.equal(state[key], value), key


def quantized_layers(model: torch.nn.Module) -> int:
    return sum(isinstance(m, QuantizedLinear) for m in model.modules())


@pytest.mark.skipif(not upstream_available(), reason="qwen-tts reference not installed: run `make install`")
@pytest.mark.parametrize("scheme", ["w8a16", "w8a8"])
def test_save_pretrained_with_int8_talker_layers_writes_the_float_weights(tmp_path, scheme):
    from safetensors.torch import load_file

    from helpers.upstream_tts import tiny_qwen3_tts

    tts = tiny_qwen3_tts(seed=1)
    reference = float_state(tts.model)
    handle = rvqspec.accelerate(tts, talker_weights=scheme)
    try:
        assert quantized_layers(tts.model) >= 7  # the talker's layer decodes with int8 weights
        assert_same_state(tts.model.state_dict(), reference)
        tts.model.save_pretrained(tmp_path)
        assert quantized_layers(tts.model) >= 7  # saving changed nothing
    finally:
        handle.undo()
    saved = load_file(tmp_path / "model.safetensors")
    assert sorted(saved) == sorted(reference)
    for key, value in reference.items():
        assert torch.equal(saved[key], value), key
    assert_same_state(tts.model.state_dict(), reference)


def test_csm_state_dict_with_an_int8_backbone_gives_the_float_weights():
    model = tiny_csm(dtype=torch.float32)
    reference = float_state(model)
    handle = rvqspec.accelerate(model, talker_weights="w8a16")
    try:
        assert quantized_layers(model) >= 8  # the backbone's layer and its c0 head
        assert_same_state(model.state_dict(), reference)
    finally:
        handle.undo()
    assert_same_state(model.state_dict(), reference)
