"""The CPU fast path (rvqspec/core/fused.py, draft_heads.py): which path runs where, and that it computes what the
plain path does.

Tolerances against the plain path, per dtype (the kernels compute in float32, double for float64, and keep the
plain path's roundings of the normalised value and of the residual stream, but not those inside RoPE and SiLU):
float64 1e-6 (upstream's RMSNorm normalises in float32 in every dtype, so both paths carry float32 roundings
that differ by summation order), float32 1e-5, bfloat16 within 2 ulp (relative 2 * 2^-8) elementwise on
kernel outputs and 2e-2 relative on a whole forward. Greedy codes are identical to AR in float64 on the fused
path (tests/test_speculative.py runs every drafter and tree there; here it is asserted that it is the fused path).
"""

import warnings
from dataclasses import replace

import pytest
import torch

from rvqspec.core import device_path, draft_heads, fused
from rvqspec.core.decode import decode_frame, decode_frames
from rvqspec.core.drafters import Offsets, ReusedHeads
from rvqspec.core.model import RMSNorm, rotate_half
from rvqspec.core.quantize import Int8Matmul, draft_scheme
from rvqspec.core.sampling import Sampler
from rvqspec.core.tree import default_tree

from helpers.tiny import random_frames, random_offsets, tiny_model

TOLERANCE = {torch.float64: dict(rtol=1e-6, atol=1e-6), torch.float32: dict(rtol=1e-5, atol=1e-5),
             torch.bfloat16: dict(rtol=2 ** -7, atol=2 ** -7)}
GREEDY = Sampler(do_sample=False)


def test_the_cpu_takes_the_fused_path_and_accelerators_the_plain_one():
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            assert device_path.choose("cpu", dtype).fused_kernels
            assert not device_path.choose("cuda", dtype).fused_kernels
        with fused.enabled(False):
            assert not device_path.choose("cpu", torch.bfloat16).fused_kernels
        cpu = device_path.choose("cpu", torch.bfloat16)
        assert cpu.fused_kernels and cpu.host_walk and not cpu.static_shapes
        for dtype in (torch.bfloat16, torch.float32):  # int8 draft heads where they measured faster on this CPU
            measured = device_path.decided(dtype)["int8_drafts"]  # prepared first: a forward never measures
            assert device_path.choose("cpu", dtype).int8_drafts == measured
        assert not device_path.choose("cpu", torch.float64).int8_drafts  # float64 measures nothing: exact heads
        cuda = device_path.choose("cuda", torch.bfloat16)
        assert cuda.static_shapes and not (cuda.host_walk or cuda.int8_drafts or cuda.packed_weights)
    with torch.enable_grad():  # training keeps the plain path
        path = device_path.choose("cpu", torch.bfloat16)
        assert not (path.fused_kernels or path.int8_drafts or path.packed_weights)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_each_kernel_matches_the_plain_ops(dtype):
    ops, tol = fused.kernels(), TOLERANCE[dtype]
    g = torch.Generator().manual_seed(0)
    x, delta = (torch.randn(2, 5, 64, generator=g).to(dtype) * 3 for _ in range(2))
    norm = RMSNorm(64, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64, generator=g) + 0.5)
    torch.testing.assert_close(ops.rms_norm(x, norm.weight, 1e-6), norm(x), **tol)
    total, normed = ops.add_rms_norm(x, delta, norm.weight, 1e-6)
    assert torch.equal(total, x + delta)  # the residual stream is rounded exactly as the plain add
    torch.testing.assert_close(normed, norm(x + delta), **tol)
    gate_up = torch.randn(2, 5, 2 * 48, generator=g).to(dtype) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_mul(gate_up), torch.nn.functional.silu(gate) * up, **tol)


