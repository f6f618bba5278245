"""The CPU fast path of a cached forward: the decoder layer's elementwise work in a few fused C++ kernels.

A layer's plain forward runs ~50 small ATen ops besides its matmuls (norms with their float32 casts, q/k
norms, RoPE's chunk/cat/neg, SiLU x up, residual adds, two cache writes). At the 1..65 rows of decoding
each costs dispatcher overhead, and their cost grows with the rows of a speculative call
(benchmarks/results/round-profile.md). Here they are 4 kernels per layer (`fused.cpp`): q/k norm + RoPE +
cache write, SiLU x up, and residual add + the next RMSNorm (twice); the prepacked matmuls stay, and the
predictor's attention over the cache (and a talker step's) is a kernel too (`attention_in_order`: each query's keys
in position order, so a verify call's rows get their AR steps' bits; faster than SDPA at a frame's 1..33 queries). AR
and speculative calls take the same path, so AR keeps being our fastest AR. Where every layer matrix is w8a8 on
rvqspec's int8 GEMMs, or bfloat16 on its bfloat16 GEMM, the whole stack is one native call (`int8_layers`: the same
kernels in the same order; on 2 threads one parallel region, `Team` in kernels.h).

int8.cpp, built into the same module, holds the integer side of int8 weights (`quantize`: w8a8's token quantization,
and the int8 GEMMs of x86 CPUs without int8 dot products, which the fast-path switch leaves on: they are the schemes'
kernels there). The kernels are built on first use with torch.utils.cpp_extension (needs ninja, `pip install
'rvqspec[fast]'`, and a C++ compiler), compiled for this CPU and cached by torch (~/.cache/torch_extensions). Where
they cannot be built, decoding takes the plain path after one warning. `RVQSPEC_FUSED=0` (the default of every thread)
or `enabled(False)` (for a block, in its own thread or task only) turns the whole CPU fast path off (these
kernels, the int8 draft heads of `draft_heads` and the early-stopping walk `walk.walk_on_host`; where each applies:
`device_path`), e.g. to time the plain path side by side (benchmarks/fused_path.py).

snake.cpp, in the same module, holds the 12 Hz speech decoder's activation in one pass (`qwen_tts_audio.snake`).
"""

import contextvars
import hashlib
import os
import platform
import threading
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from rvqspec.core import cpu_class

SOURCES = [Path(__file__).with_name(name) for name in ("fused.cpp", "int8.cpp", "bf16.cpp", "snake.cpp")]  # + kernels.h
HEADER = Path(__file__).with_name("kernels.h")
UNIT = Path(__file__).with_name("kernels.cpp")  # what is compiled: SOURCES included into one translation unit
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

_state = {"module": None, "tried": False}
_lock = threading.Lock()
# The fast-path switch of the current thread (or task): `enabled` sets it for a block; RVQSPEC_FUSED the default.
_enabled = contextvars.ContextVar("rvqspec_fused", default=os.environ.get("RVQSPEC_FUSED", "1") != "0")


def build_name() -> str:
    """One build per source, torch, CPU flags and class: it is compiled with -march=native, less what a cap forbids.
    And per folder of the sources: torch's build folder holds the sources' paths, so two checkouts (or environments)
    that shared a build would rebuild it each time the other one loaded it."""
    key = b"".join(path.read_bytes() for path in (*SOURCES, HEADER, UNIT)) + torch.__version__.encode() \
        + str(HEADER.resolve().parent).encode() \
        + " ".join(sorted(cpu_class.cpu_flags())).encode() \
        + " ".join(cflags()).encode()
    return "rvqspec_fused_" + hashlib.sha256(key).hexdigest()[:12]


