"""Audio while it is generated: upstream's `generate_*` entry points in a worker, each frame's codes tapped from
the talker as the frame is finished, decoded chunk by chunk by `StreamingCodec`.

    handle = accelerate(tts, drafter=ReusedHeads())
    for audio, sample_rate in handle.stream_custom_voice(text=..., speaker=..., language=..., chunk_frames=12):
        play(audio)

Where the codes come from: upstream's talker emits c0 of frame t at step t and, at step t + 1, feeds it back
and calls the code predictor for c1..c15; that forward returns the whole frame in `hidden_states[1]` (the
same tensor upstream's `generate` stacks into its codes, up to each row's first EOS). `FrameTap` wraps that
forward on the talker instance while a stream runs, so every path (AR, speculative, upstream's own predictor)
streams the codes it decodes. The whole-utterance decode that `generate_*` does at the end is skipped in the
stream's thread (each chunk was already decoded).

Upstream's talker keeps per-call state on the model (`rope_deltas`, set at prefill), so two generate calls on
one model at once would corrupt each other: streams of one model take turns (`rvqspec.integrations.stream.Turns`:
a stream in another thread waits for the first; one in the same thread, which could never be served, is refused
at once), each with its own audio.
"""

import functools
import inspect
import threading
from collections.abc import Callable, Iterator

import numpy as np
import torch
from torch import Tensor

from rvqspec.core.errors import RvqspecError
from rvqspec.core.frame_loop import ChunkClock, check_chunks
from rvqspec.integrations.qwen_tts_audio import StreamingCodec
from rvqspec.integrations.stream import Channel, Turns, stream

ENTRY_POINTS = {"custom_voice": "custom_voice", "voice_design": "voice_design", "base": "voice_clone"}  # model type: name


class TextAudio:
    """One text of the call's audio, chunk by chunk (a row of upstream's batch): its incremental codec
    (`StreamingCodec`), the frames not yet turned into audio, and whether its EOS came."""

    def __init__(self, decoder: StreamingCodec, prefix: Tensor | None):
        self.decoder, self.pending, self.finished = decoder, [], False
        if prefix is not None:  # voice clone: upstream decodes the reference codes first and cuts their audio
            decoder.decode(prefix)

    def add(self, frame: Tensor, eos: int) -> None:
        if self.finished or int(frame[0]) == eos:
            self.finished = True
            return
        self.pending.append(frame)

    def audio(self) -> np.ndarray:
        codes, self.pending = self.pending, []
        if not codes:
            return np.zeros(0, dtype=np.float32)
        return self.decoder.decode(torch.stack(codes)).float().cpu().numpy()


class FrameTap:
    """While installed, each talker step's finished frame [B, 16] goes to the `on_frame` of the thread that
    runs the generate call; calls from other threads pass through untouched."""

    def __init__(self, tts):
        self.talker, self.tokenizer = tts.model.talker, tts.model.speech_tokenizer
        self.local = threading.local()
        self.replaced = [(self.talker, "forward"), (self.tokenizer, "decode")]
        self.saved = [vars(owner).get(name) for owner, name in self.replaced]  # instance attributes, if any

    def __enter__(self):
        forward, decode, local = self.talker.forward, self.tokenizer.decode, self.local

        @functools.wraps(forward)  # generate validates its arguments against forward's signature
        def tapped_forward(*args, **kwargs):
            out = forward(*args, **kwargs)
            frame = out.hidden_states[1] if isinstance(out.hidden_states, tuple) else None
            if frame is not None and getattr(local, "on_frame", None) is not None:
                local.on_frame(frame)
            return out

        @functools.wraps(decode)
        def skipped_decode(encoded, *args, **kwargs):
            if getattr(local, "on_frame", None) is None:
                return decode(encoded, *args, **kwargs)
            return [np.zeros(0, dtype=np.float32) for _ in encoded], int(self.tokenizer.get_output_sample_rate())

        self.talker.forward, self.tokenizer.decode = tapped_forward, skipped_decode
        return self

    def __exit__(self, *exc):
        for (owner, name), saved in zip(self.replaced, self.saved):
            if saved is None:
                delattr(owner, name)  # the class's method again
            else:
                setattr(owner, name, saved)
        return False


