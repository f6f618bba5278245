"""The model-adapter contract (`runtime/adapter.py`): each adapter (qwen-tts, CSM, the stand-in) has every member the
scheduler, the Engine and the codec workers use, its methods with the Protocol's parameters."""

import inspect
import typing

import pytest

from rvqspec.runtime.adapter import ModelAdapter
from rvqspec.runtime.csm import CsmModel
from rvqspec.runtime.qwen_tts import QwenTTSModel
from rvqspec.runtime.standin import StandinModel

from helpers.csm_models import tiny_csm
from helpers.standin import tiny_standin
from helpers.upstream_tts import tiny_qwen3_tts

ADAPTERS = {"qwen-tts": lambda: QwenTTSModel(tiny_qwen3_tts(seed=0)), "csm": lambda: CsmModel(tiny_csm()),
            "standin": lambda: StandinModel.from_tts(tiny_standin(seed=3))}
MEMBERS = [name for name in vars(ModelAdapter) if not name.startswith("_")] + \
    list(typing.get_type_hints(ModelAdapter))


@pytest.mark.parametrize("make", ADAPTERS.values(), ids=ADAPTERS.keys())
def test_each_adapter_keeps_the_contract(make):
    adapter = make()
    assert isinstance(adapter, ModelAdapter)
    missing = [name for name in MEMBERS if not hasattr(adapter, name)]
    assert not missing, f"{type(adapter).__name__} lacks {missing}"
    for name in MEMBERS:
        contract = getattr(ModelAdapter, name, None)
        if inspect.isfunction(contract):
            expected = list(inspect.signature(contract).parameters)[1:]
            assert list(inspect.signature(getattr(adapter, name)).parameters) == expected, name
    for name, kind in typing.get_type_hints(ModelAdapter).items():
        assert isinstance(getattr(adapter, name), kind), f"{type(adapter).__name__}.{name}"
    assert adapter.frame_seconds > 0 and isinstance(adapter.can_clone, bool) and isinstance(adapter.voices(), list)
