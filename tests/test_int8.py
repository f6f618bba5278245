"""rvqspec's int8 kernels (`core/int8.cpp`): w8a8's GEMM for CPUs without int8 dot products gives exact integer
sums (against int64), a row the same bits alone and in any call, oneDNN's bits where both run, and so one w8a8 model
the same codes on every x86 class (`test_one_w8a8_model_decodes_alike_natively_and_under_the_avx2_caps`); w8a16's
float32 kernel is the w8a16 model's product to float32 rounding, a row the same bits alone and in any call.

Greedy identity and the enumerated G-test of speculation on the AVX2 path: tests/test_quantize.py, which
tests/test_cpu_classes.py reruns under the AVX2 caps (where w8a8 takes this kernel)."""

import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_cpu_classes import AVX2_CAP, CAPPED

from rvqspec.bench import floor
from rvqspec.bench.floor import SCHEMES, copy_of, one_row_steps
from rvqspec.cli.inspect import scheme_figures
import rvqspec.core.quantize as quantize_module
from rvqspec.core import cpu_class, fused
from rvqspec.core.quantize import (VNNI_ROWS, ZERO_POINT, Int8Matmul, int8_kernels, pack_int8, pack_vnni, quantize_rows,
                                   quantize_tokens, unblock, w8a8_kernel)

from helpers import int8_codes
from helpers.tiny import tiny_config

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(int8_kernels() is None, reason="rvqspec's int8 kernels need x86 with AVX2 and built "
                                "kernels (`pip install 'rvqspec[fast]'`)")
SHAPES = [(1, 1024, 3072), (2, 17, 5), (3, 5, 1), (4, 1000, 333), (9, 64, 64), (33, 1027, 130), (66, 3072, 7)]


def operands(rows: int, k: int, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=generator) * 4
    x[0, : min(k, 8)] = 127.0  # a loud token: pairs of large products, which saturate 16-bit sums
    return torch.randn(n, k, generator=generator), x


@pytest.mark.parametrize("rows, k, n", SHAPES)
def test_the_w8a8_kernel_is_exact_integer_sums_for_every_row_alone_and_in_the_call(rows, k, n):
    """int64 reference: int32 sums, scaled per channel, then per token (float32), for 1..66 rows and widths that
    leave tails of the packed blocks."""
    weight, x = operands(rows, k, n)
    q, scale = quantize_rows(weight)
    packed, packed_scale = pack_int8(q, scale)
    tokens, token_scale = quantize_tokens(x)
    exact = (tokens.long() - ZERO_POINT) @ q.long().t()
    expected = exact.float() * scale * token_scale
    whole = int8_kernels().int8_linear(x, packed, packed_scale, n)
    assert torch.equal(whole, expected)
    assert all(torch.equal(int8_kernels().int8_linear(x[i:i + 1], packed, packed_scale, n)[0], whole[i])
               for i in range(rows))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_the_w8a8_kernel_rounds_to_the_activations_dtype_once(dtype):
    weight, x = operands(5, 96, 40, seed=1)
    q, scale = quantize_rows(weight)
    tokens, token_scale = quantize_tokens(x.to(dtype))
    expected = (((tokens.long() - ZERO_POINT) @ q.long().t()).float() * scale * token_scale).to(dtype)
    assert torch.equal(int8_kernels().int8_linear(x.to(dtype), *pack_int8(q, scale), 40), expected)


def test_a_row_holding_nan_gives_nan_alone():
    weight, x = operands(4, 64, 12, seed=2)
    x[2, 5] = float("nan")
    out = int8_kernels().int8_linear(x, *pack_int8(*quantize_rows(weight)), 12)
    assert out[2].isnan().all() and out[[0, 1, 3]].isfinite().all()


@pytest.mark.skipif(not cpu_class.has_int8_dot(), reason="needs oneDNN's int8 dot products (VNNI, AMX) to compare")
@pytest.mark.parametrize("rows", [1, 4, 33])
def test_the_avx2_kernel_gives_onednns_bits(rows, monkeypatch):
    """The same Int8Matmul through oneDNN and through rvqspec's AVX2 kernel: every bit equal."""
    weight, x = operands(rows, 1024, 300, seed=3)
    matmul = Int8Matmul(weight, "w8a8")
    monkeypatch.setattr(quantize_module, "w8a8_kernel", lambda: "onednn")
    with torch.inference_mode():
        assert torch.equal(matmul(x), int8_kernels().int8_linear(x, *pack_int8(*matmul.rows()), 300))
    assert set(matmul.forms) == {"onednn"}  # in place of the VNNI kernel's: one form


needs_vnni = pytest.mark.skipif(int8_kernels() is None or not int8_kernels().has_vnni_gemm(),
                                reason="rvqspec's VNNI kernel needs AVX-512 VNNI (and kernels built with it)")
