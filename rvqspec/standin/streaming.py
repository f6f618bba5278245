"""The stand-in's speech as audio chunks while it is synthesized (`rvqspec demo`, `rvqspec synth --model standin
--stream`).

Codes become mel frame by frame (the codec's decode is per frame), but the vocoder (HiFi-GAN) is not causal:
a sample depends on mel frames on both sides. So each chunk is vocoded with CONTEXT_FRAMES code frames of mel
on either side and cut, and a chunk is due once the frames after it exist: the stream runs that many frames
behind the synthesis. With that context the chunks equal vocoding the whole utterance at once up to float
rounding (tests/test_standin_streaming.py); without HiFi-GAN (Griffin-Lim's iterations span the whole signal)
they only approximate it.

The talker keeps its KV cache on the model (`setup_cache`), so streams of one stand-in take turns
(`rvqspec.integrations.stream.Turns`: one in the same thread is refused at once, one in another thread waits).
"""

import weakref
from collections.abc import Iterator

import numpy as np
import torch
from torch import Tensor

from rvqspec.core.frame_loop import ChunkClock, check_chunks
from rvqspec.core.sampling import Sampler
from rvqspec.integrations.stream import Channel, Turns, stream
from rvqspec.standin.codec import MelRVQCodec, vocode
from rvqspec.standin.synthesis import Synthesis, synthesize_codes

CONTEXT_FRAMES = 3  # code frames (24 mel frames) each side: past HiFi-GAN's receptive field, measured
TURNS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # stand-in model: the Turns of its streams


class ChunkedVocoder:
    """Mel of the frames so far; `audio(end)` vocodes frames [done, end) with context and moves on."""

    def __init__(self, codec: MelRVQCodec):
        self.codec, self.mels, self.done = codec, [], 0
        self.samples_per_frame = codec.cfg.samples_per_frame

    def add(self, frame: Tensor) -> None:
        self.mels.append(self.codec.codes_to_mel(frame[None].cpu()))

    def audio(self, end: int) -> np.ndarray:
        low, high = max(0, self.done - CONTEXT_FRAMES), min(len(self.mels), end + CONTEXT_FRAMES)
        wav = vocode(torch.cat(self.mels[low:high]), self.codec.cfg.mel)
        start = self.done
        self.done = end
        return wav[(start - low) * self.samples_per_frame:(end - low) * self.samples_per_frame].numpy()


class SpeechStream:
    """Iterate for float32 audio chunks (16 kHz); `synthesis` (codes, timings) is set once the stream ends."""

    def __init__(self, tts, codec: MelRVQCodec, text: str, lang: str, sampler: Sampler = Sampler(),
                 generator: torch.Generator | None = None, drafter=None, tree=None, chunk_frames: int = 12,
                 first_chunk_frames: int | None = None):
        self.chunks = check_chunks(chunk_frames, first_chunk_frames)
        self.synthesis: Synthesis | None = None
        self.items = stream(lambda channel: self.produce(channel, tts, codec, text, lang, sampler, generator,
                                                         drafter, tree), TURNS.setdefault(tts, Turns()),
                            name="rvqspec-standin-stream")

    def produce(self, channel: Channel, tts, codec, text, lang, sampler, generator, drafter, tree) -> None:
        first, every = self.chunks
        vocoder, clock = ChunkedVocoder(codec), ChunkClock(first + CONTEXT_FRAMES, every)  # the context lags it

        def on_frame(frame: Tensor) -> None:
            channel.check()
            vocoder.add(frame)
            if clock.tick():
                channel.send(vocoder.audio(len(vocoder.mels) - CONTEXT_FRAMES))

        synthesis = synthesize_codes(tts, text, lang, sampler, generator=generator, drafter=drafter, tree=tree,
                                     on_frame=on_frame)
        if vocoder.done < len(vocoder.mels):
            channel.send(vocoder.audio(len(vocoder.mels)))
        channel.send(synthesis)

    def __iter__(self) -> Iterator[np.ndarray]:
        for item in self.items:
            if isinstance(item, Synthesis):
                self.synthesis = item
            else:
                yield item

    def close(self) -> None:
        self.items.close()