@pytest.mark.parametrize("with_norms", [True, False], ids=["qk-norm", "no-qk-norm"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_qk_norm_rope_and_cache_write_match_the_plain_ops(dtype, with_norms):
    """Per-row positions (a batch), GQA head counts and scattered cache slots; without q/k norms (Llama-style
    layers) the kernel applies RoPE alone."""
    model = tiny_model(seed=1, dtype=dtype)
    attn, (batch, length, d) = model.layers[0].attn, (3, 4, model.config.head_dim)
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(batch, length, (attn.heads + 2 * attn.kv_heads) * d, generator=g).to(dtype)
    positions = torch.randint(0, 20, (batch, length), generator=g)
    cos, sin = model.rope(positions, dtype)  # [B, 1, T, D]
    slots = torch.tensor([7, 2, 9, 4])
    cache = model.new_cache(batch, 12)
    q_w, k_w = (attn.q_norm.weight, attn.k_norm.weight) if with_norms else (None, None)
    q = fused.kernels().qkv_rope(qkv, q_w, k_w, cos.reshape(batch, length, d), sin.reshape(batch, length, d), 1e-6,
                                 attn.heads, attn.kv_heads, cache.kv[0, 0], cache.kv[0, 1], slots)
    pq, pk, pv = qkv.split([attn.heads * d, attn.kv_heads * d, attn.kv_heads * d], dim=-1)
    pq, pk = pq.view(batch, length, -1, d), pk.view(batch, length, -1, d)
    if with_norms:
        pq, pk = attn.q_norm(pq), attn.k_norm(pk)
    pq, pk = pq.transpose(1, 2), pk.transpose(1, 2)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(q, pq * cos + rotate_half(pq) * sin, **tol)
    torch.testing.assert_close(cache.kv[0, 0][:, :, slots], pk * cos + rotate_half(pk) * sin, **tol)
    assert torch.equal(cache.kv[0, 1][:, :, slots], pv.view(batch, length, -1, d).transpose(1, 2))
    untouched = torch.ones(12, dtype=torch.bool)
    untouched[slots] = False
    assert not cache.kv[:, :, :, :, untouched].any() and not cache.kv[1:].any()


@pytest.mark.parametrize("csm", [False, True], ids=["qwen3-tts", "csm"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_a_cached_forward_matches_the_plain_path(dtype, csm):
    """A speculative-shaped call (per-row positions and tree masks) over a filled cache: hidden states and every
    cache entry; Qwen3 layers, and CSM's Llama layers (no q/k norms, llama3 RoPE)."""
    model = tiny_model(seed=5, dtype=dtype, talker_hidden=24, csm=csm)
    g = torch.Generator().manual_seed(6)
    batch, length, slots = 2, 5, 16 + 5
    x = torch.randn(batch, length, model.config.hidden_size, generator=g).to(dtype)
    positions = torch.tensor([[3, 4, 4, 5, 5], [6, 7, 7, 8, 8]])
    mask = torch.rand(batch, length, slots, generator=g) < 0.6
    mask[:, :, 0] = True
    caches = [model.new_cache(batch, slots) for _ in range(2)]
    filled = torch.randn(caches[0].kv.shape, generator=g).to(dtype)
    with torch.inference_mode():
        for cache in caches:
            cache.kv.copy_(filled)
        with fused.enabled(False):
            plain = model(x, positions, mask, caches[0], torch.arange(16, 21))
        fast = model(x, positions, mask, caches[1], torch.arange(16, 21))
    if dtype in (torch.bfloat16, torch.float16):  # roundings inside the layers compound: compare relatively
        assert ((fast.float() - plain.float()).norm() / plain.float().norm()) < 2e-2
        assert ((caches[1].kv.float() - caches[0].kv.float()).norm() / caches[0].kv.float().norm()) < 2e-2
    else:
        torch.testing.assert_close(fast, plain, **TOLERANCE[dtype])
        torch.testing.assert_close(caches[1].kv, caches[0].kv, **TOLERANCE[dtype])


def test_greedy_codes_in_float64_are_the_plain_paths_and_ar_ones():
    """Fused AR = plain AR = fused speculative (batches included), greedy, float64."""
    model = tiny_model(seed=7, groups=16)
    frames = random_frames(model, 12, seed=8)
    hidden, c0 = torch.stack([h for h, _ in frames]), torch.tensor([c for _, c in frames])
    with torch.inference_mode():
        assert device_path.choose(model.device, model.dtype).fused_kernels
    with fused.enabled(False):
        plain = decode_frames(model, hidden, c0, GREEDY).codes
    assert torch.equal(decode_frames(model, hidden, c0, GREEDY).codes, plain)
    for drafter in (ReusedHeads(model), random_offsets(model, 3, seed=9)):
        assert torch.equal(decode_frames(model, hidden, c0, GREEDY, drafter=drafter, tree=default_tree(16)).codes,
                           plain)


def test_int8_draft_heads_rank_like_the_exact_ones():
    """Quantisation error within half a step per weight (plus the scale's rounding to bfloat16); drafts (top candidates) as the exact heads' in nearly every
    row (bfloat16, the dtype they are used in)."""
    model = tiny_model(seed=10, vocab=64, hidden=64, dtype=torch.bfloat16)
    for head, q, scale in zip(model.heads, *model.head_set.draft_heads(model.heads).rows()):
        scale = scale.bfloat16()
        assert ((q.float() * scale[:, None].float() - head.float()).abs() <= scale[:, None].float() * (0.5 + 127 * 2 ** -8)).all()  # + the bf16 scale
    hidden = torch.randn(200, 64, generator=torch.Generator().manual_seed(11)).to(torch.bfloat16)
    drafter = Offsets.for_model(model)
    with torch.inference_mode():
        fast = drafter.logits(model, hidden, [3] * 200, 3, rank_only=True).topk(2, dim=-1).indices
        exact = drafter.logits(model, hidden, [3] * 200, 3).topk(2, dim=-1).indices
    assert (fast == exact).float().mean() > 0.95
    with torch.no_grad():
        model.heads.mul_(2)  # an in-place change re-quantises
    drafts = model.head_set.draft_heads(model.heads)
    assert torch.equal(drafts.rows()[0][0], Int8Matmul(model.heads[0], draft_scheme()).rows()[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_rounds_draft_heads_in_one_call_rank_as_one_call_per_depth(dtype):
    """Rows at one position: the K int8 draft heads as one native call (`draft_heads.span_logits`) give each depth the
    bits of its own head's call, for one input (ReusedHeads) and one per depth (Offsets), past the frame's end too."""
    model = tiny_model(seed=14, vocab=64, hidden=64, dtype=dtype)
    path = replace(device_path.choose("cpu", dtype), int8_drafts=True, static_shapes=False)
    hidden = torch.randn(3, 64, generator=torch.Generator().manual_seed(15)).to(dtype)
    last = model.config.num_residual_codes
    with torch.inference_mode():
        if draft_heads.one_call(model, [2] * 3, path) is None:
            pytest.skip(f"int8 drafts in {draft_scheme()} here: one call per head")
        for drafter in (ReusedHeads(model), random_offsets(model, 3, seed=16)):
            for k in (2, last - 2):  # all depths, and one past the last code
                together = drafter.logits(model, hidden, [k] * 3, 3, rank_only=True, path=path)
                reach = min(3, last - k)
                alone = [drafter.head(model, hidden, [k] * 3, j, path, rank_only=True) for j in range(1, reach + 1)]
                assert torch.equal(together[:, :reach], torch.stack(alone, dim=1))
                assert not together[:, reach:].any()


def test_without_the_extension_decoding_warns_once_and_takes_the_plain_path(monkeypatch):
    import torch.utils.cpp_extension as cpp_extension

    def no_build(*args, **kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(fused, "_state", {"enabled": True, "module": None, "tried": False})
    monkeypatch.setattr(cpp_extension, "load", no_build)
    model = tiny_model(seed=12)
    h, c0 = random_frames(model, 1, seed=13)[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not device_path.choose("cpu", torch.float64).fused_kernels
        assert not device_path.choose("cpu", torch.float32).fused_kernels
        codes = decode_frame(model, h, c0, GREEDY, drafter=ReusedHeads(model), tree=default_tree(8)).codes
    messages = [str(w.message) for w in caught if "fused CPU kernels" in str(w.message)]
    assert len(messages) == 1 and "Ninja is required" in messages[0] and "plain" in messages[0]
    assert torch.equal(codes, decode_frame(model, h, c0, GREEDY).codes)


def test_teacher_forcing_without_a_cache_takes_the_fused_path_under_no_grad_only():
    model = tiny_model(seed=14, dtype=torch.float32)
    h, c0 = random_frames(model, 1, seed=15)[0]
    codes = torch.cat([torch.tensor([c0]), decode_frame(model, h, c0, GREEDY).codes])[None]
    with torch.no_grad():
        fast = model.teacher_forced_hidden(h[None], codes)
        with fused.enabled(False):
            plain = model.teacher_forced_hidden(h[None], codes)
    torch.testing.assert_close(fast, plain, **TOLERANCE[torch.float32])
    trained = model.teacher_forced_hidden(h[None], codes)  # grad enabled: the plain path, differentiable
    assert trained.grad_fn is not None
    torch.testing.assert_close(trained.detach(), plain, rtol=0, atol=0)


@pytest.mark.long
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_speculative_decoding_runs_at_every_width(dtype):
    """torch's int8 kernel crashed (segfault) on widths and vocabularies that are not multiples of 16: such models
    rank their drafts with the exact heads, others pad the vocabulary; each runs in a process of its own."""
    import subprocess
    import sys

    code = ("import torch; from rvqspec import *; from rvqspec.core.config import PredictorConfig\n"
            "for hidden in range(8, 129, 8):\n"
            "    c = PredictorConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,\n"
            "        num_attention_heads=2, num_key_value_heads=1, head_dim=4, vocab_size=35, num_code_groups=16,\n"
            "        talker_hidden_size=hidden, talker_vocab_size=40)\n"
            f"    m = MultiCodeDecoder(c).eval().to({dtype})\n"
            "    r = decode_frames(m, torch.randn(3, hidden), torch.tensor([1, 2, 3]), Sampler(), drafter=ReusedHeads(),\n"
            "                      tree=default_tree(8))\n"
            "    assert r.codes.shape == (3, 15)\n"
            "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-500:]


def test_a_speculative_frame_at_the_real_size_in_bfloat16():
    """Real sizes reach code that tiny models do not (a head tensor of 2^25 elements, packed weights, int8 drafts
    at width 1024): the probe of `MultiCodeDecoder.refresh` once indexed past the end of one."""
    from rvqspec.bench.controlled import controlled_predictor
    from rvqspec.core.config import QWEN3_TTS_0_6B

    predictor = controlled_predictor(QWEN3_TTS_0_6B, 6.0, dtype="bfloat16")
    h, c0 = predictor.frames(1, seed=1)[0]
    result = decode_frame(predictor.model, h, c0, Sampler(), drafter=ReusedHeads(), tree=default_tree(16))
    assert result.codes.shape == (15,) and result.calls < 15
