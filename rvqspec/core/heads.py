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
from rvqspec.core.quantize import VNNI_COLS, Int8Matmul, QuantizedHeads, draft_scheme, native_w8a8


class DraftHeads:
    """Every head's int8 copy as one w8a8 matmul [(G-1) V, H] on rvqspec's kernel: a round's K draft heads (codebooks
    k+1..k+K, neighbours) are one native call over a slice of its packed rows (views), not K calls and a stack."""

    def __init__(self, heads: Tensor):
        self.count, self.vocab = heads.shape[0], heads.shape[1]
        self.matmul = Int8Matmul(heads.reshape(-1, heads.shape[-1]), "w8a8")

    def span(self, hidden: Tensor, first: int, count: int) -> Tensor:
        """Logits [..., count * V] of codebooks first..first+count-1 (1..G-1) from hidden [..., H]."""
        packed = self.matmul.native(hidden.numel() // hidden.shape[-1])
        if packed is None:  # an AMX CPU's call of many rows: oneDNN's, over every head
            return self.matmul(hidden)[..., (first - 1) * self.vocab:(first - 1 + count) * self.vocab]
        begin, end = first - 1, first - 1 + count  # each packed tensor holds whole heads: V a multiple of VNNI_COLS
        part = [t[len(t) * begin // self.count:len(t) * end // self.count] for t in packed]
        return native_w8a8(hidden, part, count * self.vocab)

    def logits(self, hidden: Tensor, codebook: int) -> Tensor:
        return self.span(hidden, codebook, 1)

    def rows(self) -> tuple[Tensor, Tensor]:
        """(int8 heads [G-1, V, H], scales [G-1, V]), as `QuantizedHeads.rows`."""
        q, scale = self.matmul.rows()
        return q.reshape(self.count, self.vocab, -1), scale.reshape(self.count, self.vocab)


def draft_copies(heads: Tensor) -> DraftHeads | QuantizedHeads:
    """The heads' int8 copies that rank drafts: one matmul (`DraftHeads`) in w8a8 where the vocabulary fills whole
    packed blocks, else one per head."""
    scheme = draft_scheme()
    return DraftHeads(heads) if scheme == "w8a8" and heads.shape[1] % VNNI_COLS == 0 else QuantizedHeads(heads, scheme)


class Heads:
    """A float model's derived head copies (`count` packs, int8 draft copies), or a quantized model's `int8` heads."""

    def __init__(self, count: int, int8: QuantizedHeads | None = None):
        self.int8 = int8
        self.packs = [PackedWeight() for _ in range(count)] if int8 is None else []
        self.drafts: Derived[DraftHeads | QuantizedHeads] = Derived(draft_copies)

    def logits(self, heads: Tensor | None, hidden: Tensor, codebook: int) -> Tensor:
        """Logits of codebook `codebook` (1..G-1) from hidden states [..., H]; `heads`: the model's float heads (None
        when quantized)."""
        if self.int8 is not None:
            return self.int8.logits(hidden, codebook)
        return linear(hidden, heads[codebook - 1], None, self.packs[codebook - 1])

    def draft_heads(self, heads: Tensor) -> DraftHeads | QuantizedHeads:
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
