"""Parity with upstream qwen-tts: the same checkpoint folder, upstream's own model classes as reference.

Upstream writes the folder (`save_pretrained`); we load it with `MultiCodeDecoder.from_pretrained` and
compare against the in-memory upstream model that wrote it.
"""

import pytest
import torch
from scipy import stats

import rvqspec
from rvqspec.core import checkpoint

from helpers.upstream_models import require_upstream, save_upstream, tiny_upstream_model, upstream_generate

require_upstream()

from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,  # noqa: E402
                                                    TopPLogitsWarper)

GREEDY = rvqspec.Sampler(do_sample=False)
# Sampling test settings: top-k and top-p both active, temperature far enough from 1 that applying it
# before or after the top-k/top-p filters changes the distribution (total variation ~0.1 on this model).
SAMPLING = rvqspec.Sampler(do_sample=True, temperature=1.3, top_k=6, top_p=0.9)

# name -> (tiny_upstream_model kwargs, shards)
CHECKPOINTS = {
    "same-width": (dict(seed=0, talker_hidden=64, predictor_hidden=64, vocab=32, groups=16, head_scale=4.0), None),
    "projection": (dict(seed=1, talker_hidden=48, predictor_hidden=64, vocab=32, groups=16, head_scale=4.0), None),
    "sharded": (dict(seed=2, talker_hidden=64, predictor_hidden=64, vocab=32, groups=16, rope_theta=1e4), 3),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> (upstream model, checkpoint folder); built on first use."""
    cache = {}

    def get(name):
        if name not in cache:
            kwargs, shards = CHECKPOINTS[name]
            model = tiny_upstream_model(**kwargs)
            cache[name] = model, save_upstream(model, tmp_path_factory.mktemp(name), shards)
        return cache[name]

    return get


def random_frames(model, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Talker hidden states [n, H] (norm-sized, like the talker's final-norm output) and codes [n, G]."""
    talker = model.config.talker_config
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, talker.hidden_size, generator=g)
    codes = torch.randint(0, talker.code_predictor_config.vocab_size, (n, talker.num_code_groups), generator=g)
    codes[:, 0] = torch.randint(0, talker.vocab_size, (n,), generator=g)
    return hidden, codes


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_teacher_forced_logits_match_forward_finetune(saved, name):
    upstream, folder = saved(name)
    ours = rvqspec.MultiCodeDecoder.from_pretrained(folder, dtype=torch.float32)
    hidden, codes = random_frames(upstream, 16, seed=10)
    expected, _ = upstream.talker.forward_sub_talker_finetune(codes, hidden)  # -> code_predictor.forward_finetune
    got = ours.teacher_forced_logits(hidden, codes)
    assert got.shape == expected.shape == (16, 15, 32)
    diff = (got - expected).abs().max().item()
    assert diff <= 1e-5, f"{name}: max |logit diff| {diff:.2e} over {expected.numel()} logits"


def test_checkpoint_layouts_are_what_the_tests_claim(saved):
    _, sharded = saved("sharded")
    assert (sharded / "model.safetensors.index.json").is_file() and len(list(sharded.glob("*.safetensors"))) >= 2
    upstream, projection = saved("projection")
    assert isinstance(upstream.talker.code_predictor.small_to_mtp_projection, torch.nn.Linear)
    assert rvqspec.MultiCodeDecoder.from_pretrained(projection).project.weight.shape == (64, 48)


@pytest.mark.parametrize("name, frames", [("same-width", 200), ("projection", 50)])
def test_greedy_codes_match_upstream_generate(saved, name, frames):
    upstream, folder = saved(name)
    ours = rvqspec.MultiCodeDecoder.from_pretrained(folder, dtype=torch.float32)
    hidden, codes = random_frames(upstream, frames, seed=11)
    c0 = codes[:, 0]
    expected = upstream_generate(upstream, hidden, c0, GREEDY)
    got = torch.stack([rvqspec.decode_frame(ours, hidden[i], c0[i], GREEDY).codes for i in range(frames)])
    assert expected.shape == got.shape == (frames, 15)
    # How close the closest call was: the smallest top-1/top-2 logit gap along our greedy paths.
    logits = ours.teacher_forced_logits(hidden, torch.cat([c0[:, None], got], dim=1))
    gap = logits.topk(2, dim=-1).values.diff(dim=-1).abs().min().item()
    mismatched = (got != expected).any(dim=1).sum().item()
    assert mismatched == 0, f"{name}: {mismatched}/{frames} frames differ (smallest top-2 logit gap {gap:.2e})"


