"""Sesame CSM's audio while it is generated: transformers' own `generate(..., streamer=)` hands over each frame's
codes [B, num_codebooks] as soon as the depth decoder has filled them; Mimi turns them into audio chunk by chunk.

    handle = rvqspec.accelerate(model, drafter=rvqspec.ReusedHeads())
    for audio, sample_rate in handle.stream(**inputs, chunk_frames=12):
        play(audio)

What transformers 4.57 lacks for an exact incremental Mimi decode: `MimiModel.decode` keeps the KV cache of the
codec's transformer between calls (`decoder_past_key_values`) but not its convolutions' inputs (the
`padding_cache` exists for the encoder only). So each chunk is decoded with LEFT_CONTEXT_FRAMES frames of
codes before it and cut, as upstream qwen-tts's `chunked_decode` does: an approximation of decoding the whole
utterance at once, whose difference tests/test_csm_streaming.py states for the tiny model (no Mimi weights here).
"""

from collections.abc import Iterator

import numpy as np
import torch
from torch import Tensor

from rvqspec.core.errors import RvqspecError
from rvqspec.core.frame_loop import ChunkClock, check_chunks
from rvqspec.integrations.stream import Channel, Turns, stream

LEFT_CONTEXT_FRAMES = 25  # as qwen-tts's chunked_decode (its 12 Hz codec is Mimi-like)


class MimiAudio:
    """One sequence's audio through Mimi, chunk by chunk (a row of upstream's batch in `produce`, a request in the
    Engine's codec workers): its codes so far; `audio()` decodes the frames not yet returned, with left context."""

    def __init__(self, codec):
        self.codec, self.codes, self.done, self.finished = codec, [], 0, False

    def add(self, frame: Tensor, eos: int) -> None:
        if self.finished or bool((frame == eos).all()):
            self.finished = True  # transformers cuts each row's audio at its first all-EOS frame
            return
        self.codes.append(frame)

    def audio(self) -> np.ndarray:
        end = len(self.codes)
        if end == self.done:
            return np.zeros(0, dtype=np.float32)
        low = max(0, self.done - LEFT_CONTEXT_FRAMES)
        codes = torch.stack(self.codes[low:end]).T[None].to(self.codec.device)  # [1, codebooks, frames]
        with torch.no_grad():
            wav = self.codec.decode(codes).audio_values[0, 0]
        per_frame = wav.shape[-1] // (end - low)
        start, self.done = self.done, end
        return wav[(start - low) * per_frame:].float().cpu().numpy()


class FrameStreamer:
    """transformers' streamer interface: the prompt first (skipped), then one frame [B, codebooks] per step."""

    def __init__(self, on_frame):
        self.on_frame, self.prompt_seen = on_frame, False

    def put(self, value: Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.on_frame(value)

    def end(self) -> None:
        pass


def stream_audio(model, turns: Turns, generate_kwargs: dict, chunk_frames: int,
                 first_chunk_frames: int | None) -> Iterator[tuple]:
    """Yield (audio, sample_rate) chunks of `model.generate(**generate_kwargs)`: a float32 array for a batch of
    one, a list of them (one per row, empty once a row is done) otherwise. Streams of one model take `turns`
    (generate sets the depth decoder's generation_config per call)."""
    chunks = check_chunks(chunk_frames, first_chunk_frames)
    if "streamer" in generate_kwargs or generate_kwargs.get("output_audio"):
        raise RvqspecError("stream() passes its own streamer and decodes the audio itself: drop streamer= and "
                         "output_audio= from the arguments")
    return stream(lambda channel: produce(model, generate_kwargs, chunks, channel), turns, name="rvqspec-csm-stream")


def produce(model, generate_kwargs: dict, chunks: tuple[int, int], channel: Channel) -> None:
    eos, sample_rate = model.config.codebook_eos_token_id, int(model.codec_model.config.sampling_rate)
    rows: list[MimiAudio] = []
    clock = ChunkClock(*chunks)

    def send() -> None:
        audio = [row.audio() for row in rows]
        channel.send((audio[0] if len(rows) == 1 else audio, sample_rate))

    def on_frame(codes: Tensor) -> None:
        channel.check()
        rows.extend(MimiAudio(model.codec_model) for _ in range(len(codes) - len(rows)))
        for row, frame in zip(rows, codes):
            row.add(frame, eos)
        if clock.tick():
            send()

    model.generate(**generate_kwargs, streamer=FrameStreamer(on_frame))
    if any(row.done < len(row.codes) for row in rows):
        send()
