"""The memory floor of a decoding step, and how close each weights scheme's kernels come to it on this CPU.

A one-row step (the AR predictor step, the talker step) multiplies every layer matrix once by one row: it reads all
the weights and does little else, so its floor is the weight bytes over the memory bandwidth. The bandwidth is a
large tensor copy's (read + write bytes over its time, median), this thread count, as benchmarks/end_to_end.py has
measured it since issue 32. `one_row_steps` runs one row through the 0.6B predictor's decoder stack per scheme
(float32, bfloat16, w8a16, w8a8; more bytes than any cache holds) as the engine runs it: a cached forward of a random
model, one native call per stack where the scheme has one (`fused.int8_stack`: w8a8 on rvqspec's GEMMs, bfloat16 on
its kernel; on 2 threads one parallel region), else the fused kernels' Python loop; its matmuls, norms, attention
over a few keys and activation quantization. It gives each its fraction of the floor: a copy moving as many bytes as
the scheme's layer matrices (`copy_of`: the same footprint, on huge pages as the packed weights), timed between the
calls on their thread count, so that both see the same machine (a 1 GB copy timed once before the calls read 42.8
GB/s where a copy of the matrices' bytes between them read 32, capped avx2, issue 51: a shared machine's bandwidth
swings), each call right after an untimed call of itself (`median_ms`'s primed: a decoding step follows a step; the
one-row stack timed right after the copy or after 8 rows through the matrices took 1.15-1.2x as long as after
itself, 2 threads, Zen 4, issue 51); the cost of 4 and 8 rows against one (a batch's step); and, labelled as such,
the layer matrices alone, called one by one from Python (each call forks and joins torch's threads). `rvqspec
inspect --device` prints it with each scheme's kernel.

A whole frame's parts get floors from the same measures (benchmarks/end_to_end.py): `matrix_bytes` (a module's weights
as a scheme stores them), `matmul_peak` (a large matmul's FLOP/s, this thread count: the compute floor's rate) and
`counted_flops` (a call's matmul and convolution FLOPs).
"""

import statistics
import time

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from rvqspec.core import cpu_class, device_path, fused
from rvqspec.core.config import ARCHITECTURES, PredictorConfig, layer_shapes
from rvqspec.core.device_path import known, median_ms, packable
from rvqspec.core.errors import RvqspecError
from rvqspec.core.model import MultiCodeDecoder
from rvqspec.core.packing import PackedWeight, linear
from rvqspec.core.quantize import Int8Matmul, check_scheme, int8_kernels, quantize, w8a8_kernel

SCHEMES = ("float32", "bfloat16", "w8a16", "w8a8")
ROWS = (1, 4, 8)
STACK_SLOTS = 16  # the timed step's cache; it attends to the first half (a predictor frame's middle position)


