"""Integrations with existing TTS packages: `accelerate(model, ...)` recognises a qwen-tts model or a transformers
CSM model and hooks its depth decoder (each submodule imports its package only when it needs it)."""

import torch

from rvqspec.core.errors import RvqspecError
from rvqspec.core.tree import Tree
from rvqspec.integrations import csm, qwen_tts
from rvqspec.integrations.base import HANDLE, AccelerateOptions, Acceleration


def accelerate(model, drafter=None, tree: Tree | str | None = "auto", generator: torch.Generator | None = None,
               calibration: str | None = None, weights: str | None = None, tuned: str | None = None,
               graphs: bool = True, talker_weights: str | None = None) -> Acceleration:
    """Route the depth decoder of `model` through `rvqspec.decode_frames` until `handle.undo()`.

    `model`: a qwen-tts model (`qwen_tts.Qwen3TTSModel`, its `.model` or `.model.talker`: the code predictor, 15
    calls per frame) or a transformers `CsmForConditionalGeneration` (its depth decoder, 31 calls per frame).
    No drafter: plain AR; with a drafter (`rvqspec.ReusedHeads()`, `rvqspec.Offsets.load(path)`, ...):
    `tree="auto"` (the decoding policy's choice per batch size, from this device's latency tables and the
    acceptance of `calibration`, an `rvqspec calibrate` folder) or a fixed `rvqspec.Tree`. The codes keep
    upstream's distribution (greedy: the same codes); `handle.stats` counts frames, calls and tokens/step.
    `weights="w8a8"` (or "w8a16"): decode with int8 weights instead (`rvqspec.quantize`, CPU): a different model, opt-in;
    its codes have its own distribution, and speculation is exact relative to it. `tuned`: a folder `rvqspec tune`
    wrote for this model (drafter, trees, latency table), in place of drafter= and calibration=. On CUDA the
    calls replay from CUDA graphs (`rvqspec.core.graphs`); `graphs=False` runs them eagerly.
    `talker_weights="w8a8"` (opt-in, lossy, CPU): the talker's (CSM: the backbone's) linear layers become int8 ones
    too, until `handle.undo()`.
    """
    options = AccelerateOptions(drafter, tree, generator, calibration, weights, tuned, graphs, talker_weights)
    if csm.is_csm(model):
        return csm.accelerate_with(model, options)
    try:
        qwen_tts.find_talker(model)
    except RvqspecError:
        raise RvqspecError(f"{type(model).__name__} is neither a qwen-tts model nor a transformers CSM model: pass a "
                           "qwen_tts.Qwen3TTSModel (or its .model / .model.talker) or a "
                           "CsmForConditionalGeneration") from None
    return qwen_tts.accelerate_with(model, options)  # the whole model


def deaccelerate(model) -> None:
    """Undo `accelerate(model)`."""
    handle = getattr(model, HANDLE, None)
    if handle is None and not csm.is_csm(model):
        handle = getattr(qwen_tts.find_talker(model), HANDLE, None)
    if handle is None:
        raise RvqspecError("this model is not accelerated: nothing to undo")
    handle.undo()
