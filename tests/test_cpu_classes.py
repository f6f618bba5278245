"""CPU classes (`core/cpu_class.py`) and the measured kernel choices (`core/device_path.py`): the class follows the
ISA caps, what a class cannot run exactly is refused, the matmuls give a row the same bits in an AR step and in a
verify call, and the exactness tests pass under a cap too (`test_the_exactness_tests_pass_under_an_isa_cap`).

The predictor's attention visits each query's keys in position order on the fast path (`fused.attention_in_order`),
so a verify call's rows are its AR steps' bits wherever the matmuls are row-invariant (tests/test_bit_exact.py, in
this capped rerun too). What is not, and why: the plain path (RVQSPEC_FUSED=0, or no kernels) attends through SDPA,
whose sums depend on the call's shape and on where masked keys lie, and float matmuls without a measured row floor
differ by row count; in bfloat16 and float32 that can change a last bit. bfloat16's sampled distribution is tested
on the fast path (test_distribution.py), greedy identity in float64 and quantized (integer GEMM) models, and in
bfloat16 through rvqspec's bfloat16 kernel where the class has AVX-512 BF16 (test_bf16.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rvqspec import MultiCodeDecoder, RvqspecError, quantize
from rvqspec.core import cpu_class, device_path, fused, packing
from rvqspec.core.config import PredictorConfig
from rvqspec.core.quantize import ZERO_POINT, Int8Matmul, int8_kernels, quantize_tokens, w8a8_kernel

ROOT = Path(__file__).resolve().parents[1]
AVX2_CAP = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}  # a Zen 3 / older Intel client
CAPPED = "RVQSPEC_TEST_CAPPED"  # set in the capped run, which must not start itself again


def classes_under(aten: dict, onednn_caps: list[str]) -> list[str]:
    """The classes a process under ATen's cap `aten` alone (the caps of this process, if any, left out) gets under
    each of `onednn_caps` ("": none). One process per ATen cap: torch reads it when it loads; oneDNN's is read from the
    environment by `cpu_class` itself, so one process asks for each of them in turn."""
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")} | aten
    code = ("import os, sys\nfrom rvqspec.core import cpu_class\nfor cap in sys.argv[1:]:\n"
            "    os.environ['ONEDNN_MAX_CPU_ISA'] = cap\n    cpu_class.cpu_class.cache_clear()\n"
            "    print(cpu_class.cpu_class())")
    return subprocess.run([sys.executable, "-c", code, *onednn_caps], env=env, capture_output=True, text=True,
                          check=True, cwd=ROOT).stdout.split()


def test_each_cap_names_the_class_it_stands_in_for():
    flags = cpu_class.cpu_flags()
    if not {"avx512_vnni", "avx512bw", "avx512vl", "avx2", "fma"} <= flags:
        pytest.skip("needs an AVX-512 VNNI CPU to reach the lower classes by capping")
    native, vnni, avx512, avx2_vnni = classes_under({}, ["", "AVX512_CORE_VNNI", "AVX512_CORE", "AVX2_VNNI"])
    assert native in ("amx", "avx512-vnni-bf16", "avx512-vnni")
    assert vnni == "avx512-vnni" and avx512 == "avx512"
    aten_alone, both = classes_under({"ATEN_CPU_CAPABILITY": "avx2"}, ["", AVX2_CAP["ONEDNN_MAX_CPU_ISA"]])
    assert both == "avx2"
    assert aten_alone in ("avx2", "avx2-vnni")  # ATen's cap counts as much
    if "avx_vnni" not in flags:  # Zen 4 has AVX-512 VNNI but not the VEX-coded AVX-VNNI: that cap is AVX2 there
        assert avx2_vnni == "avx2"


def test_caps_allow_what_onednn_allows():
    assert cpu_class.onednn_allows("amx", "") and cpu_class.onednn_allows("amx", "ALL")
    assert not cpu_class.onednn_allows("amx", "AVX512_CORE_BF16")
    assert cpu_class.onednn_allows("avx512-vnni-bf16", "AVX512_CORE_BF16")
    assert not cpu_class.onednn_allows("avx2-vnni", "AVX512_CORE_BF16")  # AVX-VNNI is a bit of its own in oneDNN
    assert cpu_class.onednn_allows("avx2-vnni", "AVX2_VNNI") and not cpu_class.onednn_allows("avx2-vnni", "AVX2")
    assert not cpu_class.aten_allows("avx512", "AVX2") and cpu_class.aten_allows("avx2", "AVX512")


def test_the_fused_kernels_are_compiled_for_the_class(monkeypatch):
    """Under a cap below AVX-512 on a CPU that has it, no AVX-512 instruction may reach the fused kernels."""
    monkeypatch.setattr(cpu_class, "cpu_flags", lambda: {"avx512f", "avx2", "fma"})
    monkeypatch.setattr(cpu_class, "cpu_class", lambda: "avx2")
    assert "-mno-avx512f" in fused.cflags() and "-mprefer-vector-width=512" not in fused.cflags()
    capped = fused.build_name()
    monkeypatch.setattr(cpu_class, "cpu_class", lambda: "avx512-vnni-bf16")
    assert "-mprefer-vector-width=512" in fused.cflags() and fused.build_name() != capped


def test_w8a8_takes_rvqspecs_kernel_without_int8_dot_products_and_is_refused_without_avx2(monkeypatch):
    model = MultiCodeDecoder(PredictorConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=16,
                                             num_code_groups=4, talker_hidden_size=32, talker_vocab_size=19))
    monkeypatch.setattr(cpu_class, "cpu_class", lambda: "arm")
    with pytest.raises(RvqspecError, match=r"w8a8 needs int8 dot-product instructions \(VNNI, AMX\) or rvqspec's AVX2 "
                                           r"int8 kernel, .*: keep the float weights"):
        quantize(model, "w8a8")
    assert quantize(model, "w8a16").weights == "w8a16"
    if int8_kernels() is not None:
        monkeypatch.setattr(cpu_class, "cpu_class", lambda: "avx2")
        assert w8a8_kernel() == "avx2" and quantize(model, "w8a8").weights == "w8a8"


@pytest.mark.skipif(w8a8_kernel() is None, reason="w8a8 needs int8 dot products or rvqspec's AVX2 kernel")
@pytest.mark.parametrize("width", [1024, 3072])
def test_w8a8_rows_are_exact_integer_products_alone_and_in_a_verify_call(width):
    """The int32 dot products, scaled per output channel and per token: what each row gets, whether it is alone
    (the AR step, M = 1, where oneDNN has a kernel of its own) or one of 33 rows (a verify call); on this class's
    w8a8 kernel (oneDNN's or rvqspec's)."""
    generator = torch.Generator().manual_seed(width)
    weight, x = torch.randn(256, width, generator=generator), torch.randn(33, width, generator=generator) * 4
    x[3] = 127 * x[3].sign()  # a loud token: pairs of large products that would saturate 16-bit sums
    matmul = Int8Matmul(weight, "w8a8")
    q, scale = quantize_tokens(x)
    weight_q, weight_scale = matmul.rows()
    exact = (q.long() - ZERO_POINT) @ weight_q.long().t()  # int64: no rounding, no saturation
    expected = exact.float() * weight_scale * scale
    with torch.inference_mode():
        assert torch.equal(matmul(x), expected)
        assert all(torch.equal(matmul(x[i:i + 1])[0], expected[i]) for i in range(33))


@pytest.mark.parametrize("shape", device_path.SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_the_large_matmuls_give_a_row_its_bits_alone_and_in_a_verify_call(shape, dtype):
    """Each row of a 33-row call (a verify call of N = 32) equals that row computed alone (its AR step), through the
    measured kernels and row floor; where no floor made this CPU's kernel batch-invariant, the measurement says so."""
    if not device_path.decided(dtype)["figures"]["batch_invariant"]["matmuls"]:
        pytest.skip(f"no row floor makes this CPU's {dtype} GEMM batch-invariant ({cpu_class.describe()}): measured")
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(shape[1], shape[0], generator=generator) / shape[0] ** 0.5).to(dtype)
    x = torch.randn(33, shape[0], generator=generator).to(dtype)
    pack = packing.PackedWeight()
    with torch.inference_mode():
        whole = packing.linear(x, weight, None, pack)
        assert all(torch.equal(packing.linear(x[i:i + 1], weight, None, pack)[0], whole[i]) for i in range(33))


