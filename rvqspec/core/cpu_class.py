"""The CPU class: which of the instruction sets that decide our kernels' speed and exactness this process may use.

    amx               Intel Xeon 4th gen on (AMX tiles: int8 and bfloat16 matmuls in hardware)
    avx512-vnni-bf16  AMD Zen 4/5, Intel Cooper Lake (AVX-512 with int8 dot products and bfloat16 dot products)
    avx512-vnni       Intel Cascade Lake, Ice Lake (AVX-512 with int8 dot products)
    avx512            Intel Skylake-SP (AVX-512, no dot-product instructions)
    avx2-vnni         Intel Alder Lake and later client CPUs (AVX2 with AVX-VNNI int8 dot products)
    avx2              AMD Zen 2/3, Intel Haswell to Comet Lake
    arm, other        aarch64 machines (Apple, Graviton...), anything else

The class is what the CPU has (/proc/cpuinfo) under the user's caps, which stand in for other classes on one
machine: `ONEDNN_MAX_CPU_ISA` caps oneDNN (matmuls, int8 GEMMs) and `ATEN_CPU_CAPABILITY` caps ATen's own kernels;
a capped class is the lowest either allows. For example on an AMX Xeon `ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16` is the
Zen 4 class, and `ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2` the Zen 3 one. The fused kernels are compiled
for the class (`fused.cflags`), so that a capped run calls nothing the cap forbids.
"""

import functools
import os
import platform
from pathlib import Path

import torch

# The cpuinfo flags each x86 class needs, from the top; the first the CPU has (and the caps allow) is its class.
NEEDS = {
    "amx": {"amx_tile", "amx_int8", "amx_bf16", "avx512_bf16", "avx512_vnni", "avx512bw"},
    "avx512-vnni-bf16": {"avx512_bf16", "avx512_vnni", "avx512bw", "avx512vl"},
    "avx512-vnni": {"avx512_vnni", "avx512bw", "avx512vl"},
    "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"},
    "avx2-vnni": {"avx_vnni", "avx2", "fma"},
    "avx2": {"avx2", "fma"},
}
# oneDNN's ONEDNN_MAX_CPU_ISA values from low to high, and the lowest that lets each class run as itself.
ONEDNN_ISAS = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI",
               "AVX512_CORE_BF16", "AVX10_1_512", "AVX512_CORE_FP16", "AVX10_1_512_AMX", "AVX512_CORE_AMX",
               "AVX10_1_512_AMX_FP16", "AVX512_CORE_AMX_FP16", "AVX10_2_512", "AVX10_2_512_AMX_2")
ONEDNN_NEEDS = {"amx": "AVX10_1_512_AMX", "avx512-vnni-bf16": "AVX512_CORE_BF16", "avx512-vnni": "AVX512_CORE_VNNI",
                "avx512": "AVX512_CORE", "avx2-vnni": "AVX2_VNNI", "avx2": "AVX2"}
ATEN_NEEDS = {"amx": "AVX512", "avx512-vnni-bf16": "AVX512", "avx512-vnni": "AVX512", "avx512": "AVX512",
              "avx2-vnni": "AVX2", "avx2": "AVX2"}
INT8_DOT = ("amx", "avx512-vnni-bf16", "avx512-vnni", "avx2-vnni")  # int8 dot products in hardware


def cpu_flags() -> set[str]:
    path = Path("/proc/cpuinfo")
    if not path.exists():
        return set()
    line = next((line for line in path.read_text().splitlines() if line.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def cpu_model() -> str:
    """The CPU's model name ("AMD EPYC 9R14", "Intel(R) Xeon(R) Platinum 8488C"...)."""
    path = Path("/proc/cpuinfo")
    if path.exists():
        for line in path.read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return platform.processor() or platform.machine() or "unknown"


def onednn_allows(cls: str, cap: str) -> bool:
    """Whether ONEDNN_MAX_CPU_ISA=`cap` lets oneDNN use `cls`'s instructions. AVX-VNNI is its own bit in oneDNN:
    AVX512_CORE* caps do not include it, the FP16 and later ones do."""
    cap = cap.upper()
    if cap in ("", "ALL", "DEFAULT") or cap not in ONEDNN_ISAS:
        return True
    if cls == "avx2-vnni" and cap.startswith("AVX512_CORE") and ONEDNN_ISAS.index(cap) < ONEDNN_ISAS.index(
            "AVX10_1_512"):
        return False
    return ONEDNN_ISAS.index(cap) >= ONEDNN_ISAS.index(ONEDNN_NEEDS[cls])


def aten_allows(cls: str, capability: str) -> bool:
    """Whether ATen's kernels at `capability` (torch.backends.cpu.get_cpu_capability()) reach `cls`."""
    order = ("DEFAULT", "AVX2", "AVX512")
    return capability.upper() not in order or order.index(capability.upper()) >= order.index(ATEN_NEEDS[cls])


@functools.cache
def cpu_class() -> str:
    """This process's CPU class (see the module docstring): read once, as the caps are read when torch loads."""
    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return "arm"
    flags, cap = cpu_flags(), os.environ.get("ONEDNN_MAX_CPU_ISA", "")
    capability = torch.backends.cpu.get_cpu_capability()
    for cls, needs in NEEDS.items():
        if needs <= flags and onednn_allows(cls, cap) and aten_allows(cls, capability):
            return cls
    return "other"


def has_int8_dot() -> bool:
    """int8 dot-product instructions (VNNI, AMX) under the caps: where oneDNN's u8 x s8 GEMM is exact and fast."""
    return cpu_class() in INT8_DOT


def has_avx512_vnni() -> bool:
    """AVX-512 VNNI under the caps (the AVX-512 classes with int8 dot products): where rvqspec's VNNI int8 GEMM runs."""
    return cpu_class() in ("amx", "avx512-vnni-bf16", "avx512-vnni")


def has_avx512_bf16() -> bool:
    """AVX-512 BF16 under the caps: where rvqspec's bfloat16 kernel runs (`bf16.cpp`)."""
    return cpu_class() in ("amx", "avx512-vnni-bf16")


def has_avx2() -> bool:
    """AVX2 and FMA under the caps (every x86 class above "other"): where rvqspec's int8 kernels run (`int8.cpp`)."""
    return cpu_class() in NEEDS


def describe() -> str:
    """One line: model, class and the caps in force, e.g. "AMD EPYC 9R14: avx512-vnni-bf16"."""
    caps = [f"{name}={os.environ[name]}" for name in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY") if os.environ.get(name)]
    return f"{cpu_model()}: {cpu_class()}" + (f" (capped: {', '.join(caps)})" if caps else "")
