"""Which implementation each part of a call takes on its device and dtype: decided here, once, for the whole engine.

The speculative round (`decode.speculative_round`), the drafters, the model's forward and its matmuls read
`choose(device, dtype)` and nothing else:

- static_shapes: every depth is drafted and walked, even near the frame end (rows past it are masked), so that a
  round's work depends only on (B, N) and can be captured and replayed. Accelerators. On the CPU the depths no
  row can reach are skipped instead (their heads cost time).
- host_walk: the walk reads each depth's draws and stops at the first depth without a match (`walk.walk_on_host`);
  a host read costs nothing on the CPU. Elsewhere `walk.walk_on_device` visits every depth without a read.
- int8_drafts: drafts rank their top-m candidates with int8 copies of the heads (`draft_heads`): where the int8
  kernel is faster than the exact head (the CPU in bfloat16, docs/cpu-fast-path.md). A draft never changes what
  is emitted, only how often it is accepted.
- fused_kernels: the layer's elementwise work in the fused C++ kernels (`fused`), where they are built.
- packed_weights: the large matmuls through oneDNN-prepacked copies of the weights (`packing`).

The CPU fast path (host walk, int8 drafts, fused kernels) switches off as one with `RVQSPEC_FUSED=0` or
`fused.enabled(False)`; training and torch.compile take the plain path.
"""

import functools
from dataclasses import dataclass

import torch

from rvqspec.engine import fused

INT8_DRAFT_DTYPES = (torch.bfloat16,)
MKLDNN_BF16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


@dataclass(frozen=True)
class DevicePath:
    static_shapes: bool
    host_walk: bool
    int8_drafts: bool
    fused_kernels: bool
    packed_weights: bool


def static_shapes(device: torch.device) -> bool:
    """Accelerators keep a round's shapes fixed by (B, N) (see the module docstring)."""
    return device.type != "cpu"


def choose(device: torch.device | str, dtype: torch.dtype) -> DevicePath:
    """The path of a call on `device` in `dtype`, in the current grad/compile mode and fast-path switch (read per
    call; the answer for each combination is made once: the model's matmuls ask on every call)."""
    device = device if isinstance(device, torch.device) else torch.device(device)
    cpu = device.type == "cpu"
    inference = not torch.is_grad_enabled() and not torch.compiler.is_compiling()
    fast = cpu and fused.on()
    built = fast and inference and dtype in fused.DTYPES and fused.kernels() is not None
    return path_of(cpu, static_shapes(device), dtype, inference, fast, built, torch.backends.mkldnn.enabled)


@functools.cache
def path_of(cpu: bool, static: bool, dtype: torch.dtype, inference: bool, fast: bool, built: bool,
            mkldnn: bool) -> DevicePath:
    return DevicePath(
        static_shapes=static, host_walk=fast and not static,
        int8_drafts=fast and inference and dtype in INT8_DRAFT_DTYPES, fused_kernels=built,
        packed_weights=cpu and inference and mkldnn and ((dtype == torch.bfloat16 and MKLDNN_BF16)
                                                         or dtype == torch.float32))
