"""The predictor's heads as decoding multiplies them, in one place.

A float model's heads are its `heads` parameter [G-1, V, H] (the state_dict's `heads`, what training and saving read);
what decoding derives from it lives here: each head's oneDNN packed copy (`packing.PackedWeight`) and the int8 copies
that rank drafts (`core/draft_heads.py` says why), both made on first use and again when the heads change
(`changes.Derived`). A quantized model (`core/quantize.py`) has no float heads: here are its int8 heads, the only
ones it has. The weight is passed in rather than held, so that whatever replaces the model's parameter (`.to()`,
`load_state_dict(assign=True)`) is what the next call multiplies.
"""

from torch import Tensor

from rvqspec.core.changes import Derived
from rvqspec.core.packing import PackedWeight, linear
from rvqspec.core.quantize import QuantizedHeads, draft_scheme


def draft_copies(heads: Tensor) -> QuantizedHeads:
    return QuantizedHeads(heads, draft_scheme())


class Heads:
    """A float model's derived head copies (`count` packs, int8 draft copies), or a quantized model's `int8` heads."""

    def __init__(self, count: int, int8: QuantizedHeads | None = None):
        self.int8 = int8
        self.packs = [PackedWeight() for _ in range(count)] if int8 is None else []
        self.drafts: Derived[QuantizedHeads] = Derived(draft_copies)

    def logits(self, heads: Tensor | None, hidden: Tensor, codebook: int) -> Tensor:
        """Logits of codebook `codebook` (1..G-1) from hidden states [..., H]; `heads`: the model's float heads (None
        when quantized)."""
        if self.int8 is not None:
            return self.int8.logits(hidden, codebook)
        return linear(hidden, heads[codebook - 1], None, self.packs[codebook - 1])

    def draft_heads(self, heads: Tensor) -> QuantizedHeads:
        """The int8 copies of the float `heads` that rank drafts."""
        return self.drafts.get(heads)

    def quantize(self, heads: Tensor, scheme: str) -> None:
        """Hold int8 copies of the float `heads` under `scheme` from now on (`rvqspec.quantize`, on its copy of the
        model): the quantized model's only heads, nothing derived."""
        self.int8, self.packs = QuantizedHeads(heads, scheme), []
        self.drafts.forget()

    def forget(self) -> None:
        """Drop what was derived from the float heads (they changed through `.data`: `MultiCodeDecoder.refresh`)."""
        for pack in self.packs:
            pack.forget()
        self.drafts.forget()