def hf_warp(logits: torch.Tensor, sampler: rvqspec.Sampler) -> torch.Tensor:
    """Hugging Face's warpers as `generate` builds them: temperature, top-k (unless 0), top-p (unless 1)."""
    warpers = [TemperatureLogitsWarper(sampler.temperature)]
    warpers += [TopKLogitsWarper(sampler.top_k)] if sampler.top_k else []
    warpers += [TopPLogitsWarper(sampler.top_p)] if sampler.top_p < 1 else []
    for warper in warpers:
        logits = warper(None, logits)
    return logits


def wrong_order_warp(logits: torch.Tensor, sampler: rvqspec.Sampler) -> torch.Tensor:
    """The bug the sampling test must catch: top-k and top-p before temperature."""
    for warper in (TopKLogitsWarper(sampler.top_k), TopPLogitsWarper(sampler.top_p),
                   TemperatureLogitsWarper(sampler.temperature)):
        logits = warper(None, logits)
    return logits


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.9, 50, 1.0), (0.9, 5, 1.0), (1.3, 6, 0.9), (0.5, 20, 0.7),
                                                       (1.0, 0, 0.3), (2.0, 3, 0.95)])
def test_sampler_process_matches_hf_warpers(temperature, top_k, top_p):
    sampler = rvqspec.Sampler(temperature=temperature, top_k=top_k, top_p=top_p)
    logits = torch.randn(256, 64, generator=torch.Generator().manual_seed(3)) * 3
    logits[:8, :4] = logits[:8, 4:5]  # ties at the top-k boundary are kept by both
    expected = hf_warp(logits, sampler)
    got = sampler.process(logits)
    assert torch.equal(got.isinf(), expected.isinf())
    assert torch.allclose(got, expected, atol=1e-6, rtol=0)


def exact_joint(upstream, hidden: torch.Tensor, c0: int, warp) -> torch.Tensor:
    """Exact probability of every code triple (c1, c2, c3) of a 4-group predictor, flattened [V^3], from
    upstream's teacher-forced logits under every prefix, with `warp` as the logits processing."""
    vocab = upstream.config.talker_config.code_predictor_config.vocab_size
    prefixes = torch.cartesian_prod(torch.arange(vocab), torch.arange(vocab))  # (c1, c2); c3 is never fed
    codes = torch.cat([torch.full((len(prefixes), 1), c0), prefixes, torch.zeros(len(prefixes), 1, dtype=torch.long)], 1)
    logits, _ = upstream.talker.forward_sub_talker_finetune(codes, hidden.expand(len(codes), -1))
    p = warp(logits.reshape(-1, vocab)).softmax(-1).reshape(vocab, vocab, 3, vocab).double()
    return (p[0, 0, 0][:, None, None] * p[:, 0, 1][:, :, None] * p[:, :, 2]).reshape(-1)


