"""The weight layout of rvqspec's bfloat16 kernel (`bf16.cpp`: bf16_linear, AVX-512 BF16), which `packing.linear`
takes where `device_path` measured it faster than oneDNN (`MatmulChoice.bf16_kernel`)."""

import torch
from torch import Tensor

from rvqspec.core import fused

COLS = 16  # output channels per block; input values go in pairs (the pairs vdpbf16ps multiplies)


def pack_bf16(weight: Tensor) -> Tensor:
    """A bfloat16 weight [N, K] as [ceil(N/16), ceil(K/2), 16, 2], zero-padded: a block of 16 channels streams
    contiguously, two input values per channel and step; on huge pages (`fused.on_huge_pages`: 0.88x the time at 9
    rows, 1.01x at one, Zen 4, docs/cpu-fast-path.md)."""
    n, k = weight.shape
    cols, depth = -(-n // COLS) * COLS, -(-k // 2) * 2
    padded = torch.zeros(cols, depth, dtype=torch.bfloat16, device=weight.device)
    padded[:n, :k] = weight
    return fused.on_huge_pages(padded.reshape(cols // COLS, COLS, depth // 2, 2).permute(0, 2, 1, 3))