def reference_codes(tts, bound: inspect.BoundArguments, rows: int) -> list[Tensor | None]:
    """Voice clone: the reference codes upstream decodes before each row's codes (None in x-vector mode).
    Builds the clone prompt once here (upstream would build it inside the call) and passes it on."""
    arguments = bound.arguments
    prompt = arguments.get("voice_clone_prompt")
    if prompt is None:
        prompt = tts.create_voice_clone_prompt(ref_audio=arguments.get("ref_audio"), ref_text=arguments.get("ref_text"),
                                               x_vector_only_mode=arguments.get("x_vector_only_mode", False))
        arguments["voice_clone_prompt"], arguments["ref_audio"] = prompt, None
    codes = [item.ref_code for item in prompt] if isinstance(prompt, list) else list(prompt.get("ref_code") or [])
    codes = codes * rows if len(codes) == 1 else codes
    return [None if c is None else c.reshape(len(c), -1) for c in codes] or [None] * rows


def stream_speech(tts, kind: str, turns: Turns, args: tuple, kwargs: dict, chunk_frames: int,
                  first_chunk_frames: int | None) -> Iterator[tuple]:
    """Yield (audio, sample_rate) chunks of `tts.generate_<kind>(*args, **kwargs)` (see the module docstring):
    `audio` a float32 array for one text, a list of them (one per text, empty once a text is done) for a list."""
    model_kind = tts.model.tts_model_type
    if model_kind != kind:
        fix = (f"stream it with handle.stream_{ENTRY_POINTS[model_kind]}(...)" if model_kind in ENTRY_POINTS
               else "rvqspec streams custom_voice, voice_design and base (voice clone) models")
        raise RvqspecError(f"this is a {model_kind} model: {fix}")
    first, every = check_chunks(chunk_frames, first_chunk_frames)
    generate = getattr(tts, f"generate_{ENTRY_POINTS[kind]}")
    try:
        bound = inspect.signature(generate).bind(*args, **kwargs)
    except TypeError as e:
        raise RvqspecError(f"generate_{ENTRY_POINTS[kind]} does not take these arguments: {e}") from None
    text = bound.arguments.get("text")
    texts = text if isinstance(text, list) else [text]
    prefixes = reference_codes(tts, bound, len(texts)) if kind == "base" else [None] * len(texts)
    return stream(lambda channel: produce(tts, generate, bound, prefixes, (first, every), channel,
                                          one_text=not isinstance(text, list)), turns, name="rvqspec-qwen-tts-stream")


def produce(tts, generate: Callable, bound: inspect.BoundArguments, prefixes: list, chunks: tuple[int, int],
            channel: Channel, one_text: bool) -> None:
    """The worker: run the generate call, emitting a chunk every time enough frames are done."""
    decoder = tts.model.speech_tokenizer.model.decoder
    sample_rate = int(tts.model.speech_tokenizer.get_output_sample_rate())
    eos = tts.model.config.talker_config.codec_eos_token_id
    with FrameTap(tts) as tap:
        rows, clock = [TextAudio(StreamingCodec(decoder), prefix) for prefix in prefixes], ChunkClock(*chunks)

        def send() -> None:
            audio = [row.audio() for row in rows]
            channel.send((audio[0] if one_text else audio, sample_rate))

        def on_frame(codes: Tensor) -> None:
            channel.check()
            for row, frame in zip(rows, codes.cpu()):
                row.add(frame, eos)
            if clock.tick():
                send()

        tap.local.on_frame = on_frame
        try:
            generate(*bound.args, **bound.kwargs)
        finally:
            tap.local.on_frame = None
        if any(row.pending for row in rows):
            send()
