"""Prepacked oneDNN weights for CPU inference: the model's matrices, multiplied as decoding needs them.

For the 1..65-row calls of decoding, PyTorch's default bf16 path re-lays out the weight on every call and MKL's
fp32 GEMM is slow for 2..65 rows: `python benchmarks/packed_linear.py` measured the packed path faster at every row
count in bf16 on the AMX machine, and in fp32 from a few rows on but slower for 1 row, which stays on MKL's GEMV.
Which of the two runs one row and which many is measured on the user's CPU (`device_path.measure`), and so is the
row floor that makes a kernel give each row the same bits in any call (`MatmulChoice.pad_rows`): a call of fewer
rows is padded with copies of its last row. oneDNN costs a fixed overhead per call, more than small products take,
hence the size floor.

bfloat16 on CPUs with AVX-512 BF16 takes rvqspec's kernel instead where it measured faster
(`MatmulChoice.bf16_kernel`; `bf16.cpp`): every output one chain of bfloat16 pair products in float32, in the same
order whatever the call's rows, so a row has the same bits alone and in any call with no padding; on a Zen 4 it reads
the weights at ~85% of the copy bandwidth for one row where oneDNN reads them at ~50%
(benchmarks/results/bf16-rows.md).
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rvqspec.core import device_path, fused
from rvqspec.core.bf16 import pack_bf16
from rvqspec.core.changes import Derived

PACK_MIN_ELEMENTS = 1 << 20
PACK_ROWS_HINT = 32  # oneDNN chooses the packed layout for this many rows


def packed_layout(weight: Tensor, rows: int = PACK_ROWS_HINT) -> Tensor:
    """`weight` [out, in] in oneDNN's packed layout for calls of about `rows` rows."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, rows)


class PackedWeight(Derived[Tensor]):
    """A oneDNN-prepacked copy of a weight, made again whenever the weight changes (`changes.Derived`: a new tensor or
    an in-place write on every call; a write through `.data` once per decode, `MultiCodeDecoder.refresh`); `bf16`: the
    copy rvqspec's bfloat16 kernel reads, the same way. Each is made on its first use only."""

    def __init__(self) -> None:
        self.bf16 = Derived(pack_bf16)
        super().__init__(packed_layout)

    def forget(self) -> None:
        super().forget()
        self.bf16.forget()

    def __reduce__(self):
        return PackedWeight, ()


def matmul_choice(x: Tensor, weight: Tensor) -> device_path.MatmulChoice | None:
    """How `x @ weight.T` runs (`device_path`, measured at the 0.6B's shapes): None (plain F.linear) for weights below
    the size floor, other dtypes than the weight's and paths that measure nothing (training, accelerators,
    float64)."""
    if weight.numel() < PACK_MIN_ELEMENTS or x.dtype != weight.dtype:
        return None
    return device_path.choose(x.device, x.dtype).matmul


def linear(x: Tensor, weight: Tensor, bias: Tensor | None, pack: PackedWeight) -> Tensor:
    """F.linear, through rvqspec's bfloat16 kernel or the prepacked copy in `pack` where that measured faster, on at
    least the measured row floor (a smaller call padded, then cut back; the bfloat16 kernel needs none)."""
    choice = matmul_choice(x, weight)
    if choice is None:
        return F.linear(x, weight, bias)
    if choice.bf16_kernel:
        return fused.kernels().bf16_linear(x, pack.bf16.get(weight), bias, weight.shape[0])
    rows = x.numel() // x.shape[-1]
    if rows < choice.pad_rows:
        flat = x.reshape(rows, x.shape[-1])
        padded = torch.cat([flat, flat[-1:].expand(choice.pad_rows - rows, -1)])
        return linear(padded, weight, bias, pack)[:rows].reshape(*x.shape[:-1], -1)
    if choice.packed_one if rows == 1 else choice.packed_many:
        return torch.ops.mkldnn._linear_pointwise(x, pack.get(weight), bias, "none", [], "")
    return F.linear(x, weight, bias)


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """SDPA of queries q [B, H, T, D] over the cache k, v under `mask` ([T, S] or [B, 1, T, S]), with fewer queries
    than the measured floor padded by copies of the last (`MatmulChoice.attention_rows`): the AR step's one query
    then gets the bits it gets inside a verify call of the same slots. Its sums still depend on where masked keys lie
    (a verify call holds a tree node at a scratch slot, the AR step at its position): the predictor's fast path
    attends with `fused.attention_in_order` instead, and so do talker steps; this serves a talker's prefill and the
    plain path."""
    choice = device_path.choose(q.device, q.dtype).matmul
    rows, floor = q.shape[-2], choice.attention_rows if choice else 1
    if rows >= floor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    q = torch.cat([q, q[..., -1:, :].expand(*q.shape[:-2], floor - rows, -1)], dim=-2)
    mask = torch.cat([mask, mask[..., -1:, :].expand(*mask.shape[:-2], floor - rows, -1)], dim=-2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)[..., :rows, :]


class Linear(nn.Linear):
    """nn.Linear with the prepacked CPU inference path of `linear` (same parameters and state dict)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pack = PackedWeight()

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias, self.pack)

    def native(self, rows: int) -> tuple[Tensor] | None:
        """The weight as rvqspec's bfloat16 kernel reads it where `linear` runs this matrix's bfloat16 calls on it
        (any rows), for a native stack (`fused.int8_stack`); else None. Through the module's dict (nn.Module's
        __getattr__ is slow)."""
        weight = self._parameters["weight"]
        choice = matmul_choice(weight, weight) if weight.dtype == torch.bfloat16 else None
        return (self.pack.bf16.get(weight),) if choice is not None and choice.bf16_kernel else None
