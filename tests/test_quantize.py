"""Quantized weights (`core/quantize.py`): every row of a call gets the bits it gets alone, so speculation is exact
relative to the quantized model: greedy codes equal its AR codes (batched, every scheme, drafter and tree), sampled
codes follow its own AR distribution (G-test against the enumeration), and what needs float weights is refused."""

import itertools

import pytest
import torch
from test_distribution import DEPLOYED, FULL, g_test

from rvqspec import MultiCodeDecoder, RvqspecError, Sampler, Tree, decode_frame, decode_frames, default_tree, quantize
from rvqspec.core.drafters import ReusedHeads, make_drafter
from rvqspec.core.quantize import (SCHEMES, ZERO_POINT, Int8Matmul, QuantizedLinear, quantize_linears,
                                     quantize_tokens, restore_linears, w8a8_kernel)

from helpers.tiny import random_frames, random_medusa, random_offsets, tiny_model

GREEDY = Sampler(do_sample=False)
DTYPES = (torch.float32, torch.bfloat16)
# w8a8 needs int8 dot products or rvqspec's AVX2 kernel (refused elsewhere: test_cpu_classes.py); HERE: each scheme,
# so marked.
needs_w8a8 = pytest.mark.skipif(w8a8_kernel() is None, reason="w8a8 needs int8 dot products or rvqspec's AVX2 kernel")
HERE = [pytest.param(s, marks=needs_w8a8) if s == "w8a8" else s for s in SCHEMES]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scheme", HERE)
def test_every_row_of_a_call_gets_the_bits_it_gets_alone(scheme, dtype):
    """What makes a verify call compute, per token, exactly what that token's AR step computes."""
    torch.manual_seed(0)
    weight, x = torch.randn(48, 32), torch.randn(40, 32).to(dtype)
    matmul = Int8Matmul(weight, scheme)
    for rows in (1, 2, 5, 17, 33, 40):
        whole = matmul(x[:rows])
        assert all(torch.equal(whole[i], matmul(x[i:i + 1])[0]) for i in range(rows))
    exact = x.float() @ weight.t()
    assert (matmul(x).float() - exact).abs().max() < 0.05 * exact.abs().max()  # int8 is close, not equal


def test_token_scales_come_from_each_row_alone():
    x = torch.randn(6, 16)
    x[3] *= 1000  # one loud token must not change the others' quantization
    q, scale = quantize_tokens(x)
    for i in range(6):
        alone_q, alone_scale = quantize_tokens(x[i:i + 1])
        assert torch.equal(q[i], alone_q[0]) and torch.equal(scale[i], alone_scale[0])
    assert (q.int() - ZERO_POINT).abs().max() == 127 and q.dtype == torch.uint8


@pytest.mark.parametrize("scheme", HERE)
def test_quantized_speculative_codes_equal_its_ar_codes_when_greedy(scheme):
    """float32 activations: in bfloat16 the attention's roundings differ between a verify call and an AR step, for
    the float model as for a quantized one, so near-ties can go either way there."""
    dtype = torch.float32
    model = tiny_model(seed=3, dtype=dtype)
    quantized = quantize(model, scheme)
    frames = random_frames(model, 6, seed=4)
    hidden, c0 = torch.stack([h for h, _ in frames]).to(dtype), torch.tensor([c for _, c in frames])
    ar = decode_frames(quantized, hidden, c0, GREEDY).codes
    drafters = [ReusedHeads(model), random_offsets(model, 3, seed=5), random_medusa(model, 3, seed=6)]
    for drafter, tree in itertools.product(drafters, [Tree.chain(3), default_tree(6), default_tree(8), default_tree(32)]):
        assert torch.equal(decode_frames(quantized, hidden, c0, GREEDY, drafter=drafter, tree=tree).codes, ar)
    for row, (h, c) in enumerate(frames):  # a batch of one each: the same codes as in the batch
        assert torch.equal(decode_frame(quantized, h.to(dtype), c, GREEDY, drafter=drafters[0], tree=FULL).codes, ar[row])
    float_codes = decode_frames(model, hidden, c0, GREEDY).codes
    assert (float_codes != ar).any() or scheme == "w8a16"  # a different model (w8a16 may round to the same codes)


