"""Int8 copies of the heads, for ranking draft candidates on the CPU.

A round drafts K codes ahead with K heads, each a [V, H] matrix read from memory for one row: most of the head
reads of a round. Drafts need only the top-m candidates, never a distribution, and a draft cannot change what is
emitted (the walk draws from the exact heads), only how often it is accepted; so in bfloat16 they rank with per-row
int8 copies of the heads (half the bytes) through `torch.ops.aten._weight_int8pack_mm`, faster there than the exact
head. Its float32 kernel is slower than the exact head (both measured in docs/cpu-fast-path.md), so float32,
float64 (tests) and accelerators keep the exact heads (`device_path.choose(...).int8_drafts`).
"""

import threading

import torch
from torch import Tensor

from rvqspec.engine import device_path

_lock = threading.Lock()


def quantize(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-row int8: weight ~ q * scale[:, None]."""
    w = weight.detach().float()
    scale = w.abs().amax(1).clamp(min=1e-12) / 127
    return (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale.to(weight.dtype)


def quantized(model) -> list[tuple[Tensor, Tensor]]:
    """The int8 heads of `model`, rebuilt when its heads change (new tensor, in-place write or dtype)."""
    heads = model.heads
    key = (heads.data_ptr(), heads._version, heads.dtype)
    with _lock:
        if model.int8_heads is None or model.int8_heads[0] != key:
            model.int8_heads = (key, [quantize(head) for head in heads])
        return model.int8_heads[1]


def logits(model, hidden: Tensor, codebooks: list[int]) -> Tensor:
    """Approximate logits [R, V] of hidden [R, H], row r through the head of codebooks[r]: for ranking only."""
    if model.head_weights is not None or not device_path.choose(hidden.device, hidden.dtype).int8_drafts:
        return model.head_logits(hidden, codebooks)  # a quantized model's heads are int8 already
    heads, hidden = quantized(model), hidden.contiguous()
    if len(set(codebooks)) == 1:
        return torch.ops.aten._weight_int8pack_mm(hidden, *heads[codebooks[0] - 1])
    books, out = torch.tensor(codebooks), hidden.new_empty(len(codebooks), model.config.vocab_size)
    for book in sorted(set(codebooks)):
        rows = (books == book).nonzero().squeeze(1)
        out[rows] = torch.ops.aten._weight_int8pack_mm(hidden[rows], *heads[book - 1])
    return out