def copy_bandwidth(gigabytes: float = 1.0, repeats: int = 5) -> float:
    """Bytes per second of a large tensor copy (read + write), this thread count: the memory bandwidth estimate."""
    source = torch.ones(int(gigabytes * 2**30) // 4, dtype=torch.float32)
    target = torch.empty_like(source)
    target.copy_(source)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        target.copy_(source)
        times.append(time.perf_counter() - start)
    return 2 * source.numel() * 4 / statistics.median(times)


def copy_of(nbytes: int):
    """A call copying a tensor of nbytes / 2 bytes into another (nbytes read + written): timed beside a call reading
    nbytes of weights, the floor of that call at this thread count. Both tensors on transparent huge pages where the OS
    gives them (`fused.on_huge_pages`), as rvqspec's packed weights lie: on 4 KiB pages the same copy took 1.16x as
    long on 1 thread and 1.2-1.35x on 2 (Zen 4, capped avx2, interleaved, a shared machine), a floor the kernels'
    calls beat by their pages alone."""
    source = fused.on_huge_pages(torch.ones(max(nbytes // 8, 1), dtype=torch.float32))
    target = fused.on_huge_pages(torch.zeros_like(source))
    return lambda: target.copy_(source)


def matrix_bytes(modules: list[torch.nn.Module], scheme: str) -> int:
    """Bytes of the weights of `modules` stored as `scheme` (a float dtype's name, or an int8 scheme: each matrix as
    int8 rows and a float32 scale per row, `quantize_rows`); vectors (norms, biases) as they are."""
    total = 0
    for p in (p for module in modules for p in module.parameters()):
        if p.dim() < 2:
            total += p.numel() * p.element_size()
        elif scheme in ("w8a8", "w8a16"):
            total += p.numel() + 4 * p.shape[0]
        else:
            total += p.numel() * getattr(torch, scheme).itemsize
    return total


def matmul_peak(scheme: str, size: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of a [size, size] x [size, size] matmul under `scheme` (a float dtype's name, or an int8 scheme through
    `Int8Matmul`), this thread count, median: the rate a compute floor divides by."""
    generator = torch.Generator().manual_seed(0)
    weight, x = (torch.randn(size, size, generator=generator) for _ in range(2))
    if scheme in ("w8a8", "w8a16"):
        check_scheme(scheme)
        call = lambda m=Int8Matmul(weight, scheme): m(x)  # noqa: E731
    else:
        dtype = getattr(torch, scheme)
        call = lambda w=weight.to(dtype), a=x.to(dtype): F.linear(a, w)  # noqa: E731
    with torch.inference_mode():
        ms = median_ms({scheme: call}, repeats)[scheme]
    return 2 * size ** 3 / (ms / 1e3)


def counted_flops(call) -> int:
    """FLOPs of the matmuls, convolutions and attention `call()` runs (torch's FlopCounterMode; elementwise work is
    not counted)."""
    with FlopCounterMode(display=False) as counter:
        call()
    return counter.get_total_flops()


def kernels() -> dict[str, str]:
    """Which kernel multiplies each scheme's matmuls here (float32 activations, and bfloat16 where they differ)."""
    w8a8 = {"vnni": "rvqspec's AVX-512 VNNI int8 GEMM (int8.cpp)", "onednn": "oneDNN's int8 GEMM (VNNI dot products)",
            "avx2": "rvqspec's AVX2 int8 GEMM (int8.cpp)",
            None: "refused: no int8 dot products and no AVX2 int8 kernel"}[w8a8_kernel()]
    w8a16 = "rvqspec's AVX2 w8a16 kernel (int8.cpp)" if int8_kernels() is not None else "torch._weight_int8pack_mm"
    bfloat16 = "oneDNN (packed)" if packable(torch.bfloat16) else "ATen (bfloat16 emulated in float32: no bfloat16 " \
        "instructions on this class)"
    choice = known(torch.bfloat16)
    if choice and choice["matmul"]["bf16_kernel"] and fused.on():
        bfloat16 = "rvqspec's AVX-512 BF16 kernel (bf16.cpp)"
    return {"float32": "MKL / oneDNN", "bfloat16": bfloat16, "w8a16": f"{w8a16}; bfloat16 activations: "
            "torch._weight_int8pack_mm", "w8a8": w8a8}


def predictor_shapes(arch: str = "0.6b") -> list[tuple[int, int]]:
    """(out, in) of every layer matrix of the predictor of `arch`, in a step's order (qkv, o, gate+up, down)."""
    return layer_shapes(ARCHITECTURES[arch])


@torch.inference_mode()
def one_row_steps(schemes=SCHEMES, arch: str = "0.6b", repeats: int = 7, rows=ROWS, log=print,
                  config: PredictorConfig | None = None) -> dict:
    """Per scheme: ms of one row (and of `rows` rows) through the decoder stack of `arch`'s predictor (or one of
    `config`: a smoke run's) as the engine runs it (`stack_of`), and through its layer matrices called one by one; the
    matrices' bytes, the floor (a copy moving as many bytes, timed between the calls: `copy_of`), the bandwidth it
    reads and the fraction of the floor each reached; schemes this CPU refuses are reported with why."""
    generator = torch.Generator().manual_seed(0)
    config = config or ARCHITECTURES[arch]
    shapes = layer_shapes(config)
    weights = [torch.randn(shape, generator=generator) / shape[1] ** 0.5 for shape in shapes]
    inputs = {n: {k: torch.randn(n, k, generator=generator) for k in {s[1] for s in shapes}} for n in rows}
    report = {"cpu": cpu_class.describe(), "threads": torch.get_num_threads(), "arch": arch, "kernels": kernels(),
              "schemes": {}}
    for scheme in schemes:
        try:
            matrices, nbytes = step_of(scheme, weights)
            stack, path = stack_of(scheme, config)
        except RvqspecError as e:
            report["schemes"][scheme] = {"refused": str(e)}
            continue
        dtype = torch.bfloat16 if scheme == "bfloat16" else torch.float32
        cast = {n: {k: v.to(dtype) for k, v in inputs[n].items()} for n in rows}
        hidden = {n: torch.randn(n, 1, config.hidden_size, generator=generator).to(stack_dtype(scheme)) for n in rows}
        calls = {("stack", n): lambda x=hidden[n]: stack(x) for n in rows} | {"floor": copy_of(nbytes)} \
            | {("matrices", n): lambda x=cast[n]: matrices(x) for n in rows}
        ms = median_ms(calls, repeats, primed=True)  # a warm-up each: packed layouts made
        floor = ms.pop("floor")
        report["schemes"][scheme] = scheme_figures(ms, rows, nbytes, floor) | {"path": path}
        one = ms["stack", rows[0]]
        log(f"{scheme}: one row through the stack ({path}) {one:.2f} ms, floor {floor:.2f} ms ({floor / one:.0%}); "
            + ", ".join(f"{n} rows {ms['stack', n] / one:.2f}x" for n in rows[1:])
            + f"; the matrices one by one {ms['matrices', rows[0]]:.2f} ms ({floor / ms['matrices', rows[0]]:.0%})")
    return report


def scheme_figures(ms: dict, rows, nbytes: int, floor: float) -> dict:
    """A scheme's figures from its timed calls ({("stack" or "matrices", rows): ms}) and its floor."""
    one, matrices = ms["stack", rows[0]], ms["matrices", rows[0]]
    return {"ms": {str(n): ms["stack", n] for n in rows}, "bytes": nbytes, "floor_ms": floor,
            "bandwidth_gb_s": nbytes / floor / 1e6, "of_floor": floor / one,
            "rows_over_one": {str(n): ms["stack", n] / one for n in rows[1:]},
            "matrices_ms": {str(n): ms["matrices", n] for n in rows}, "matrices_of_floor": floor / matrices}


def stack_dtype(scheme: str) -> torch.dtype:
    """The activations' dtype of a scheme's model: bfloat16 for w8a8 (the model most users quantize), float32 for
    w8a16 (its kernel takes float32)."""
    return torch.bfloat16 if scheme in ("bfloat16", "w8a8") else torch.float32


def stack_of(scheme: str, config: PredictorConfig) -> tuple:
    """(a function running x [n, 1, hidden] through the decoder stack of a random predictor of `config` stored as
    `scheme`, one cached step at the middle of a frame, as the engine's forwards run it; how it runs: "one native call"
    where `fused.int8_stack` takes the model, else "the fused Python loop" or "the plain path")."""
    torch.manual_seed(0)
    model = MultiCodeDecoder(config).to(stack_dtype(scheme)).eval()
    if scheme in ("w8a16", "w8a8"):
        model = quantize(model, scheme)
    device_path.prepare(model)  # the kernel choices its forwards read (measured once per dtype and thread count)
    caches, slot = {}, torch.tensor([STACK_SLOTS // 2])
    mask = (torch.arange(STACK_SLOTS) <= slot)[None]

    def step(x: torch.Tensor) -> torch.Tensor:
        cache = caches.get(len(x)) or caches.setdefault(len(x), model.new_cache(len(x), STACK_SLOTS))
        return model(x, slot, mask, cache, slot)
    fast = device_path.choose("cpu", model.dtype).fused_kernels
    path = "one native call" if fast and fused.int8_stack(model, 1) is not None else \
        "the fused Python loop" if fast else "the plain path"
    return step, path


def step_of(scheme: str, weights: list) -> tuple:
    """(a function multiplying inputs {width: [n, width]} by every matrix in turn, the bytes it reads)."""
    if scheme in ("w8a16", "w8a8"):
        check_scheme(scheme)
        matmuls = [Int8Matmul(w, scheme) for w in weights]
        return (lambda x: [m(x[m.in_features]) for m in matmuls]), sum(w.numel() for w in weights)
    dtype = getattr(torch, scheme)
    cast = [w.to(dtype) for w in weights]
    if dtype == torch.bfloat16:  # the path decoding takes (`packing.linear`: the measured choice)
        packs = [PackedWeight() for _ in cast]
        return (lambda x: [linear(x[w.shape[1]], w, None, p) for w, p in zip(cast, packs)]), \
            sum(w.numel() * w.element_size() for w in cast)
    return (lambda x: [F.linear(x[w.shape[1]], w) for w in cast]), sum(w.numel() * w.element_size() for w in cast)