VNNI_SHAPES = SHAPES + [(5, 16, 16), (7, 1, 17), (8, 3072, 1024), (17, 1024, 33), (12, 33, 4096), (13, 48, 40),
                          (25, 200, 20)]


@needs_vnni
@pytest.mark.parametrize("rows, k, n", VNNI_SHAPES)
def test_the_vnni_kernel_is_exact_integer_sums_for_every_row_alone_and_in_the_call(rows, k, n):
    """The int64 reference, as for the AVX2 kernel: 1..66 rows (one tile of 1..12 rows, and calls split into tiles
    of even sizes: 13 = 7 + 6, 17 = 9 + 8, 25, 33, 66), widths that leave tails of the 16-channel blocks and of the
    16-value depth; loud tokens whose byte sums wrap int32 before the zero point's correction."""
    weight, x = operands(rows, k, n, seed=6)
    q, scale = quantize_rows(weight)
    packed = pack_vnni(q, scale)
    tokens, token_scale = quantize_tokens(x)
    expected = ((tokens.long() - ZERO_POINT) @ q.long().t()).float() * scale * token_scale
    whole = int8_kernels().vnni_linear(x, *packed, n)
    assert torch.equal(whole, expected)
    assert all(torch.equal(int8_kernels().vnni_linear(x[i:i + 1], *packed, n)[0], whole[i]) for i in range(rows))


@needs_vnni
def test_vnni_blocks_of_2_mib_or_more_are_a_huge_page_aligned_copy_that_outlives_the_pack():
    """pack_vnni's blocks of a matrix of 2 MiB or more lie in a mapping of their own (`huge_pages`: advised for
    transparent huge pages on Linux), which holds the layout's bytes after the pack's temporaries are gone."""
    weight, x = operands(3, 1024, 2048 + 5, seed=9)
    q, scale = quantize_rows(weight)
    packed = pack_vnni(q, scale)
    gc.collect()
    assert packed[0].is_contiguous() and torch.equal(unblock(packed[0], 2048 + 5, 1024), q)
    if sys.platform == "linux":
        assert packed[0].data_ptr() % (1 << 21) == 0
    assert torch.equal(int8_kernels().vnni_linear(x, *packed, 2053),
                       int8_kernels().int8_linear(x, *pack_int8(q, scale), 2053))


@needs_vnni
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64], ids=str)
def test_the_vnni_kernel_gives_the_avx2_kernels_bits_in_every_dtype(dtype):
    """Both kernels' float steps after the int32 sums are the same: one w8a8 model, the same bits on every class (70
    outputs: blocks of 16 stored at once, the last one value by value)."""
    weight, x = operands(11, 200, 70, seed=7)
    q, scale = quantize_rows(weight)
    x = x.to(dtype)
    assert torch.equal(int8_kernels().vnni_linear(x, *pack_vnni(q, scale), 70),
                       int8_kernels().int8_linear(x, *pack_int8(q, scale), 70))


@needs_vnni
def test_a_row_holding_nan_gives_nan_alone_in_the_vnni_kernel():
    weight, x = operands(4, 64, 12, seed=2)
    x[2, 5] = float("nan")
    out = int8_kernels().vnni_linear(x, *pack_vnni(*quantize_rows(weight)), 12)
    assert out[2].isnan().all() and out[[0, 1, 3]].isfinite().all()


@needs_vnni
@pytest.mark.parametrize("rows", [1, 9, VNNI_ROWS, VNNI_ROWS + 1])
def test_w8a8_matmuls_take_the_vnni_kernel_at_every_row_count_but_amxs_long_calls(rows):
    """An Int8Matmul's calls on this class: rvqspec's VNNI kernel, held in its form alone; on AMX CPUs oneDNN's past
    VNNI_ROWS rows (a prompt's prefill), its form beside; every bit the same as the other kernel's."""
    weight, x = operands(rows, 256, 48, seed=8)
    matmul = Int8Matmul(weight, "w8a8")
    with torch.inference_mode():
        out = matmul(x)
    amx_long = rows > VNNI_ROWS and cpu_class.cpu_class() == "amx"
    assert w8a8_kernel() == "vnni" and set(matmul.forms) == ({"vnni", "onednn"} if amx_long else {"vnni"})
    assert torch.equal(out, int8_kernels().vnni_linear(x, *pack_vnni(*matmul.rows()), 48))


@pytest.mark.parametrize("shape", [(2, 3), (1, 1), (5,)])
def test_w8a8_matmuls_take_any_leading_shape(shape):
    """rvqspec's kernels take [..., K] whole (no reshape around the native call): the same bits as the rows."""
    weight, x = operands(6, 80, 24, seed=9)
    x = x[:torch.Size(shape).numel()].reshape(*shape, 80)
    matmul = Int8Matmul(weight, "w8a8")
    with torch.inference_mode():
        assert torch.equal(matmul(x), matmul(x.reshape(-1, 80)).reshape(*shape, 24))


