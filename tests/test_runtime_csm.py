"""Sesame CSM through `rvqspec.Engine` (runtime/csm.py): greedy codes equal transformers' own generate, AR and
speculative, alone and batched (a row's codes do not depend on the batch), its all-EOS frame ends a request as
upstream's generate does, upstream's settings reach the engine unchanged, and the audio is upstream's Mimi decode."""

import numpy as np
import pytest
import torch

import rvqspec
from rvqspec import ReusedHeads, RvqspecError, Sampler, default_tree
from rvqspec.integrations.csm import talker_from_csm

from helpers.csm_models import LLAMA3, prompts, tiny_csm

pytest.importorskip("transformers")

GREEDY = dict(do_sample=False, depth_decoder_do_sample=False)
MODES = [(None, None), (ReusedHeads(), default_tree(6))]
FRAMES = 12


def llama3_backbone(model):
    """The tiny model with the backbone's RoPE llama3-scaled too (as sesame/csm-1b's)."""
    from transformers.models.csm.modeling_csm import CsmRotaryEmbedding

    for config in {id(c): c for c in (model.config, model.backbone_model.config)}.values():
        config.rope_scaling = dict(LLAMA3)
    model.backbone_model.rotary_emb = CsmRotaryEmbedding(config=model.backbone_model.config)
    return model


@pytest.fixture(scope="module")
def csm():
    return llama3_backbone(tiny_csm(codebooks=8, seed=8))


@pytest.fixture(scope="module")
def three(csm):
    """Three one-row prompts and upstream's greedy codes for each (FRAMES frames)."""
    ids = prompts(3, seed=8)
    return ids, [upstream(csm, ids[i:i + 1], FRAMES)[0] for i in range(3)]


def upstream(model, ids: torch.Tensor, frames: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    mask = torch.ones_like(ids) if mask is None else mask
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=frames, **GREEDY)


def test_the_talker_shares_the_backbones_tensors_and_its_llama3_rope(csm):
    talker = talker_from_csm(csm)
    assert talker.codec_head.weight.data_ptr() == csm.lm_head.weight.data_ptr()
    assert talker.norm.weight.data_ptr() == csm.backbone_model.norm.weight.data_ptr()
    assert talker.config.rope_scaling == LLAMA3 and not talker.config.qk_norm
    upstream_freq = csm.backbone_model.rotary_emb.inv_freq
    assert torch.allclose(talker.rope.cos[:, :len(upstream_freq)][1], upstream_freq.float().cos())


@pytest.mark.parametrize("drafter, tree", MODES, ids=["ar", "speculative"])
def test_greedy_codes_equal_upstream_alone_and_batched(csm, three, drafter, tree):
    """Three requests, each alone then all submitted together: every one's codes are upstream's generate's."""
    (ids, reference), frames = three, FRAMES
    with rvqspec.Engine(csm, drafter=drafter, tree=tree, seed=0) as engine:
        alone = [engine.submit("csm", input_ids=ids[i:i + 1], max_new_tokens=frames, **GREEDY).wait()
                 for i in range(3)]
        requests = [engine.submit("csm", input_ids=ids[i:i + 1], max_new_tokens=frames, **GREEDY) for i in range(3)]
        together = [request.wait() for request in requests]
        frames_decoded = engine.status()["frames"]
    for want, one, batched in zip(reference, alone, together):
        assert torch.equal(one, want) and torch.equal(batched, want)
    assert frames_decoded == 2 * 3 * frames


def test_a_left_padded_batch_decodes_as_upstreams_batch(csm):
    """The processor's batch (left-padded, its attention mask): each row's prompt at upstream's positions."""
    pad = csm.config.pad_token_id
    ids = prompts(2, length=7, seed=4)
    ids[1, :3] = pad
    mask = (ids != pad).long()
    want = upstream(csm, ids, 10, mask)
    with rvqspec.Engine(csm, drafter=None, tree=None, seed=0) as engine:
        built = engine.model.prompts("csm", dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, **GREEDY))
        assert [len(p.embeds) for p in built] == [7, 4] and built[1].positions.tolist() == [0, 1, 2, 3]
        codes = [engine.enqueue(p, None).wait() for p in built]
    for row in range(2):
        assert torch.equal(codes[row], want[row])


def ending(seed: int = 3):
    """A model whose greedy frame 2 is all EOS: the depth decoder's heads zeroed (every code 0, the EOS code) and
    the c0 head's rows 0 and 4 swapped (upstream's c0 at frame 2 was 4: now 0)."""
    model = tiny_csm(codebooks=8, seed=seed)
    with torch.no_grad():
        model.depth_decoder.codebooks_head.weight.zero_()
        model.lm_head.weight[[0, 4]] = model.lm_head.weight[[4, 0]].clone()
    return model


@pytest.mark.parametrize("drafter, tree", MODES, ids=["ar", "speculative"])
def test_the_all_eos_frame_ends_a_request_as_upstream(drafter, tree):
    """Upstream stops after the first frame whose codes but the last are all EOS, and returns it; a request ends
    there too, while the other rows of its batch go on."""
    model, ids = ending(), prompts(2, seed=3)
    want = upstream(model, ids[:1], 12)[0]
    assert len(want) == 3 and bool((want[-1] == 0).all())
    other = upstream(model, ids[1:], 12)[0]
    with rvqspec.Engine(model, drafter=drafter, tree=tree, seed=0) as engine:
        requests = [engine.submit("csm", input_ids=ids[i:i + 1], max_new_tokens=12, **GREEDY) for i in range(2)]
        codes = [request.wait() for request in requests]
    assert torch.equal(codes[0], want) and torch.equal(codes[1], other)


