"""The deployed sampler's draw as one native call (`draw.cpp`), where `Sampler.sample_noise` can take it.

A draw through torch is ~7 ops on [n, V] (the temperature, top-k, masked_fill, softmax, / noise, argmax), ~60 us of
dispatch each on a CPU, and a speculative predictor frame makes ~20 of them. `draw.cpp` makes the same draw per row
in one call: scalar, in a fixed order, with an exp of its own, built without contraction and for no particular CPU, so
its bits are the same on every CPU class. It covers do_sample with top_p == 1 (the deployed sampler, any temperature
and top-k); top-p, accelerators and the plain path (`RVQSPEC_FUSED=0`, `fused.enabled(False)`) keep torch's ops.

Against torch's softmax the probabilities differ in their last bits, so at a near-tie of p / noise between two tokens
a seeded draw may pick the other one: codes seeded before this path can differ there, rarely. AR and speculative
decoding draw through the same call, so a seeded speculative frame still draws exactly the AR frame's codes.

The noise may also come as the float64 uniforms it is made of (`sampling.fill_noise`, where `takes_uniforms`): torch's
exponential_ draws each Exp(1) value as float(-log1p(-u)) from one float64 uniform u, so a generator's uniform_ on a
float64 buffer takes the same stream and gives the same values once transformed. The draw transforms the ~top-k
values of a row it reads, not V: a frame's noise costs a uniform_ (~0.13 ms for 15 x 2048 here) instead of an
exponential_ (~0.6 ms, a log per value).

Built on first use with torch.utils.cpp_extension, like the fused kernels (`fused.py`); where it cannot be built
the draws take torch's ops after one warning.
"""

import hashlib
import threading
import warnings
from pathlib import Path

import torch
from torch import Tensor

from rvqspec.core import fused

SOURCE = Path(__file__).with_name("draw.cpp")
CFLAGS = ["-O3", "-ffp-contract=off"]  # no -march, no fast-math: one build's bits on every CPU class

_state = {"module": None, "tried": False}
_lock = threading.Lock()


def build_name() -> str:
    """One build per source, torch and folder of the source (torch's build folder holds its path)."""
    key = SOURCE.read_bytes() + torch.__version__.encode() + str(SOURCE.resolve().parent).encode() \
        + " ".join(CFLAGS).encode()
    return "rvqspec_draw_" + hashlib.sha256(key).hexdigest()[:12]


def kernel():
    """The compiled draw, or None where it cannot be built (warned about once)."""
    if _state["tried"]:
        return _state["module"]
    with _lock:
        if not _state["tried"]:
            try:
                from torch.utils.cpp_extension import load
                with fused.ninja_on_path():
                    _state["module"] = load(build_name(), [str(SOURCE)], extra_cflags=CFLAGS, verbose=False)
            except Exception as e:  # no ninja, no compiler...: torch's ops give the same draws, slower
                warnings.warn(f"rvqspec: the native draw could not be built ({type(e).__name__}); draws take "
                              "torch's ops. Install ninja and a C++ compiler (`pip install 'rvqspec[fast]'`).",
                              RuntimeWarning, stacklevel=3)
            _state["tried"] = True
        return _state["module"]


def native(device: torch.device) -> bool:
    """Whether draws on `device` take the native call: a CPU, the fast path on (asked first: where it is off, nothing
    is built) and the draw built."""
    return device.type == "cpu" and fused.on() and kernel() is not None


def takes_uniforms(device: torch.device, top_p: float) -> bool:
    """Whether draws of a sampler with `top_p` on `device` are native (`Sampler.sample_noise` draws natively without
    top-p), so that a frame's noise can be held as its uniforms."""
    return top_p == 1.0 and native(device)


def draws(logits: Tensor, noise: Tensor, temperature: float, top_k: int) -> Tensor | None:
    """argmax(softmax(top-k(logits / temperature)) / noise) per row of logits [n, V] (any float dtype) and noise
    [n, V]: Exp(1) values (float32) or their uniforms (float64, module docstring): LongTensor [n]; None where the native
    call does not apply (not a CPU tensor, the fast path off, not built). Few Python steps: a frame makes ~15-20 draws,
    each between calls that leave the caches cold."""
    if not native(logits.device):
        return None
    as_is = logits.dtype in (torch.float32, torch.bfloat16)  # bfloat16 widened in the call
    return kernel().draws(logits if as_is else logits.float(), noise, temperature, top_k)
