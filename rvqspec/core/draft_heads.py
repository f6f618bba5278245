"""Int8 copies of the heads, for ranking draft candidates on the CPU.

A round drafts K codes ahead with K heads, each a [V, H] matrix read from memory for one row: most of the head
reads of a round. Drafts need only the top-m candidates, never a distribution, and a draft cannot change what is
emitted (the walk draws from the exact heads), only how often it is accepted; so they rank with per-row int8 copies
of the heads (half the bytes of bfloat16, a quarter of float32's) in the scheme `quantize.draft_scheme` names: w8a8
on rvqspec's own int8 kernel where it runs (one native call, the row quantized inside it: rounding the activations
can only swap near-tied candidates), else w8a16 (torch's weight-only kernel). Where that measured faster than the
exact head (`DevicePath.int8_drafts`: w8a8 is, on every class measured, bfloat16 and float32); float64 (tests) and
accelerators keep the exact heads. The copies are kept with the model's heads (`core/heads.py`), made on first use
and again when the heads change; docs/cpu-fast-path.md has the figures.
"""

import torch
from torch import Tensor

from rvqspec.core.device_path import DevicePath
from rvqspec.core.heads import DraftHeads
from rvqspec.core.model import by_codebook
from rvqspec.core.quantize import W8A16_MULTIPLE


def supported(model) -> bool:
    """The kernel takes input widths that are multiples of 16 only; other models rank with their exact heads."""
    return model.config.hidden_size % W8A16_MULTIPLE == 0


def logits(model, hidden: Tensor, codebooks: list[int] | Tensor, path: DevicePath) -> Tensor:
    """Approximate logits [R, V] of hidden [R, H], row r through the head of codebooks[r]: for ranking only. The int8
    copies where `path.int8_drafts` and the model's heads are float; else the exact heads."""
    if model.is_quantized or not path.int8_drafts or not supported(model):
        return model.head_logits(hidden, codebooks, path)  # a quantized model's heads are int8 already
    return by_codebook(hidden, codebooks, model.config.vocab_size, model.head_set.draft_heads(model.heads).logits)


def one_call(model, positions: list[int] | Tensor, path: DevicePath) -> DraftHeads | None:
    """The int8 copies that run a round's draft heads as one native call (`span_logits`), where they are one matmul
    (`heads.DraftHeads`) and every row is at one position (so its depths' heads are neighbours), read on the host;
    else None."""
    if not (path.int8_drafts and isinstance(positions, list) and len(set(positions)) == 1) or model.is_quantized \
            or not supported(model):
        return None
    drafts = model.head_set.draft_heads(model.heads)
    return drafts if isinstance(drafts, DraftHeads) else None


def span_logits(drafts: DraftHeads, inputs: list[Tensor], first: int) -> Tensor:
    """Rank-only logits [B, D, V]: depth j's input inputs[j-1] [B, H] through the head of codebook first+j-1, for
    j = 1..D, in one call. One input for every depth (ReusedHeads): its rows through the D heads; else every depth's
    rows through every head, each depth's own head kept (D x the products at D x B rows, which cost about one row's
    time: the weights' bytes set it)."""
    depth, vocab = len(inputs), drafts.vocab
    if all(x is inputs[0] for x in inputs):
        return drafts.span(inputs[0], first, depth).view(len(inputs[0]), depth, vocab)
    every = drafts.span(torch.stack(inputs), first, depth).view(depth, -1, depth, vocab)  # [input depth, B, head, V]
    return every.diagonal(dim1=0, dim2=2).permute(0, 2, 1)