def test_upstreams_settings_reach_the_engine_and_stay_off_the_model(csm):
    """The backbone's sampling settings become the c0 rules, depth_decoder_* the predictor's sampler, for that
    request only: the depth decoder's generation_config is as before (upstream's generate would keep them)."""
    ids, before = prompts(1), csm.depth_decoder.generation_config.to_dict()
    with rvqspec.Engine(csm, drafter=None, tree=None, seed=0) as engine:
        prompt, = engine.model.prompts("csm", dict(input_ids=ids, do_sample=True, temperature=0.7, top_k=5,
                                                   depth_decoder_do_sample=True, depth_decoder_temperature=0.5,
                                                   depth_decoder_top_p=0.9, max_new_tokens=9))
        default, = engine.model.prompts("csm", dict(input_ids=ids))
        with pytest.raises(RvqspecError, match="RepetitionPenalty"):
            engine.model.prompts("csm", dict(input_ids=ids, repetition_penalty=1.3))
        with pytest.raises(RvqspecError, match="one text"):
            engine.submit("csm", input_ids=prompts(2), max_new_tokens=4)
        with pytest.raises(RvqspecError, match="processor"):
            engine.speech("hello")
        with pytest.raises(RvqspecError, match="does not take"):
            engine.submit("csm", input_ids=ids, not_an_argument=1)
        assert not engine.can_clone and engine.voices() == []
    assert prompt.rules.sampler == Sampler(do_sample=True, temperature=0.7, top_k=5, top_p=1.0)
    assert prompt.sampler == Sampler(do_sample=True, temperature=0.5, top_k=50, top_p=0.9)
    assert prompt.max_new_tokens == 9 + 1  # c0 draws: the one after the 9th frame is never decoded
    assert default.max_new_tokens == 20 + 1 and not default.sampler.do_sample  # HF's max_length 20, greedy
    assert csm.depth_decoder.generation_config.to_dict() == before


def test_a_sampled_request_repeats_with_its_seed(csm):
    ids = prompts(1, seed=2)
    settings = dict(input_ids=ids, max_new_tokens=8, do_sample=True, temperature=0.9, depth_decoder_do_sample=True)
    with rvqspec.Engine(csm, drafter=ReusedHeads(), tree=default_tree(6), seed=0) as engine:
        first, again = (engine.submit("csm", seed=5, **settings).wait() for _ in range(2))
        other = engine.submit("csm", seed=6, **settings).wait()
    assert torch.equal(first, again) and not torch.equal(first, other)


@pytest.fixture(scope="module")
def audible():
    """A tiny CSM whose Mimi runs, scaled to be audible (tests/test_csm_streaming.py)."""
    model = tiny_csm(codebooks=8, vocab=32, seed=3, runnable_codec=True)
    with torch.no_grad():
        model.codec_model.decoder.layers[-1].conv.weight.mul_(1e3)
    return model


def test_an_audio_context_is_prefilled_as_upstream_merges_it(audible):
    """Text around an audio segment (input_values encoded by Mimi, its frames at the audio tokens, then the audio EOS
    token), as the processor lays them out: the engine's greedy codes are upstream's."""
    c, samples = audible.config, 24000 // 5
    audio = torch.randn(1, 1, samples, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 0.1
    frames = audible.codec_model.encode(audio).audio_codes.shape[-1]
    text = prompts(1, length=5, seed=1)[0]
    ids = torch.cat([text[:3], torch.full((frames,), c.audio_token_id), torch.tensor([c.audio_eos_token_id]),
                     text[3:]])[None]
    kwargs = dict(input_ids=ids, input_values=audio, input_values_cutoffs=torch.tensor([[samples]]),
                  max_new_tokens=10, **GREEDY)
    want = audible.generate(**kwargs)[0]
    with rvqspec.Engine(audible, drafter=ReusedHeads(), tree=default_tree(6), seed=0) as engine:
        assert torch.equal(engine.submit("csm", **kwargs).wait(), want)


def test_the_audio_is_upstreams_mimi_decode(audible):
    """A whole batch (`Engine.whole`) is generate(output_audio=True)'s audio; a request's chunks concatenate to its
    audio (20 frames: inside Mimi's left context, integrations/csm_stream.py)."""
    ids, kwargs = prompts(2, seed=3), dict(max_new_tokens=20, **GREEDY)
    want = [audio.float().numpy() for audio in audible.generate(input_ids=ids, output_audio=True, **kwargs)]
    with rvqspec.Engine(audible, drafter=None, tree=None, seed=0, chunk_frames=6) as engine:
        wavs, rate = engine.whole("csm", (), dict(input_ids=ids, **kwargs), None)
        chunks = list(engine.submit("csm", input_ids=ids[1:], **kwargs))
    assert rate == engine.sample_rate == audible.codec_model.config.sampling_rate and len(chunks) > 1
    for got, audio in zip(wavs, want):
        np.testing.assert_array_equal(got, audio)
    np.testing.assert_allclose(np.concatenate(chunks), want[1], atol=1e-9 * np.abs(want[1]).max())