def cflags() -> list[str]:
    """For this CPU under its caps (`cpu_class`): 512-bit vectors where the class has AVX-512 (gcc prefers 256 by
    default), none of its instructions (nor AVX-VNNI's) where a cap (ONEDNN_MAX_CPU_ISA=AVX2...) leaves a CPU that has
    them without."""
    flags = ["-O3", "-march=native", "-fopenmp-simd", *openmp()]
    if platform.machine() not in ("x86_64", "AMD64"):
        return flags
    cls, has = cpu_class.cpu_class(), cpu_class.cpu_flags()
    if cls.startswith(("avx512", "amx")):
        return flags + ["-mprefer-vector-width=512"]
    return flags + ["-mno-avx512f"] * ("avx512f" in has) + ["-mno-avxvnni"] * ("avx_vnni" in has and cls != "avx2-vnni")


def openmp() -> list[str]:
    """["-fopenmp"] where torch's ATen runs its parallel loops on OpenMP (Linux wheels: its own libgomp.so.1, which
    the kernels then share by its soname, so torch.set_num_threads sets their thread count too). Without it
    at::parallel_for compiles to a plain loop: every kernel ran on one thread whatever torch's thread count."""
    on_openmp = "parallel backend: OpenMP" in torch.__config__.parallel_info()
    return ["-fopenmp"] if platform.system() == "Linux" and on_openmp else []


def on_huge_pages(t: Tensor) -> Tensor:
    """A contiguous copy of `t` on transparent huge pages where it is a CPU tensor of 2 MiB or more, the kernels are
    built and the OS gives them (`int8.cpp`: huge_pages), else `t` contiguous: packed weights that a call streams from
    memory (docs/cpu-fast-path.md, "Huge pages")."""
    module = kernels() if t.device.type == "cpu" else None
    return module.huge_pages(t) if module is not None else t.contiguous()


def kernels():
    """The compiled kernels, or None where they cannot be built (warned about once)."""
    if _state["tried"]:  # the hot path: decided already (set once the attempt is over), no lock
        return _state["module"]
    with _lock:
        if not _state["tried"]:
            try:
                from torch.utils.cpp_extension import load
                with ninja_on_path():
                    _state["module"] = load(build_name(), [str(UNIT)], extra_cflags=cflags(),
                                            extra_ldflags=openmp(), verbose=False)
            except Exception as e:  # no ninja, no compiler, a read-only cache...: the plain path still works
                warnings.warn(f"rvqspec: the fused CPU kernels could not be built ({type(e).__name__}: "
                              f"{str(e).strip().splitlines()[-1] if str(e).strip() else e}); decoding takes the "
                              "plain, slower path. Install ninja and a C++ compiler (`pip install 'rvqspec[fast]'`) "
                              "to get it.", RuntimeWarning, stacklevel=3)
            _state["tried"] = True
        return _state["module"]


@contextmanager
def ninja_on_path():
    """torch runs `ninja` from PATH; the pip package's binary is not on it when the venv is not activated: put it
    there for the build only, and give the process its PATH back after."""
    try:
        import ninja
    except ImportError:
        ninja = None
    before = os.environ.get("PATH", "")
    if ninja is None or ninja.BIN_DIR in before.split(os.pathsep):
        yield
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + before
    try:
        yield
    finally:
        os.environ["PATH"] = before


@contextmanager
def enabled(on: bool):
    """Turn the CPU fast path on or off inside the block, for this thread (or task) only (e.g. to time or test the
    plain path); other threads keep theirs."""
    token = _enabled.set(on)
    try:
        yield
    finally:
        _enabled.reset(token)


def on() -> bool:
    """Whether the CPU fast path is switched on for this thread: these kernels, the int8 draft heads and the
    early-stopping walk (where each applies: `device_path.choose`)."""
    return _enabled.get()