@pytest.mark.parametrize("rows, k, n", SHAPES)
def test_the_w8a16_kernel_is_the_w8a16_product_and_row_invariant(rows, k, n):
    """float32 activations times int8 weights, then the channel scale: float64's product to float32 rounding; each
    row the same bits alone as in the call (an AR step and a verify call agree)."""
    weight, x = operands(rows, k, n, seed=4)
    q, scale = quantize_rows(weight)
    packed = pack_int8(q, scale)
    whole = int8_kernels().w8a16_linear(x, *packed, n)
    reference = (x.double() @ q.double().t()) * scale.double()
    assert ((whole.double() - reference).abs() <= 1e-5 * reference.abs().max()).all()
    assert all(torch.equal(int8_kernels().w8a16_linear(x[i:i + 1], *packed, n)[0], whole[i]) for i in range(rows))


def test_w8a16_matmuls_of_float32_take_the_kernel():
    weight, x = operands(3, 64, 20, seed=5)
    matmul = Int8Matmul(weight, "w8a16")
    with torch.inference_mode():
        assert torch.equal(matmul(x), int8_kernels().w8a16_linear(x, *pack_int8(*matmul.rows()), 20))


@pytest.mark.long
@pytest.mark.skipif(CAPPED in os.environ, reason="this is the capped run")
def test_one_w8a8_model_decodes_alike_natively_and_under_the_avx2_caps(tmp_path):
    """The predictor's states and logits bit for bit, greedy and seeded sampled codes (AR and speculative), and
    rvqspec.Engine's codes with int8 predictor and talker (greedy, and a seeded request sampled end to end): this
    class's kernels against the AVX2 class's (ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2: rvqspec's int8 GEMM,
    the fused kernels built without AVX-512) on this machine."""
    native = int8_codes.report()
    run = subprocess.run([sys.executable, str(ROOT / "tests/helpers/int8_codes.py"), str(tmp_path / "capped.pt")],
                         env=os.environ | AVX2_CAP, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    capped = torch.load(tmp_path / "capped.pt")
    assert capped.keys() == native.keys()
    assert [name for name in native if not torch.equal(native[name], capped[name])] == []


@pytest.mark.skipif(sys.platform != "linux" or fused.kernels() is None, reason="huge pages: Linux, the fused kernels")
def test_the_floors_copy_lies_on_huge_pages_as_the_packed_weights():
    """The floor (`copy_of`) copies between mappings of their own advised for huge pages, as rvqspec's packed weights
    lie (on 4 KiB pages the copy was a slower, easier floor)."""
    target = copy_of(8 << 20)()
    assert target.data_ptr() % (1 << 21) == 0 and target.nbytes == 4 << 20 and bool((target == 1).all())


def test_the_floor_report_names_each_schemes_kernel_and_its_fraction(monkeypatch):
    """What `rvqspec inspect --device` prints, on a tiny predictor: every scheme's stack, run as the engine runs it
    (w8a8: one native call), and its matrices one by one, timed against their bytes."""
    config = tiny_config(hidden=64, layers=2)
    primed = []
    timed = floor.median_ms
    monkeypatch.setattr(floor, "median_ms", lambda *a, **k: primed.append(k.get("primed")) or timed(*a, **k))
    report = one_row_steps(config=config, repeats=2, log=lambda line: None)
    assert primed == [True] * len(SCHEMES)  # each call timed after one of itself, as a step follows a step
    assert set(report["schemes"]) == set(SCHEMES) == set(report["kernels"])
    assert "rvqspec's AVX2" in report["kernels"]["w8a16"]
    matrices = 2 * (64 * 64 + 64 * 32 + 256 * 64 + 64 * 128)  # qkv (4 + 2 x 2 heads of 8), o, gate+up, down
    for scheme, figures in report["schemes"].items():
        assert figures["bytes"] == matrices * (4 if scheme == "float32" else 2 if scheme == "bfloat16" else 1)
        assert figures["of_floor"] > 0 and figures["matrices_of_floor"] > 0
        assert set(figures["rows_over_one"]) == {"4", "8"}
        assert figures["bandwidth_gb_s"] == pytest.approx(figures["bytes"] / figures["floor_ms"] / 1e6)
    w8a8 = report["schemes"]["w8a8"]
    assert w8a8["path"] == ("one native call" if w8a8_kernel() in ("vnni", "avx2") else "the fused Python loop")
    line = scheme_figures(w8a8)  # inspect's line: what it timed, then the matrices alone, labelled
    assert line.startswith(w8a8["path"]) and "the layer matrices alone, one call each" in line
