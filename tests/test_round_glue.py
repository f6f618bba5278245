"""Issue 51, item 1 (the speculative predictor frame's glue): a frame's noise held as the float64 uniforms torch's
exponential_ makes its Exp(1) values from, made into them by the native draw for the tokens it reads. The values, the
generator's stream and so every seeded code are those of the float32 noise; the draw takes bfloat16 logits as their
float32 widening."""

import pytest
import torch

from rvqspec.core import draw
from rvqspec.core.context import frame_noise
from rvqspec.core.decode import decode_frames
from rvqspec.core.drafters import ReusedHeads
from rvqspec.core.sampling import Sampler, exponential, fill_noise
from rvqspec.core.tree import default_tree

from helpers.tiny import random_frames, tiny_model

native = pytest.mark.skipif(draw.kernel() is None, reason="the native draw could not be built here")
SETTINGS = [(0.9, 50), (1.0, 0), (2.0, 3)]  # (temperature, top_k): top_k 0 reads every token's noise


@pytest.mark.parametrize("shape", [(1, 15, 2048), (3, 4, 17), (2, 31, 1)])
def test_uniform_noise_is_torchs_exponential_noise_and_takes_the_same_stream(shape):
    for seed in range(3):
        ours, theirs = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        uniforms = fill_noise(torch.empty(shape, dtype=torch.float64), [ours] * shape[0])
        expected = fill_noise(torch.empty(shape), [theirs] * shape[0])
        assert torch.equal(exponential(uniforms), expected)
        assert torch.equal(torch.rand(4, generator=ours), torch.rand(4, generator=theirs))


def noise_pair(seed: int, rows: int = 32, vocab: int = 2048) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random logits [rows, vocab], uniforms and the Exp(1) noise exponential_ draws from the same seed."""
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed + 100)) * 3
    uniforms = torch.empty(rows, vocab, dtype=torch.float64).uniform_(generator=torch.Generator().manual_seed(seed))
    return logits, uniforms, torch.empty(rows, vocab).exponential_(generator=torch.Generator().manual_seed(seed))


@native
@pytest.mark.parametrize("temperature, top_k", SETTINGS)
def test_the_native_draw_on_uniforms_is_its_draw_on_their_exponential_noise(temperature, top_k):
    for seed in range(8):
        logits, uniforms, noise = noise_pair(seed)
        uniforms[3, 5] = 0.0  # Exp(1) noise 0: NaN (a removed token) or inf (a kept one) wins, read from u = 0 too
        noise[3, 5] = 0.0
        assert torch.equal(draw.draws(logits, uniforms, temperature, top_k), draw.draws(logits, noise, temperature,
                                                                                        top_k))


@native
def test_the_native_draw_takes_bfloat16_logits_as_their_float32_widening():
    logits, uniforms, noise = noise_pair(2)
    half = logits.bfloat16()
    for n in (uniforms, noise):
        assert torch.equal(draw.draws(half, n, 0.9, 50), draw.draws(half.float(), n, 0.9, 50))


@native
def test_a_frames_noise_is_uniforms_only_where_the_draws_are_native():
    model = tiny_model(seed=1, hidden=64, layers=1, vocab=64)
    assert frame_noise(model, Sampler(), None, 1, 1).dtype == torch.float64
    assert frame_noise(model, Sampler(top_p=0.9), None, 1, 1).dtype == torch.float32  # top-p: torch's ops
    assert frame_noise(model, Sampler(do_sample=False), None, 1, 1) is None


@native
@pytest.mark.parametrize("speculative", [False, True], ids=["ar", "speculative"])
def test_seeded_codes_are_the_same_with_uniform_noise(speculative, monkeypatch):
    """The same seeds give the same codes whether the frame holds uniforms or exponential_'s float32 noise, AR and
    speculative, alone and in a batch."""
    model = tiny_model(seed=2, hidden=64, layers=2, vocab=64)
    inputs = random_frames(model, 3, 4)
    hidden, c0 = torch.stack([h for h, _ in inputs]), torch.tensor([c for _, c in inputs])
    options = {"drafter": ReusedHeads(model, 3), "tree": default_tree(8)} if speculative else {}

    def codes() -> torch.Tensor:
        generators = [torch.Generator().manual_seed(seed) for seed in (7, 8, 9)]
        return decode_frames(model, hidden, c0, Sampler(), generators, **options).codes

    uniform = codes()
    monkeypatch.setattr(draw, "takes_uniforms", lambda device, top_p: False)
    assert torch.equal(uniform, codes())


@native
def test_a_sampler_that_draws_its_own_way_gets_exp_noise():
    class Own(Sampler):
        def sample_noise(self, logits, noise):
            return super().sample_noise(logits, noise)

    model = tiny_model(seed=1, hidden=64, layers=1, vocab=64)
    assert frame_noise(model, Own(), None, 1, 1).dtype == torch.float32
