"""Quantized weights for CPU inference: `quantize(model, scheme)` gives a new MultiCodeDecoder whose layer matmuls,
input projection (1.7B, CSM) and 15 heads hold int8 weights (symmetric, one scale per output channel); the code tables
stay as they are.

- "w8a16": activations stay in the model's dtype. float32 ones are multiplied by rvqspec's kernel (`int8.cpp`:
  weight bytes widened to float in registers, a fixed order of sums; torch's weight-only kernel took 4-60x float32's
  time there, issue 45), the others by torch's (`torch._weight_int8pack_mm`).
- "w8a8": activations are quantized to int8 per token (symmetric, one scale per row, from that row alone), the
  integer product is exact, and each row is scaled back by its own token scale: exact integer dot products, then
  float roundings that involve only that row. Where the CPU has AVX-512 VNNI rvqspec's VNNI kernel multiplies every
  call (`int8.cpp`: vnni_linear, issue 51: 1.7-1.8x oneDNN's one-row call, one native call per matmul; a 0.6B
  talker's 120-token prefill took 0.99x oneDNN's time on a Zen 4, one thread, so no second copy of the weights is
  kept for prompts) but AMX CPUs' calls of more than VNNI_ROWS rows: the
  activations as unsigned bytes q + 128, the form the VNNI instructions multiply, then 128 x the weight's channel
  sums subtracted in int32, exactly. Those long calls on AMX, and every call on AVX-VNNI CPUs, take oneDNN's
  (`onednn.qlinear_pointwise`, input scale 1, zero point 128: the same form; signed activations
  took oneDNN's reference path on AVX-512 CPUs without AMX: 250-1,900x slower than bfloat16, issue 30). Elsewhere
  on x86 (AVX2; AVX-512 without VNNI), where oneDNN sums byte products in saturating 16-bit
  lanes, rvqspec's AVX2 kernel does (`int8.cpp`: int16 products summed into int32): the same int32 sums and the same
  float steps after them, so the same model gives the same bits on every x86 class (`tests/test_int8.py`). CPUs with
  neither (no AVX2, or the kernels not built) refuse w8a8 (`w8a8_kernel`).

A quantized model is a different model (as the paper's W8A16 is): its codes follow its own distribution, and
speculation is exact relative to it. Both kernels give every row of a call the same bits whatever the other rows
hold (tests/test_quantize.py checks it), and so do the fast path's norms, activation quantization and attention
(`fused.attention_in_order`), so a verify call computes, per token, exactly what its AR step computes: the w8a8
model's speculative codes are its AR codes bit for bit, alone and in any batch (tests/test_bit_exact.py).
What quantization costs against the float model is measured by `benchmarks/quantization_quality.py`.

torch's int8 weight-only kernel reads out of bounds (and crashes) on shapes that are not multiples of 16, so w8a16
pads the output channels to a multiple of 16 and refuses other input widths. It takes 32- and 16-bit float
activations: float64 ones are multiplied in float32 and cast back (as w8a8 does). Weights holding NaN or inf are
refused when quantized, naming the tensor.

Saving. A quantized MultiCodeDecoder's `state_dict()` holds, besides its float tensors (norms, code tables, the
projection's bias), each layer matmul and the input projection as `<layer>.weight_int8` (int8 [out, in]) and
`<layer>.weight_scale` (float32 [out]: weight ~ weight_int8 * weight_scale[:, None]; no padding), the heads as
`heads_int8` (int8 [G-1, V, H]) and `heads_scale` (float32 [G-1, V]), and `scheme` (the scheme's name in ASCII,
uint8). `load_state_dict` restores them exactly into a model of the same config and scheme and refuses another scheme
or shape (`check_state`).
`torch.save`, pickle and deepcopy hold the int8 rows and scales, not the kernels' packed form or the locks.

Memory. Each weight is held once, in the form the kernel that multiplies it reads (`Int8Matmul.forms`: VNNI's blocks,
the AVX2 kernel's, oneDNN's prepacked tensor, or torch's plain rows for w8a16), packed as it is quantized, one matrix
at a time; the plain int8 rows that a state_dict holds are unpacked from it when asked for (`rows()`).
"""

import copy
import threading
from collections.abc import Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rvqspec.core import cpu_class, fused
from rvqspec.core.errors import RvqspecError

