"""Sesame CSM streams through transformers' streamer: the same codes as its generate, audio chunks equal to
its whole-utterance Mimi decode while the utterance fits in the left context, and the measured difference
beyond (transformers' Mimi has no convolution state for decoding: rvqspec.integrations.csm_stream)."""

import threading

import numpy as np
import pytest
import torch

import rvqspec
from rvqspec import ReusedHeads, RvqspecError, default_tree
from rvqspec.integrations.csm_stream import LEFT_CONTEXT_FRAMES

from helpers.csm_models import prompts, tiny_csm


def generate_kwargs(ids: torch.Tensor, frames: int) -> dict:
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=frames, min_new_tokens=frames,
                do_sample=False, depth_decoder_do_sample=False)


def audible(model) -> None:
    """Mimi's random decoder is near-silent at std 0.02: scale its output convolution (float64 model)."""
    with torch.no_grad():
        last = model.codec_model.decoder.layers[-1].conv
        last.weight.mul_(1e3)


@pytest.fixture(scope="module")
def csm():
    model = tiny_csm(codebooks=8, vocab=32, seed=3, runnable_codec=True)  # codes inside the tiny Mimi's 32-entry codebooks
    audible(model)
    return model


@pytest.mark.parametrize("drafter", [None, ReusedHeads()], ids=["ar", "speculative"])
def test_streamed_audio_equals_the_whole_decode_within_the_context(csm, drafter):
    """A batch of 2, 20 frames (inside the 25-frame left context): each row's chunks concatenate to the audio
    generate(output_audio=True) returns."""
    ids = prompts(2, seed=1)
    kwargs = generate_kwargs(ids, 20)
    reference = csm.generate(**kwargs, output_audio=True)
    handle = rvqspec.accelerate(csm, drafter=drafter, tree=default_tree(8) if drafter else None)
    try:
        chunks = list(handle.stream(**kwargs, chunk_frames=6, first_chunk_frames=2))
    finally:
        handle.undo()
    assert all(isinstance(audio, list) and len(audio) == 2 for audio, _ in chunks)
    for row in range(2):
        ours = np.concatenate([audio[row] for audio, _ in chunks])
        theirs = reference[row].float().numpy()
        assert ours.shape == theirs.shape and np.abs(theirs).max() > 1e-3
        np.testing.assert_allclose(ours, theirs, atol=1e-6 * np.abs(theirs).max(), rtol=0)


def test_beyond_the_left_context_the_difference_is_measured(csm, capsys):
    ids = prompts(1, seed=2)
    kwargs = generate_kwargs(ids, 3 * LEFT_CONTEXT_FRAMES)
    reference = csm.generate(**kwargs, output_audio=True)[0].float().numpy()
    handle = rvqspec.accelerate(csm)
    try:
        chunks = list(handle.stream(**kwargs, chunk_frames=10))
    finally:
        handle.undo()
    assert all(isinstance(audio, np.ndarray) for audio, _ in chunks)  # a batch of one: one array per chunk
    ours = np.concatenate([audio for audio, _ in chunks])
    assert ours.shape == reference.shape
    difference = np.abs(ours - reference).max() / np.abs(reference).max()
    snr = 10 * np.log10((reference ** 2).mean() / max(((ours - reference) ** 2).mean(), 1e-300))
    print(f"tiny random CSM, {3 * LEFT_CONTEXT_FRAMES} frames: max |difference| {difference:.2e} of the peak, "
          f"SNR {snr:.1f} dB")
    assert snr > 20


def test_leaving_a_csm_stream_joins_its_worker_and_bad_arguments_are_refused(csm):
    handle = rvqspec.accelerate(csm)
    try:
        for _ in handle.stream(**generate_kwargs(prompts(1), 40), chunk_frames=1):
            break
        assert not [t for t in threading.enumerate() if t.name.startswith("rvqspec")]
        with pytest.raises(RvqspecError, match="drop streamer= and output_audio="):
            handle.stream(**generate_kwargs(prompts(1), 4), output_audio=True)
        with pytest.raises(RvqspecError, match="chunk_frames"):
            handle.stream(**generate_kwargs(prompts(1), 4), chunk_frames=0)
    finally:
        handle.undo()
