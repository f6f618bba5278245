"""The memory floor of a decoding step, and how close each weights scheme's kernels come to it on this CPU.

A one-row step (the AR predictor step, the talker step) multiplies every layer matrix once by one row: it reads all
the weights and does little else, so its floor is the weight bytes over the memory bandwidth. The bandwidth is a
large tensor copy's (read + write bytes over its time, median), this thread count, as benchmarks/end_to_end.py has
measured it since issue 32. `one_row_steps` streams one row through the 0.6B predictor's layer matrices per scheme
(float32, bfloat16, w8a16, w8a8), more than any cache holds, and gives each its fraction of the floor: a copy moving
as many bytes as the scheme's weights (`copy_of`: the same footprint), timed between the kernels' calls on their
thread count, so that both see the same machine (a 1 GB copy timed once before the calls read 42.8 GB/s where a copy
of the matrices' bytes between them read 32, capped avx2, issue 51: a shared machine's bandwidth swings); and the cost
of 4 and 8 rows against one (a batch's step). `rvqspec inspect --device` prints it with each scheme's kernel.

A whole frame's parts get floors from the same measures (benchmarks/end_to_end.py): `matrix_bytes` (a module's weights
as a scheme stores them), `matmul_peak` (a large matmul's FLOP/s, this thread count: the compute floor's rate) and
`counted_flops` (a call's matmul and convolution FLOPs).
"""

import statistics
import time

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from rvqspec.core import cpu_class, fused
from rvqspec.core.config import ARCHITECTURES
from rvqspec.core.device_path import known, median_ms, packable
from rvqspec.core.errors import RvqspecError
from rvqspec.core.packing import PackedWeight, linear
from rvqspec.core.quantize import Int8Matmul, check_scheme, int8_kernels, w8a8_kernel

SCHEMES = ("float32", "bfloat16", "w8a16", "w8a8")
ROWS = (1, 4, 8)


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
    nbytes of weights, the floor of that call at this thread count."""
    source = torch.ones(max(nbytes // 8, 1), dtype=torch.float32)
    target = torch.empty_like(source)
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
    c = ARCHITECTURES[arch]
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    layer = [(q + 2 * kv, c.hidden_size), (c.hidden_size, q), (2 * c.intermediate_size, c.hidden_size),
             (c.hidden_size, c.intermediate_size)]
    return layer * c.num_hidden_layers


@torch.inference_mode()
def one_row_steps(schemes=SCHEMES, arch: str = "0.6b", repeats: int = 7, rows=ROWS, log=print,
                  shapes: list[tuple[int, int]] | None = None) -> dict:
    """Per scheme: ms of one row (and of `rows` rows) through the layer matrices of `arch`'s predictor (or `shapes`),
    their bytes, the floor (a copy moving as many bytes, timed between the calls: `copy_of`), the bandwidth it reads
    and the fraction of the floor reached; schemes this CPU refuses are reported with why."""
    generator = torch.Generator().manual_seed(0)
    shapes = shapes or predictor_shapes(arch)
    weights = [torch.randn(shape, generator=generator) / shape[1] ** 0.5 for shape in shapes]
    inputs = {n: {k: torch.randn(n, k, generator=generator) for k in {s[1] for s in shapes}} for n in rows}
    report = {"cpu": cpu_class.describe(), "threads": torch.get_num_threads(), "arch": arch, "kernels": kernels(),
              "schemes": {}}
    for scheme in schemes:
        try:
            step, nbytes = step_of(scheme, weights)
        except RvqspecError as e:
            report["schemes"][scheme] = {"refused": str(e)}
            continue
        cast = {n: {k: v.to(torch.bfloat16) if scheme == "bfloat16" else v for k, v in inputs[n].items()}
                for n in rows}
        calls = {n: lambda x=cast[n]: step(x) for n in rows} | {"floor": copy_of(nbytes)}
        ms = median_ms(calls, repeats)  # a warm-up each: packed layouts made
        floor = ms.pop("floor")
        report["schemes"][scheme] = {"ms": {str(n): v for n, v in ms.items()}, "bytes": nbytes, "floor_ms": floor,
                                     "bandwidth_gb_s": nbytes / floor / 1e6, "of_floor": floor / ms[rows[0]],
                                     "rows_over_one": {str(n): ms[n] / ms[rows[0]] for n in rows[1:]}}
        log(f"{scheme}: one row {ms[rows[0]]:.2f} ms, floor {floor:.2f} ms ({floor / ms[rows[0]]:.0%}); "
            + ", ".join(f"{n} rows {ms[n] / ms[rows[0]]:.2f}x" for n in rows[1:]))
    return report


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