SCHEMES = ("w8a16", "w8a8")
FLOAT = "float"  # MultiCodeDecoder.weights of a model that is not quantized
W8A16_MULTIPLE = 16
W8A16_ACTIVATIONS = (torch.float32, torch.bfloat16, torch.float16)  # what torch's kernel takes
ZERO_POINT = 128  # w8a8's activations as unsigned bytes: q + 128 (oneDNN)
PACK_COLS, PACK_DEPTH = 4, 16  # rvqspec's AVX2 int8 kernels read blocks of 4 output channels x 16 input values
VNNI_COLS, VNNI_DEPTH = 16, 16  # its VNNI kernel: blocks of 16 channels, K padded to a multiple of 16
VNNI_ROWS = 64  # on AMX CPUs calls of more rows take oneDNN's int8 GEMM (prefill: AMX's tiles)


def quantize_rows(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-row int8: weight ~ q * scale[:, None] (scale float32)."""
    w = weight.detach().float()
    scale = w.abs().amax(1).clamp(min=1e-12) / 127
    return (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale


def quantize_tokens(x: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-row int8 of activations x [M, K]: (q + ZERO_POINT [M, K] uint8, scale [M, 1] float32), each row
    alone; a row holding NaN or inf gets scale NaN and q = 0, so its output is NaN. The CPU fast path computes the
    same bits in one kernel (`fused.cpp`: quantize_rows, and scale_rows on the way back)."""
    x = x.float()
    finite = x.isfinite().all(1, keepdim=True)
    scale = x.abs().amax(1, keepdim=True).clamp(min=1e-12) / 127
    q = (x / scale).round_().clamp_(-127, 127).where(finite, 0)
    return (q + ZERO_POINT).to(torch.uint8), scale.where(finite, torch.nan)


def check_scheme(scheme: str) -> str:
    """`scheme`, if it is one and this CPU can run it exactly."""
    if scheme not in SCHEMES:
        raise RvqspecError(f"unknown weights scheme {scheme!r}: use one of {', '.join(SCHEMES)} (or leave the "
                           "weights as they are)")
    if scheme == "w8a8" and w8a8_kernel() is None:
        fix = ("install ninja and a C++ compiler (`pip install 'rvqspec[fast]'`) for rvqspec's AVX2 int8 kernel"
               if cpu_class.has_avx2() else "keep the float weights (bfloat16 where the CPU has it, else float32)")
        raise RvqspecError(f"w8a8 needs int8 dot-product instructions (VNNI, AMX) or rvqspec's AVX2 int8 kernel, "
                           f"which this CPU or build lacks ({cpu_class.describe()}): {fix}")
    return scheme


def w8a8_kernel() -> str | None:
    """Which exact int8 GEMM runs w8a8 here: "vnni" (rvqspec's AVX-512 VNNI kernel) where the class has AVX-512 VNNI
    and the kernels are built with it, "onednn" on other classes with int8 dot products (AVX-VNNI), "avx2" (rvqspec's)
    on other x86 classes where the kernels are built, None where neither (w8a8 is refused)."""
    kernels = int8_kernels()
    if kernels is not None and cpu_class.has_avx512_vnni() and kernels.has_vnni_gemm():
        return "vnni"
    if cpu_class.has_int8_dot():
        return "onednn"
    return "avx2" if kernels is not None else None


def draft_scheme() -> str:
    """The scheme of the int8 copies that rank drafts (`heads`, `draft_heads`): w8a8 where rvqspec's kernel runs it
    (one native call that also quantizes the row: drafts only rank, so the activations' rounding costs nothing but a
    rare swap of near-tied candidates), else w8a16 (weights only, activations in the model's dtype)."""
    return "w8a8" if w8a8_kernel() in ("vnni", "avx2") else "w8a16"


def native_w8a8(x: Tensor, packed: tuple[Tensor, ...], out_features: int) -> Tensor:
    """x [..., K] -> [..., out_features] through rvqspec's w8a8 kernel of `packed`: pack_vnni's three tensors (VNNI)
    or pack_int8's two (AVX2), as `Int8Matmul.native` gives them (or slices of whole blocks of them)."""
    ops = fused.kernels()
    return (ops.vnni_linear if len(packed) == 3 else ops.int8_linear)(x, *packed, out_features)


def int8_kernels():
    """The compiled kernels where they hold rvqspec's int8 GEMMs (built with AVX2 and FMA), else None. Not subject to
    the fast-path switch (`fused.enabled`): they are the schemes' kernels, not an alternative to a plain path."""
    kernels = fused.kernels() if cpu_class.has_avx2() else None
    return kernels if kernels is not None and kernels.has_int8_gemm() else None


def pack_int8(q: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
    """int8 rows q [N, K] and their scales [N] in the layout of rvqspec's kernels (`int8.cpp`): [ceil(N/4), ceil(K/16),
    4, 16] bytes and float32 scales [4 ceil(N/4)], zero-padded; the blocks on huge pages (`fused.on_huge_pages`: AVX2
    w8a8 0.81x the time at one row, 0.91x at 9, Zen 4 under the caps, docs/cpu-fast-path.md)."""
    n, k = q.shape
    cols, depth = -(-n // PACK_COLS) * PACK_COLS, -(-k // PACK_DEPTH) * PACK_DEPTH
    padded = F.pad(q, (0, depth - k, 0, cols - n))
    blocks = padded.reshape(cols // PACK_COLS, PACK_COLS, depth // PACK_DEPTH, PACK_DEPTH).permute(0, 2, 1, 3)
    return fused.on_huge_pages(blocks), F.pad(scale.float(), (0, cols - n), value=1.0)


def pack_vnni(q: Tensor, scale: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """int8 rows q [N, K] and their scales [N] in the layout of rvqspec's VNNI kernel (`int8.cpp`: vnni_linear):
    [ceil(N/16), 4 ceil(K/16), 16, 4] bytes (16 channels x 4 input values per step), float32 scales and int32
    ZERO_POINT x each channel's sum [16 ceil(N/16)], zero-padded. The blocks lie on huge pages where the OS gives them
    (`fused.on_huge_pages`; 1-9 rows through the 0.6B predictor's matrices 0.58-0.70x the time, Zen 4)."""
    n, k = q.shape
    cols, depth = -(-n // VNNI_COLS) * VNNI_COLS, -(-k // VNNI_DEPTH) * VNNI_DEPTH
    padded = F.pad(q, (0, depth - k, 0, cols - n))
    blocks = padded.reshape(cols // VNNI_COLS, VNNI_COLS, depth // 4, 4).permute(0, 2, 1, 3)
    offsets = (padded.sum(1, dtype=torch.int32) * ZERO_POINT).to(torch.int32)
    return fused.on_huge_pages(blocks), F.pad(scale.float(), (0, cols - n), value=1.0), offsets


def pack_rows(q: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
    """The plain form torch's weight-only kernel reads (w8a16 on 16-bit activations): int8 rows [N', K] and float32
    scales [N'], both padded to N' = a multiple of W8A16_MULTIPLE channels (that kernel reads out of bounds on
    others)."""
    pad = -len(q) % W8A16_MULTIPLE
    return F.pad(q, (0, 0, 0, pad)), F.pad(scale.float(), (0, pad), value=1.0)


def pack_onednn(q: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
    return torch.ops.onednn.qlinear_prepack(q, None), scale.float().clone()


def unblock(blocks: Tensor, n: int, k: int) -> Tensor:
    """pack_int8's or pack_vnni's blocks [N/c, K/d, c, d] back to int8 rows [n, k] (a new tensor)."""
    cols, steps, width, depth = blocks.shape
    return blocks.permute(0, 2, 1, 3).reshape(cols * width, steps * depth)[:n, :k].contiguous()


# Each form of a weight (the tensors one kernel reads, `Int8Matmul.form`), and how its int8 rows [N, K] and scales [N]
# come back out of it (exactly: every form holds the same bytes, laid out and padded).
PACKERS = {"rows": pack_rows, "avx2": pack_int8, "vnni": pack_vnni, "onednn": pack_onednn}
UNPACKERS = {"rows": lambda held, n, k: (held[0][:n], held[1][:n]),
             "avx2": lambda held, n, k: (unblock(held[0], n, k), held[1][:n]),
             "vnni": lambda held, n, k: (unblock(held[0], n, k), held[1][:n]),
             "onednn": lambda held, n, k: (held[0].to_dense().t().contiguous(), held[1])}


def check_cpu(x: Tensor, scheme: str) -> None:
    if not x.is_cpu:  # not x.device.type: that builds a device object, ~1% of a one-row talker step
        raise RvqspecError(f"{scheme} weights run on the CPU only (torch's int8 kernels there); this call is on "
                           f"{x.device}: decode on the CPU, or use the float model on {x.device.type}")


def home_form(scheme: str) -> str:
    """The form an Int8Matmul of `scheme` holds its weight in from the start: w8a8's kernel on this class
    (`w8a8_kernel`; `check_scheme` refuses w8a8 where there is none), w8a16's plain rows (torch's kernel: 16-bit
    activations; a float32 call repacks them for rvqspec's kernel, once)."""
    return w8a8_kernel() if check_scheme(scheme) == "w8a8" else "rows"


def kept_beside(form: str, forms: dict) -> bool:
    """Whether `form` is made beside the one held rather than in its place: oneDNN's beside the VNNI kernel's on AMX
    CPUs, whose long calls (a prompt's prefill) take oneDNN's AMX tiles."""
    return form == "onednn" and "vnni" in forms and cpu_class.cpu_class() == "amx"


class Int8Matmul:
    """One [N, K] weight as int8 rows and scales, multiplied by activations [..., K] under `scheme`. The weight is
    held once, in the form the kernel that multiplies it reads (`forms`: one entry; on AMX CPUs w8a8 also keeps
    oneDNN's once a call of more than VNNI_ROWS rows came, for its AMX tiles): no plain int8 copy beside a packed
    one. `rows()` unpacks the int8 rows and scales (saving, pickling, inspection)."""

    def __init__(self, weight: Tensor, scheme: str):
        self.scheme, (self.out_features, self.in_features) = scheme, weight.shape
        if scheme == "w8a16" and self.in_features % W8A16_MULTIPLE:
            raise RvqspecError(f"w8a16 needs input widths that are multiples of {W8A16_MULTIPLE} (torch's int8 "
                               f"weight-only kernel crashes on others), got {self.in_features}: use w8a8")
        self.lock = threading.Lock()
        self.hold(*quantize_rows(weight))

    def hold(self, q: Tensor, scale: Tensor) -> None:
        """Multiply by int8 rows q [N, K] and their scales [N] from now on (packed into new tensors: q and scale
        are not kept), dropping every form of the previous ones."""
        form = home_form(self.scheme)
        self.forms: dict[str, tuple[Tensor, ...]] = {form: PACKERS[form](q, scale)}
        self.scales: dict[torch.dtype, Tensor] = {}  # w8a16's rows: the scale in each activation dtype (torch's kernel)
        self.zero_points = torch.zeros(self.out_features, dtype=torch.long)  # oneDNN's weight zero points
        self.kernel: str | None = None  # w8a8: `w8a8_kernel`, asked on the first call (per call it cost ~2 us)

    def rows(self) -> tuple[Tensor, Tensor]:
        """(int8 rows [N, K], float32 scales [N]) without padding, out of the form held: what a state_dict holds."""
        form, held = next(iter(self.forms.items()))
        return UNPACKERS[form](held, self.out_features, self.in_features)

    def rows_like(self) -> tuple[Tensor, Tensor]:
        """Tensors of `rows()`'s shapes and dtypes on the meta device (no data): what a loaded state is checked
        against without unpacking."""
        return (torch.empty(self.out_features, self.in_features, dtype=torch.int8, device="meta"),
                torch.empty(self.out_features, dtype=torch.float32, device="meta"))

    def __call__(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        check_cpu(x, self.scheme)
        out = self.w8a16(x) if self.scheme == "w8a16" else self.w8a8(x)
        return out if bias is None else out + bias

    def w8a16(self, x: Tensor) -> Tensor:
        rows = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, self.in_features).contiguous()
        rows = rows if rows.dtype in W8A16_ACTIVATIONS else rows.float()
        kernels = int8_kernels() if rows.dtype == torch.float32 else None
        if kernels is not None:
            out = kernels.w8a16_linear(rows, *self.packed_as("avx2"), self.out_features).to(x.dtype)
        else:
            q, scale = self.packed_as("rows")
            if rows.dtype not in self.scales:
                self.scales[rows.dtype] = scale.to(rows.dtype)
            out = torch._weight_int8pack_mm(rows, q, self.scales[rows.dtype]).to(x.dtype)
            out = out[:, :self.out_features] if len(q) != self.out_features else out
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], self.out_features)

    def w8a8(self, x: Tensor) -> Tensor:
        """x [..., K] -> [..., N] in x's dtype through this class's w8a8 kernel (`w8a8_kernel`; on AMX CPUs oneDNN's
        past VNNI_ROWS rows: the same bits, faster on its tiles). rvqspec's kernels take and give any leading shape:
        a one-row call is one native call and little else (~2 us)."""
        packed = self.native(x.numel() // self.in_features)
        if packed is not None:
            return native_w8a8(x, packed, self.out_features)
        rows = x.reshape(-1, self.in_features).contiguous()
        kernels = fused.kernels() if fused.on() else None  # the same bits as the plain ops, faster
        q, scale = kernels.quantize_rows(rows) if kernels else quantize_tokens(rows)
        weight, weight_scale = self.packed_as("onednn")
        out = torch.ops.onednn.qlinear_pointwise(q, 1.0, ZERO_POINT, weight, weight_scale, self.zero_points, None,
                                                 1.0, 0, torch.float32, "none", [], "")
        out = kernels.scale_rows(out, scale, x) if kernels else (out * scale).to(x.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)

    def native(self, rows: int) -> tuple[Tensor, ...] | None:
        """w8a8: the packed weights of rvqspec's kernel where a call of `rows` rows runs on it (`w8a8_kernel`: "avx2";
        "vnni", past VNNI_ROWS rows too but on AMX CPUs): pack_vnni's three tensors or pack_int8's two. None where
        oneDNN's runs it."""
        if self.scheme != "w8a8":
            return None
        kernel = self.kernel = self.kernel or w8a8_kernel()
        if kernel == "vnni" and rows > VNNI_ROWS and cpu_class.cpu_class() == "amx":
            return None
        return self.packed_as(kernel) if kernel == "avx2" or kernel == "vnni" else None

    def __getstate__(self) -> dict:
        """Pickles and copies (torch.save, deepcopy) hold the int8 rows and scales; the packed form (oneDNN's is an
        opaque tensor, which pickle cannot read) and the lock are made again by the copy."""
        q, scale = self.rows()
        return {"scheme": self.scheme, "out_features": self.out_features, "in_features": self.in_features,
                "q": q, "scale": scale}

    def __setstate__(self, state: dict) -> None:
        self.scheme, self.out_features, self.in_features = state["scheme"], state["out_features"], state["in_features"]
        self.lock = threading.Lock()
        self.hold(state["q"], state["scale"])

    def packed_as(self, form: str) -> tuple[Tensor, ...]:
        """The weight in `form` (a key of PACKERS). A form not held replaces the one held (the rows unpacked, then
        packed anew: once, where a model keeps its dtype and class), or joins it (`kept_beside`)."""
        held = self.forms.get(form)
        if held is not None:
            return held
        with self.lock:
            if form not in self.forms:
                packed = PACKERS[form](*self.rows())
                self.forms = {**self.forms, form: packed} if kept_beside(form, self.forms) else {form: packed}
            return self.forms[form]


class QuantizedLinear(nn.Module):
    """Stands in for a model's Linear: the same call, int8 weights (no float copy is kept)."""

    def __init__(self, linear: nn.Linear, scheme: str):
        super().__init__()
        self.matmul = Int8Matmul(linear.weight, scheme)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.matmul(x, self.bias)

    def extra_repr(self) -> str:
        m = self.matmul
        return f"{m.in_features} -> {m.out_features}, {m.scheme}"

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        """The int8 weight as `weight_int8` and `weight_scale` (see the module docstring), then the bias."""
        destination[prefix + "weight_int8"], destination[prefix + "weight_scale"] = self.matmul.rows()
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state: dict, prefix: str, metadata: dict, strict: bool, missing: list,
                              unexpected: list, errors: list) -> None:
        loaded = take_int8(state, prefix + "weight_", self.matmul.rows_like(), missing, errors)
        if loaded is not None:
            self.matmul.hold(*loaded)
        super()._load_from_state_dict(state, prefix, metadata, strict, missing, unexpected, errors)


class QuantizedHeads:
    """The 15 (CSM: 31) heads [V, H] as int8 matmuls: logits of one codebook at a time."""

    def __init__(self, heads: Tensor, scheme: str):
        self.matmuls = [Int8Matmul(head, scheme) for head in heads]

    def logits(self, hidden: Tensor, codebook: int) -> Tensor:
        return self.matmuls[codebook - 1](hidden)

    def rows(self) -> tuple[Tensor, Tensor]:
        """(int8 heads [G-1, V, H], scales [G-1, V])."""
        q, scale = zip(*(matmul.rows() for matmul in self.matmuls))
        return torch.stack(q), torch.stack(scale)

    def rows_like(self) -> tuple[Tensor, Tensor]:
        """`rows()`'s shapes and dtypes on the meta device (`Int8Matmul.rows_like`)."""
        q, scale = self.matmuls[0].rows_like()
        return q.expand(len(self.matmuls), *q.shape), scale.expand(len(self.matmuls), *scale.shape)

    def hold(self, q: Tensor, scale: Tensor) -> None:
        for matmul, head, head_scale in zip(self.matmuls, q, scale):
            matmul.hold(head, head_scale)


def fits(given: Tensor, ours: Tensor) -> bool:
    """Whether a loaded tensor can replace ours: the same shape, and the same dtype unless both are floats."""
    return given.shape == ours.shape and (given.dtype == ours.dtype
                                          or given.is_floating_point() and ours.is_floating_point())


def take_int8(state: dict, prefix: str, ours: tuple[Tensor, Tensor], missing: list, errors: list
              ) -> tuple[Tensor, Tensor] | None:
    """Pop `<prefix>int8` and `<prefix>scale` out of a state being loaded (nn.Module._load_from_state_dict's
    arguments): (int8 rows, scales) where both are there and fit `ours`; None otherwise, with the missing key or
    the mismatch reported as nn.Module reports its own. `ours`: tensors of our shapes and dtypes (meta ones will do)."""
    names = (prefix + "int8", prefix + "scale")
    if not all(name in state for name in names):
        missing.extend(name for name in names if name not in state)
        return None
    given = tuple(state.pop(name) for name in names)
    for name, tensor, own in zip(names, given, ours):
        if not fits(tensor, own):
            errors.append(f"size mismatch for {name}: copying {tuple(tensor.shape)} {tensor.dtype} from checkpoint, "
                          f"the model holds {tuple(own.shape)} {own.dtype}.")
            return None
    return given


def scheme_name(tensor: Tensor) -> str:
    """The scheme a state_dict's `scheme` entry (ASCII bytes) names."""
    return bytes(torch.as_tensor(tensor).flatten().to(torch.uint8).tolist()).decode("ascii", "replace")


def scheme_mismatch(theirs: str, ours: str) -> str:
    fix = (f"load it into the float model, then quantize that (rvqspec.quantize(model, {ours!r}))" if theirs == FLOAT
           else f"load it into a model of the same config quantized alike (rvqspec.quantize(model, {theirs!r}))")
    return f"this state_dict holds {theirs} weights and the model {ours} ones: {fix}"


def save_heads(model, destination: dict, prefix: str) -> None:
    """A quantized MultiCodeDecoder's own state_dict entries: `scheme`, `heads_int8`, `heads_scale`."""
    destination[prefix + "scheme"] = torch.tensor(list(model.weights.encode()), dtype=torch.uint8)
    destination[prefix + "heads_int8"], destination[prefix + "heads_scale"] = model.head_weights.rows()


def load_heads(model, state: dict, prefix: str, missing: list, errors: list) -> None:
    """Restore what `save_heads` wrote, popped out of a state being loaded into quantized `model`."""
    if prefix + "scheme" not in state:
        missing.append(prefix + "scheme")
    elif (theirs := scheme_name(state.pop(prefix + "scheme"))) != model.weights:
        errors.append(scheme_mismatch(theirs, model.weights))
        return
    loaded = take_int8(state, prefix + "heads_", model.head_weights.rows_like(), missing, errors)
    if loaded is not None:
        model.head_weights.hold(*loaded)


def check_state(model, state: Mapping[str, Tensor], strict: bool = True) -> None:
    """Refuse, before anything is loaded into `model` (a MultiCodeDecoder), a state_dict of another weights scheme
    (float included), with another shape than the model's or (`strict`) other keys: nn.Module would load part of it,
    then raise."""
    if "scheme" in state or strict:
        theirs = scheme_name(state["scheme"]) if "scheme" in state else FLOAT
        if theirs != model.weights:
            raise RvqspecError(scheme_mismatch(theirs, model.weights))
    ours = model.state_dict()
    if strict and set(state) != set(ours):
        lacking, extra = sorted(set(ours) - set(state)), sorted(set(state) - set(ours))
        raise RvqspecError(f"this state_dict lacks {len(lacking)} of the model's entries {lacking[:3]} and has "
                           f"{len(extra)} it lacks {extra[:3]}: load a state_dict of a model of the same config "
                           "(or pass strict=False)")
    for key, tensor in state.items():
        if key in ours and isinstance(tensor, Tensor) and not fits(tensor, ours[key]):
            raise RvqspecError(f"{key} is {tuple(tensor.shape)} {tensor.dtype} in this state_dict and "
                               f"{tuple(ours[key].shape)} {ours[key].dtype} in the model: load a state_dict of a "
                               "model of the same config")


def check_finite(tensors: Iterable[tuple[str, Tensor]]) -> None:
    """Refuse weights holding NaN or inf (a damaged checkpoint, or training that diverged), naming the first: int8
    rows scaled from them decode to garbage, or fail later in sampling."""
    for name, tensor in tensors:
        finite = tensor.isfinite()
        if not finite.all():
            kind = "NaN" if tensor.isnan().any() else "inf"
            raise RvqspecError(f"{name} holds {kind}: {int((~finite).sum())} of its {tensor.numel()} values are not "
                               "finite; quantize a model with finite weights (a damaged checkpoint, or training that "
                               "diverged)")


def quantize_linears(module: nn.Module, scheme: str, keep: tuple[nn.Module, ...] = ()) -> list[tuple]:
    """Swap, in place, every nn.Linear under `module` (outside the modules in `keep`) for a QuantizedLinear of
    `scheme`: how another model's layers (a talker, a backbone) get the same int8 weights. Returns the
    (parent, name, original Linear) triples that `restore_linears` puts back."""
    check_scheme(scheme)
    kept = {id(m) for m in keep}
    swapped = []

    def visit(parent: nn.Module, path: str) -> None:
        for name, child in parent.named_children():
            if id(child) in kept:
                continue
            if isinstance(child, nn.Linear):
                if child.weight.device.type != "cpu":
                    raise RvqspecError(f"{scheme} weights run on the CPU only: this model is on "
                                       f"{child.weight.device}; keep its float weights there, or move it to the CPU")
                check_finite(child.named_parameters(prefix=path + name))
                setattr(parent, name, QuantizedLinear(child, scheme))
                swapped.append((parent, name, child))
            else:
                visit(child, f"{path}{name}.")

    try:
        visit(module, "")
    except RvqspecError:  # nothing is left half-swapped
        restore_linears(swapped)
        raise
    return swapped


def restore_linears(swapped: list[tuple]) -> None:
    """Undo `quantize_linears`: each original Linear back where it was."""
    for parent, name, original in reversed(swapped):
        setattr(parent, name, original)


def quantize(model, scheme: str):
    """A new MultiCodeDecoder with `scheme`'s int8 weights (see the module docstring); `model` is untouched."""
    check_scheme(scheme)
    if model.is_quantized:
        raise RvqspecError(f"this model is already {model.weights}-quantized: quantize the float model")
    if model.device.type != "cpu":
        raise RvqspecError(f"{scheme} weights run on the CPU only: quantize a model on the CPU (it is on "
                           f"{model.device})")
    check_finite(model.named_parameters())
    quantized = copy.deepcopy(model)
    for layer in quantized.layers:
        for parent, name in ((layer.attn, "wqkv"), (layer.attn, "wo"), (layer.mlp, "w_gate_up"), (layer.mlp, "w_down")):
            setattr(parent, name, QuantizedLinear(getattr(parent, name), scheme))
    if isinstance(quantized.project, nn.Linear):  # float, its bits would differ between CPU classes (MKL's sums)
        quantized.project = QuantizedLinear(quantized.project, scheme)
    quantized.head_set.quantize(model.heads, scheme)
    quantized.heads, quantized.weights = None, scheme
    return quantized.eval().requires_grad_(False)