def layers(model, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, cache, slots: Tensor | None,
           attention) -> Tensor:
    """model.forward's layer loop and final norm with the fused kernels (same inputs as the plain loop; `attention`:
    how queries attend over the cache, `packing.attention` as in the plain loop or `attention_in_order`, which returns
    the layout the output projection reads). Without a cache (teacher forcing under
    no_grad) the K/V go to a cache of the call's own, attended causally."""
    ops, blocks, eps = kernels(), model.layers, model.config.rms_norm_eps
    length, d = x.shape[1], cos.shape[-1]
    causal = cache is None and mask is None
    if cache is None:
        cache, slots = model.new_cache(len(x), length), torch.arange(length, device=x.device)
    cos, sin = cos.reshape(-1, length, d), sin.reshape(-1, length, d)  # [T, D] or [B, 1, T, D] -> [Bc, T, D]
    native = None if causal or attention is not attention_in_order else int8_stack(model, len(x) * length)
    if native is not None:
        return ops.int8_layers(x, *native, cos, sin, mask, cache.kv, slots, eps, blocks[0].attn.heads,
                               blocks[0].attn.kv_heads)
    h = ops.rms_norm(x, blocks[0].attn_norm.weight, eps)
    for i, block in enumerate(blocks):
        attn = block.attn
        q = ops.qkv_rope(attn.wqkv(h), weight(attn.q_norm), weight(attn.k_norm), cos, sin, eps, attn.heads,
                         attn.kv_heads, cache.kv[i, 0], cache.kv[i, 1], slots)
        y = F.scaled_dot_product_attention(q, cache.kv[i, 0], cache.kv[i, 1], is_causal=True, enable_gqa=True) \
            if causal else attention(q, cache.kv[i, 0], cache.kv[i, 1], mask)
        x, h = ops.add_rms_norm(x, attn.wo(y.transpose(1, 2).reshape(*x.shape[:2], -1)), block.mlp_norm.weight, eps)
        after = blocks[i + 1].attn_norm if i + 1 < len(blocks) else model.norm
        x, h = ops.add_rms_norm(x, block.mlp.w_down(ops.silu_mul(block.mlp.w_gate_up(h))), after.weight, eps)
    return h


def int8_stack(model, rows: int) -> tuple[list, list, list, list[int]] | None:
    """What `fused.cpp`'s int8_layers takes to run `model`'s decoder stack in one native call (the same kernels, the
    same bits), where every layer matrix is w8a8 on rvqspec's int8 GEMMs in a call of `rows` rows (`Int8Matmul.native`)
    or bfloat16 on rvqspec's bfloat16 GEMM (`packing.Linear.native`), without bias or hooks: the norms' weights (each
    layer's attn_norm, mlp_norm, then the final norm), the q/k norms' (None: none), each matrix's packed weights and
    width (qkv, o, gate+up, down per layer). Else None. Read per call (weights may be swapped or repacked), through
    the modules' dicts: nn.Module's __getattr__ took ~100 us here (5 layers)."""
    norms, qk, packed, widths = [], [], [], []
    for block in model.layers:
        parts = block._modules
        attn, mlp = parts["attn"]._modules, parts["mlp"]._modules
        for linear in (attn["wqkv"], attn["wo"], mlp["w_gate_up"], mlp["w_down"]):
            matmul = linear.__dict__.get("matmul", linear)  # an int8 matrix's, or a bfloat16 Linear itself
            hooked = linear._forward_hooks or linear._forward_pre_hooks
            plain = hasattr(type(matmul), "native") and linear.bias is None and not hooked
            weights = matmul.native(rows) if plain else None
            if weights is None:
                return None
            packed.append(weights)
            widths.append(matmul.out_features)
        norms += [parts["attn_norm"]._parameters["weight"], parts["mlp_norm"]._parameters["weight"]]
        qk += [attn["q_norm"]._parameters.get("weight"), attn["k_norm"]._parameters.get("weight")]
    return norms + [model.norm.weight], qk, packed, widths


def attention_in_order(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """`packing.attention`'s result (queries q [B, H, T, D] over the cache k, v [B, KV, S, D] under an additive mask)
    with reductions that depend on nothing but each query's visible keys, visited in position order (`fused.cpp`):
    a query has the same bits in an AR step as in a verify call, alone or in any batch. For the predictor's calls
    and the talker's steps (one query per row); a talker's prefill (hundreds of queries) keeps SDPA's blocks."""
    return kernels().attention(q, k, v, mask)


def weight(norm) -> Tensor | None:
    """A q/k norm's weight; None for layers without one (Llama-style: an Identity), where the kernel applies RoPE
    alone."""
    return getattr(norm, "weight", None)