def test_the_kernel_choices_are_measured_once_per_cpu_and_kept(tmp_path, monkeypatch):
    """decided(): measured on first use and written to the cache folder under a key naming the CPU, its class, torch
    and the thread count; read back, not measured again; a damaged file is measured again and rewritten."""
    monkeypatch.setenv("RVQSPEC_CACHE", str(tmp_path))
    device_path.prepared.clear()
    measured = []
    real = device_path.measure
    monkeypatch.setattr(device_path, "measure", lambda dtype: measured.append(dtype) or real(dtype))
    first = device_path.decided(torch.float32)
    stored = json.loads((tmp_path / "kernels.json").read_text())
    (key,) = stored["entries"]
    assert cpu_class.cpu_class() in key and torch.__version__ in key and f"{torch.get_num_threads()}t" in key
    assert stored["entries"][key] == first
    assert set(first["matmul"]) == {"packed_one", "packed_many", "pad_rows", "attention_rows", "bf16_kernel"}
    device_path.prepared.clear()
    assert device_path.decided(torch.float32) == first and measured == [torch.float32]  # read, not measured
    (tmp_path / "kernels.json").write_text("{damaged")
    device_path.prepared.clear()
    device_path.decided(torch.float32)
    assert measured == [torch.float32] * 2 and json.loads((tmp_path / "kernels.json").read_text())["entries"]
    device_path.prepared.clear()


