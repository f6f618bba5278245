"""Prepacked oneDNN weights for CPU inference: the model's matrices, multiplied as decoding needs them.

For the 1..65-row calls of decoding, PyTorch's default bf16 path re-lays out the weight on every call and MKL's
fp32 GEMM is slow for 2..65 rows: `python benchmarks/packed_linear.py` measured the packed path faster at every row
count in bf16 on the AMX machine, and in fp32 from a few rows on but slower for 1 row, which stays on MKL's GEMV.
Which of the two runs one row and which many is measured on the user's CPU (`device_path.measure`), and so is the
row floor that makes a kernel give each row the same bits in any call (`MatmulChoice.pad_rows`): a call of fewer
rows is padded with copies of its last row. oneDNN costs a fixed overhead per call, more than small products take,
hence the size floor.
"""

import threading

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rvqspec.engine import device_path

PACK_MIN_ELEMENTS = 1 << 20
PACK_ROWS_HINT = 32  # oneDNN chooses the packed layout for this many rows


PROBES = 16  # elements of a weight compared by `probe`


def probe(weight: Tensor) -> Tensor:
    """A copy of a few elements spread over `weight`: writes through `.data` (which bump no version counter) show in
    it, whatever they change (a LoRA merge, another checkpoint's values)."""
    flat = weight.detach().reshape(-1)
    where = torch.arange(PROBES, device=flat.device) * (len(flat) - 1) // (PROBES - 1)  # integers: exact at any size
    return flat[where].clone()


class PackedWeight:
    """A oneDNN-prepacked copy of a weight, rebuilt whenever the weight changes: new storage or an in-place write
    (its version counter) on every call, a write through `.data` at `forget_if_changed` (once per decode: see
    `MultiCodeDecoder.refresh`). The lock lets threads that share a model see a packed copy and its source change
    together."""

    def __init__(self) -> None:
        self.source: Tensor | None = None  # holds the packed storage, so a new weight cannot reuse its address
        self.version = -1
        self.packed: Tensor | None = None
        self.probe: Tensor | None = None
        self.lock = threading.Lock()

    def get(self, weight: Tensor) -> Tensor:
        with self.lock:
            source = self.source
            if source is None or weight.data_ptr() != source.data_ptr() or weight.shape != source.shape \
                    or weight._version != self.version:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)
                self.source, self.version, self.probe = weight.detach(), weight._version, probe(weight)
            return self.packed

    def forget_if_changed(self, weight: Tensor) -> None:
        with self.lock:
            if self.source is not None and not torch.equal(probe(weight), self.probe):
                self.source = self.packed = self.probe = None

    def __reduce__(self):  # copies and pickles start empty and pack on first use
        return PackedWeight, ()


def matmul_choice(x: Tensor, weight: Tensor) -> device_path.MatmulChoice | None:
    """How `x @ weight.T` runs (`device_path`, measured at the 0.6B's shapes): None (plain F.linear) for weights below
    the size floor, other dtypes than the weight's and paths that measure nothing (training, accelerators,
    float64)."""
    if weight.numel() < PACK_MIN_ELEMENTS or x.dtype != weight.dtype:
        return None
    return device_path.choose(x.device, x.dtype).matmul


def linear(x: Tensor, weight: Tensor, bias: Tensor | None, pack: PackedWeight) -> Tensor:
    """F.linear, through the prepacked copy in `pack` where that measured faster, on at least the measured row floor
    (a smaller call padded, then cut back)."""
    choice = matmul_choice(x, weight)
    if choice is None:
        return F.linear(x, weight, bias)
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
    then gets the bits it gets inside a verify call."""
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