@needs_w8a8
def test_quantizing_leaves_the_original_model_as_it_was():
    model = tiny_model(seed=1, dtype=torch.float32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    quantized = quantize(model, "w8a8")
    assert model.weights == "float" and quantized.weights == "w8a8" and quantized.heads is None
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    h, c0 = random_frames(model, 1, seed=2)[0]
    assert decode_frame(model, h, c0, GREEDY).codes.shape == (15,)


@torch.no_grad()
def quantized_joint(model: MultiCodeDecoder, sampler: Sampler, talker_hidden, c0: int) -> torch.Tensor:
    """The quantized model's AR probability of every (c1, c2, c3), from its own int8 heads under teacher forcing."""
    vocab, last = model.config.vocab_size, model.config.num_residual_codes
    outcomes = torch.tensor(list(itertools.product(range(vocab), repeat=last)))
    codes = torch.cat([torch.full((len(outcomes), 1), c0), outcomes], dim=1)
    h = model.teacher_forced_hidden(talker_hidden.expand(len(outcomes), -1), codes)
    logits = torch.stack([model.head_logits(h[:, g], g) for g in range(1, last + 1)], dim=1)
    return sampler.probs(logits).double().gather(-1, outcomes[..., None]).squeeze(-1).prod(-1)


@pytest.mark.parametrize("scheme", HERE)
def test_quantized_sampled_codes_follow_its_own_ar_distribution(scheme):
    """The enumerated G-test of test_distribution, on the quantized model (4 codebooks of 4 codes, hidden 16)."""
    model = quantize(tiny_model(seed=3, groups=4, vocab=4, hidden=16, layers=1, dtype=torch.float32), scheme)
    talker_hidden, c0 = random_frames(model, 1, seed=4)[0]
    probs = quantized_joint(model, DEPLOYED, talker_hidden, c0)
    generator, place = torch.Generator().manual_seed(2), 4 ** torch.arange(2, -1, -1)
    counts = {"ar": torch.zeros(64, dtype=torch.long), "spec": torch.zeros(64, dtype=torch.long)}
    hidden, c0s = talker_hidden.expand(4, -1), torch.full((4,), c0)
    for _ in range(300):  # batches of 4: 1200 frames each
        for name, drafter in (("ar", None), ("spec", ReusedHeads(model))):
            rows = decode_frames(model, hidden, c0s, DEPLOYED, generator, drafter=drafter, tree=FULL).rows
            for frame in rows:
                counts[name][int((frame.codes * place).sum())] += 1
    for name, observed in counts.items():
        assert g_test(observed, probs) > 1e-3, name


@needs_w8a8
def test_what_needs_float_weights_is_refused(tmp_path):
    model = tiny_model(seed=1, dtype=torch.float32)
    quantized = quantize(model, "w8a8")
    with pytest.raises(RvqspecError, match="unknown weights scheme 'w4'"):
        quantize(model, "w4")
    with pytest.raises(RvqspecError, match="already w8a8-quantized"):
        quantize(quantized, "w8a16")
    for refused in (lambda: quantized.save_pretrained(tmp_path / "q"), lambda: make_drafter("medusa", quantized),
                    lambda: make_drafter("offsets", quantized),
                    lambda: quantized.teacher_forced_logits(torch.zeros(1, 32), torch.zeros(1, 16, dtype=torch.long))):
        with pytest.raises(RvqspecError, match="needs the float model, and this one holds w8a8 weights"):
            refused()
    assert not (tmp_path / "q").exists()
    with pytest.raises(RvqspecError, match="w8a16 needs input widths that are multiples of 16"):
        quantize(tiny_model(hidden=24, dtype=torch.float32), "w8a16")
    with pytest.raises(RvqspecError, match="unknown weights scheme"):  # before anything is read
        MultiCodeDecoder.from_pretrained(tmp_path / "missing", weights="int3")


@needs_w8a8
def test_from_pretrained_quantizes_what_it_loads(tmp_path):
    model = tiny_model(seed=2, dtype=torch.float32)
    model.save_pretrained(tmp_path / "ckpt")
    loaded = MultiCodeDecoder.from_pretrained(tmp_path / "ckpt", weights="w8a8")
    h, c0 = random_frames(model, 1, seed=3)[0]
    assert loaded.weights == "w8a8"
    assert torch.equal(decode_frame(loaded, h, c0, GREEDY).codes, decode_frame(quantize(model, "w8a8"), h, c0,
                                                                               GREEDY).codes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_the_fused_token_quantization_gives_the_plain_ops_bits(dtype):
    from rvqspec.core import fused

    x, acc = torch.randn(37, 64).to(dtype) * 3, torch.randn(37, 48)
    x[5] = 0  # an all-zero token: the scale's floor
    x[6] = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5, 1.5, 126.5, -126.5] * 8)  # scale 1: ties round half to even
    x[7, 3], x[8, 9], x[9, 0] = float("nan"), float("inf"), -float("inf")  # non-finite: scale NaN, q zero
    q, scale = quantize_tokens(x)
    fused_q, fused_scale = fused.kernels().quantize_rows(x)
    assert torch.equal(q, fused_q) and torch.equal(scale.nan_to_num(-1.0), fused_scale.nan_to_num(-1.0))
    assert (q[6, :8].int() - ZERO_POINT).tolist() == [127, 2, -4, 0, 0, 2, 126, -126]
    assert scale[7:10].isnan().all() and (q[7:10] == ZERO_POINT).all() and scale.isnan().sum() == 3
    torch.testing.assert_close(fused.kernels().scale_rows(acc, scale, x), (acc * scale).to(dtype), rtol=0, atol=0,
                               equal_nan=True)  # NaN rows stay NaN
    wide = torch.randn(5, 1001).to(dtype) * 40  # a width that is no multiple of the vector length
    assert all(torch.equal(a, b) for a, b in zip(quantize_tokens(wide), fused.kernels().quantize_rows(wide)))


@needs_w8a8
def test_quantize_linears_swaps_in_place_and_leaves_nothing_half_done():
    """quantize_linears (a talker's layers): every Linear outside `keep` becomes int8 with nearly the float output;
    restore_linears puts the originals back; a layer the scheme cannot take leaves every layer as it was."""
    torch.manual_seed(0)
    kept = torch.nn.Linear(32, 32)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.SiLU(), torch.nn.Sequential(torch.nn.Linear(64, 32)),
                              kept)
    originals, x = list(net.modules()), torch.randn(5, 32)
    expected = net(x)
    swapped = quantize_linears(net, "w8a8", keep=(kept,))
    assert [type(m) for m in (net[0], net[2][0], net[3])] == [QuantizedLinear, QuantizedLinear, torch.nn.Linear]
    assert torch.allclose(net(x), expected, atol=0.05, rtol=0.05) and not torch.equal(net(x), expected)
    restore_linears(swapped)
    assert list(net.modules()) == originals and torch.equal(net(x), expected)
    odd = torch.nn.Sequential(torch.nn.Linear(32, 17), torch.nn.Linear(17, 8))
    before = list(odd.modules())
    with pytest.raises(RvqspecError, match="multiples of 16"):
        quantize_linears(odd, "w8a16")
    assert list(odd.modules()) == before