def test_another_thread_count_reads_its_own_choices(monkeypatch):
    """The choices are measured per thread count: after torch.set_num_threads the path asks for that count's."""
    asked, real = [], device_path.known
    monkeypatch.setattr(device_path, "known", lambda dtype: asked.append(torch.get_num_threads()) or real(dtype))
    before = torch.get_num_threads()
    try:
        with torch.inference_mode():
            for threads in (1, 2):
                torch.set_num_threads(threads)
                device_path.choose("cpu", torch.float32)
    finally:
        torch.set_num_threads(before)
    assert 2 in asked  # not the 1-thread answer again


# The capped rerun in three processes, so that the suite's two workers share it (one took ~7 min of a loaded run).
# test_each_cap_names_the_class_it_stands_in_for is not rerun: it strips the caps from its children, so it would ask
# them exactly what the native run asked.
CAPPED_RUNS = {
    "speculative-distribution": (["tests/test_speculative.py", "tests/test_distribution.py"],
                                 "greedy or matches_enumeration"),  # not the G-test's own power tests
    "quantize-int8": (["tests/test_quantize.py", "tests/test_int8.py", "tests/test_int8_layers.py"], ""),
    "classes-bit_exact": (["tests/test_cpu_classes.py", "tests/test_bit_exact.py"],
                          "not test_each_cap_names_the_class_it_stands_in_for"),
}


@pytest.mark.long
@pytest.mark.skipif(CAPPED in os.environ, reason="this is the capped run")
@pytest.mark.skipif(not {"avx2", "fma"} <= cpu_class.cpu_flags(), reason="needs an x86 CPU with AVX2")
@pytest.mark.parametrize("part", CAPPED_RUNS)
def test_the_exactness_tests_pass_under_an_isa_cap(part):
    """Greedy identity (float64, quantized), the matmul row invariance and the enumerated G-tests (bfloat16 too),
    rerun as the AVX2 class (ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2): other kernels, fused kernels built without AVX-512,
    w8a8 on rvqspec's int8 kernel (tests/test_int8.py and test_int8_layers.py too), bit-exact rounds (tests/test_bit_exact.py)."""
    tests, chosen = CAPPED_RUNS[part]
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-k", chosen, *tests],
                         env=os.environ | AVX2_CAP | {CAPPED: "1"}, capture_output=True, text=True, cwd=ROOT,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "failed" not in run.stdout


def test_a_forward_never_measures_the_preparation_step_does(tmp_path, monkeypatch, capsys):
    """With no choices prepared or cached, a forward takes the plain path without measuring; `prepare` measures
    once, with a one-line message, and the forwards after it take the measured path."""
    monkeypatch.setenv("RVQSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(device_path, "prepared", {})
    measured, canned = [], {"matmul": {"packed_one": False, "packed_many": False, "pad_rows": 2, "attention_rows": 1},
                            "int8_drafts": False, "figures": {"batch_invariant": {"matmuls": True}}}
    monkeypatch.setattr(device_path, "measure", lambda dtype: measured.append(dtype) or canned)
    model = MultiCodeDecoder(PredictorConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=16,
                                             num_code_groups=4, talker_hidden_size=32, talker_vocab_size=19))
    device_path.path_of.cache_clear()
    try:
        with torch.inference_mode():
            model(torch.randn(1, 2, 32), torch.arange(2), None, None, None)
            assert measured == [] and device_path.choose("cpu", torch.float32).matmul is None
            device_path.prepare(model, name="the tiny model")
            device_path.prepare(model, name="the tiny model")
            assert measured == [torch.float32] and device_path.choose("cpu", torch.float32).matmul.pad_rows == 2
        assert capsys.readouterr().err.count("measuring this CPU's kernels for the tiny model") == 1
    finally:
        device_path.path_of.cache_clear()