def g_test(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of a G-test of `counts` against `probs`; cells expected below 5 are pooled. A draw in a
    zero-probability cell (a token the filters remove) is an outright failure."""
    expected = probs / probs.sum() * counts.sum().item()
    if counts[probs == 0].sum() > 0:
        return 0.0
    small = expected < 5
    observed = torch.cat([counts[~small].double(), counts[small].sum().double().view(1)])
    expected = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = expected > 0
    return float(stats.power_divergence(observed[keep].numpy(), expected[keep].numpy(),
                                        lambda_="log-likelihood").pvalue)


def test_sampled_distribution_matches_upstream(tmp_path):
    upstream = tiny_upstream_model(seed=3, talker_hidden=64, predictor_hidden=64, vocab=8, groups=4, head_scale=10.0)
    ours = rvqspec.MultiCodeDecoder.from_pretrained(save_upstream(upstream, tmp_path))
    n, cells = 1500, 8 ** 3
    hidden, c0 = torch.randn(1, 64, generator=torch.Generator().manual_seed(4)), 5
    exact = exact_joint(upstream, hidden, c0, lambda x: hf_warp(x, SAMPLING))
    exact_wrong = exact_joint(upstream, hidden, c0, lambda x: wrong_order_warp(x, SAMPLING))
    assert 0.5 * (exact - exact_wrong).abs().sum() > 0.05  # the two orders really differ here

    def histogram(codes: torch.Tensor) -> torch.Tensor:
        return torch.bincount(codes[:, 0] * 64 + codes[:, 1] * 8 + codes[:, 2], minlength=cells)

    generator = torch.Generator().manual_seed(5)
    ours_counts = histogram(torch.stack([rvqspec.decode_frame(ours, hidden, c0, SAMPLING, generator).codes
                                         for _ in range(n)]))
    torch.manual_seed(6)  # upstream samples from the global generator
    upstream_counts = histogram(upstream_generate(upstream, hidden.expand(n, -1), torch.full((n,), c0), SAMPLING))
    wrong_draws = torch.multinomial(exact_wrong, n, replacement=True, generator=torch.Generator().manual_seed(7))
    wrong_counts = torch.bincount(wrong_draws, minlength=cells)  # what a wrong-order sampler would emit

    p_ours, p_upstream = g_test(ours_counts, exact), g_test(upstream_counts, exact)
    p_wrong_order, p_ours_vs_wrong = g_test(wrong_counts, exact), g_test(ours_counts, exact_wrong)
    seen = (ours_counts + upstream_counts) > 0
    p_two_sample = stats.chi2_contingency(torch.stack([ours_counts[seen], upstream_counts[seen]]).numpy()).pvalue
    figures = (f"G-test p: ours {p_ours:.3g}, upstream {p_upstream:.3g}, ours vs upstream {p_two_sample:.3g}; "
               f"wrong-order sample {p_wrong_order:.3g}, ours against wrong order {p_ours_vs_wrong:.3g}")
    print(figures)  # shown with `pytest -rP`
    assert min(p_ours, p_upstream, p_two_sample) > 1e-3, figures
    assert max(p_wrong_order, p_ours_vs_wrong) < 1e-6, figures


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_loads_in_dtype(saved, dtype):
    upstream, folder = saved("projection")
    ours = rvqspec.MultiCodeDecoder.from_pretrained(folder, dtype=dtype)
    assert {p.dtype for p in ours.parameters()} == {dtype} and ours.dtype == dtype
    official = upstream.state_dict()
    for name, tensor in checkpoint.official_state_dict(ours).items():
        assert torch.equal(tensor, official[name].to(dtype)), name
    hidden, codes = random_frames(upstream, 1, seed=12)
    result = rvqspec.decode_frame(ours, hidden[0], codes[0, 0], GREEDY)
    assert result.calls == 15 and result.codes.shape == (15,) and 0 <= result.codes.min() <= result.codes.max() < 32


class ReadRecorder:
    """Wraps safetensors' safe_open and records every tensor actually read."""

    def __init__(self, opener, read: list[str]):
        self.opener, self.read = opener, read

    def __call__(self, *args, **kwargs):
        recorder = self

        class Handle:
            def __init__(self):
                self.inner = recorder.opener(*args, **kwargs)

            def __enter__(self):
                self.file = self.inner.__enter__()
                return self

            def __exit__(self, *exc):
                return self.inner.__exit__(*exc)

            def keys(self):
                return self.file.keys()

            def get_slice(self, name):
                return self.file.get_slice(name)

            def get_tensor(self, name):
                recorder.read.append(name)
                return self.file.get_tensor(name)

        return Handle()


@pytest.mark.parametrize("name", ["same-width", "sharded"])
def test_reads_only_the_predictor_tensors(saved, monkeypatch, name):
    upstream, folder = saved(name)
    read: list[str] = []
    monkeypatch.setattr(checkpoint, "safe_open", ReadRecorder(checkpoint.safe_open, read))
    ours = rvqspec.MultiCodeDecoder.from_pretrained(folder)
    needed = {key for key in upstream.state_dict()
              if key.startswith("talker.code_predictor.") or key == "talker.model.codec_embedding.weight"}
    assert len(read) == len(set(read)) and set(read) == needed
    assert len(upstream.state_dict()) > len(needed) + 10  # the talker's own tensors were there, and left unread
    assert sum(p.numel() for p in ours.parameters()) == sum(upstream.state_dict()[k].numel() for k in needed)
