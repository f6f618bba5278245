"""The native draw (`rvqspec.core.draw`, draw.cpp): `Sampler.sample_noise`'s draw in one call. It is its float32
arithmetic exactly (a NumPy reference, operation by operation), torch's draw but at near-ties (torch's softmax rounds
otherwise in the last bits), the same bits under the AVX2 caps, and top-p keeps torch's ops. Spec == AR and a row's
codes alone == in a batch go through it in tests/test_bit_exact.py and tests/test_row_draws.py; its distribution in
tests/test_distribution.py."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from rvqspec.core import draw, fused
from rvqspec.core.sampling import Sampler

pytestmark = pytest.mark.skipif(draw.kernel() is None, reason="the native draw could not be built here")

SETTINGS = [(0.9, 50), (1.0, 0), (0.37, 1), (1.0, 7), (2.0, 3000)]  # (temperature, top_k): top_k past V keeps all
ROWS, VOCAB = 64, 2048


def inputs(seed: int, ties: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Random logits [ROWS, VOCAB] (rounded to halves where `ties`: many equal to the k-th) and Exp(1) noise."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(ROWS, VOCAB, generator=generator) * 3
    logits = (logits * 2).round() / 2 if ties else logits
    return logits, torch.empty(ROWS, VOCAB).exponential_(generator=generator)


def reference(logits: torch.Tensor, noise: torch.Tensor, temperature: float, top_k: int) -> np.ndarray:
    """draw.cpp's arithmetic in NumPy float32, one operation at a time (the weights' exp in float64, then rounded;
    their sum in index order)."""
    scores = logits.numpy()
    scores = scores / np.float32(temperature) if temperature != 1.0 else scores
    kth = np.sort(scores, axis=-1)[:, -top_k][:, None] if 0 < top_k < scores.shape[1] else np.float32(-np.inf)
    shifted = scores - scores.max(-1, keepdims=True)
    weights = np.where(scores < kth, np.float32(0), np.exp(shifted.astype(np.float64)).astype(np.float32))
    inverse = np.float32(1) / np.add.accumulate(weights, axis=-1, dtype=np.float32)[:, -1:]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.argmax(weights * inverse / noise.numpy(), axis=-1)


@pytest.mark.parametrize("temperature, top_k", SETTINGS)
@pytest.mark.parametrize("ties", [False, True], ids=["random", "ties-at-kth"])
def test_the_native_draw_is_its_float32_arithmetic(temperature, top_k, ties):
    logits, noise = inputs(1, ties)
    noise[3, 5], noise[4, 6] = 0.0, 0.0  # 0 / 0 = NaN at a removed token wins in torch's argmax, inf at a kept one
    logits[4, 6] = logits[4].max() + 1
    logits[5, :100] = float("-inf")
    native = draw.draws(logits, noise, temperature, top_k)
    assert native.tolist() == reference(logits, noise, temperature, top_k).tolist()
    assert native[3] == 5 and native[4] == 6  # NaN (a removed token) or inf (a kept one): either wins


@pytest.mark.parametrize("temperature, top_k", SETTINGS)
@pytest.mark.parametrize("ties", [False, True], ids=["random", "ties-at-kth"])
def test_the_native_draw_is_torchs_draw_but_at_near_ties(temperature, top_k, ties):
    """Each row's draw through the Sampler (native here) and through torch's ops (the plain path): a different
    draw only where torch's own p / noise of the two tokens lie within 1e-5 of each other."""
    sampler = Sampler(temperature=temperature, top_k=top_k)
    mismatched = 0
    for seed in range(4):
        logits, noise = inputs(10 + seed, ties)
        native = sampler.sample_noise(logits, noise)
        with fused.enabled(False):
            plain = sampler.sample_noise(logits, noise)
        values = sampler.process(logits).softmax(-1) / noise
        for row in torch.nonzero(native != plain).flatten().tolist():
            a, b = values[row, native[row]], values[row, plain[row]]
            assert abs(a - b) <= 1e-5 * b, f"row {row}: {native[row]} drawn, torch draws {plain[row]}"
            mismatched += 1
    assert mismatched <= 2  # near-ties are rare: 0 in these 256 rows when written


def test_the_native_draw_reads_strided_rows_and_any_float_dtype():
    logits, noise = inputs(2)
    frame_noise = torch.stack([noise, torch.ones_like(noise)], dim=1)  # a frame's [rows, codes, V]: strided rows
    wide = Sampler().sample_noise(logits, noise)
    assert torch.equal(Sampler().sample_noise(logits, frame_noise[:, 0]), wide)
    half = logits.bfloat16()
    assert torch.equal(Sampler().sample_noise(half, noise), Sampler().sample_noise(half.float(), noise))


def test_top_p_keeps_torchs_draw():
    sampler, (logits, noise) = Sampler(top_p=0.8), inputs(3)
    expected = sampler.process(logits).softmax(-1).div_(noise).argmax(-1)
    assert torch.equal(sampler.sample_noise(logits, noise), expected)


def test_the_native_draw_gives_the_same_codes_under_the_avx2_caps():
    """One build for every class (no -march): a process capped to the AVX2 class draws the same codes."""
    code = ("import torch; from rvqspec.core import draw; from tests.test_native_draw import inputs; "
            "print(draw.draws(*inputs(5, True), 0.9, 50).tolist())")
    env = os.environ | {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    capped = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True,
                            check=True, timeout=300)
    assert capped.stdout.strip() == str(draw.draws(*inputs(5, True), 0.9, 50).tolist())


def test_the_plain_path_neither_builds_nor_loads_the_native_draw(monkeypatch):
    """With the fast path off (RVQSPEC_FUSED=0, `fused.enabled(False)`) a draw takes torch's ops without asking for
    the native module: nothing is compiled for a user who turned the path off (nor for an accelerator's tensors)."""
    asked = []
    monkeypatch.setattr(draw, "kernel", lambda: asked.append(1))
    logits, noise = inputs(3)
    with fused.enabled(False):
        assert draw.draws(logits, noise, 0.9, 50) is None
        Sampler().sample_noise(logits, noise)
    assert asked == []
