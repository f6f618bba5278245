"""The model-adapter contract: what the scheduler, `Engine` and the codec workers use of a model (`ModelAdapter`),
and the parts every adapter shares (`TalkerAdapter`: the engine's talker and predictor, int8 where asked, and c0
from the talker's head; `capture`: upstream's own prompt, taken where its decoding would start).

An adapter per model family: `runtime/qwen_tts.py` (qwen-tts 12 Hz), `runtime/csm.py` (Sesame CSM),
`runtime/standin.py` (the shipped stand-in). tests/test_adapter.py checks each against the Protocol.
"""

import contextlib
import copy
import ctypes
import ctypes.util
import math
import threading
from collections.abc import Callable, Iterator
from typing import Protocol, runtime_checkable

import numpy as np
from torch import Tensor, nn

from rvqspec.core.errors import RvqspecError
from rvqspec.core.model import MultiCodeDecoder
from rvqspec.core.quantize import quantize, quantize_linears
from rvqspec.runtime.request import AudioStream, Prompt


@runtime_checkable
class ModelAdapter(Protocol):
    """A TTS model as the engine runs it. Scheduler: `talker`, `predictor`, `c0_logits`, `frame_inputs`,
    `frame_seconds`; codec workers: `new_stream`, `codec_batches`, `add_together`; `Engine`: the rest."""

    kind: str  # the one request kind it decodes ("custom_voice", "csm", "speech", ...)
    sample_rate: int
    frame_seconds: float  # audio seconds per frame
    talker: nn.Module  # on the core's blocks, as `core/talker.py` runs them (`Talker`, the stand-in's own)
    predictor: MultiCodeDecoder
    codec_batches: bool  # whether `add_together` decodes in one call: the codec workers then gather streams with work
    decodes_ahead: bool  # whether its streams decode any frames per call with nothing done again (a causal codec
    # that keeps its state): the codec workers then decode frames ahead of a chunk's boundary (codec_worker.py)

    @property
    def can_clone(self) -> bool:
        """Whether `clone_prompt` makes voice-clone prompts."""

    def c0_logits(self, hidden: Tensor) -> Tensor:
        """The talker's c0 logits [B, V] for its last hidden states [B, H]."""

    def frame_inputs(self, frames: Tensor) -> Tensor:
        """The talker's next inputs [B, H] for decoded frames [B, G] (the trailing text is added by the scheduler)."""

    def prompts(self, kind: str, arguments: dict) -> list[Prompt]:
        """One Prompt per text of a request of `kind` with upstream's `arguments`. Without an explicit frame limit
        in them (`max_new_tokens`), a Prompt's `max_new_tokens` is bounded by its text (`frame_budget`), so that a
        generation whose end code never comes ends with reason "length" within a time its text bounds."""

    def new_stream(self, prompt: Prompt) -> AudioStream:
        """A request's frames turned into audio as they come (run by the codec workers)."""

    def add_together(self, streams: list[AudioStream], frames: list[list[Tensor]]) -> list[np.ndarray]:
        """Each stream's next frames -> its audio, what its own `add` gives (in one call of the codec where
        `codec_batches`)."""

    def whole(self, codes: list[Tensor], prompts: list[Prompt]) -> tuple[list[np.ndarray], int]:
        """Upstream's generate result (wavs, sample rate) for each prompt's decoded codes."""

    def voices(self) -> list[str]:
        """The built-in voices ([] where there are none)."""

    def speech(self, text: str, voice: str | None, instructions: str | None, language: str | None,
               clone) -> tuple[str, dict]:
        """(kind, arguments) of `Engine.speech`'s request."""

    def clone_prompt(self, audio: np.ndarray, sample_rate: int, transcript: str | None):
        """A voice-clone prompt for a reference clip, or a clear error."""

    def entry_point(self, kind: str) -> Callable | None:
        """Upstream's generate function for `kind`, whose signature binds positional arguments (None: by name only)."""


def frame_budget(text_tokens: int, frames_per_token: float, floor_frames: int) -> int:
    """A text's default frame budget: `frames_per_token` (the model's measured speech rate, with a generous margin)
    per text token, and at least `floor_frames` (a short text's pauses and slow words). docs/limits.md: each model's
    rule and its margin."""
    return max(floor_frames, math.ceil(frames_per_token * text_tokens))


class TalkerAdapter:
    """What the adapters share: the talker and predictor they run, with the int8 schemes asked for
    (`talker_weights` on a copy of the talker where the caller's model still uses it, a layer at a time so that the
    peak holds one layer's float and int8 matrices together, not the whole talker's; `weights` on the predictor:
    `quantize` copies), and c0 from the talker's head. `entry_point`: none unless the adapter wraps upstream's;
    `add_together`: each stream in turn, unless an adapter's codec was measured faster batched (qwen-tts)."""

    codec_batches = False
    decodes_ahead = False  # the stand-in's vocoder and CSM's Mimi decode each call with context frames again

    def __init__(self, talker: nn.Module, predictor: MultiCodeDecoder, weights: str | None, talker_weights: str | None,
                 shared_talker: bool = False):
        if talker_weights:
            talker = copy.deepcopy(talker) if shared_talker else talker
            for part in [*talker.layers, talker]:  # a layer at a time: its float matrices go as its int8 ones come
                quantize_linears(part, talker_weights)
        self.talker = talker
        self.predictor = quantize(predictor, weights) if weights else predictor
        release_freed_memory()

    def c0_logits(self, hidden: Tensor) -> Tensor:
        return self.talker.codec_head(hidden)

    def add_together(self, streams: list[AudioStream], frames: list[list[Tensor]]) -> list[np.ndarray]:
        return [stream.add(chunk) for stream, chunk in zip(streams, frames)]

    def entry_point(self, kind: str) -> Callable | None:
        return None


def release_freed_memory() -> None:
    """Hand the heap that building freed (float copies, quantization's float32 temporaries) back to the system where
    the C library keeps it (glibc's malloc_trim): at the 0.6B sizes, w8a8, ~1.2 GB that stayed resident otherwise
    (benchmarks/results/memory.md). Elsewhere nothing."""
    library = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(library), "malloc_trim", None) if library else None
    if trim is not None:
        trim(0)


class Captured(Exception):
    """Raised in place of upstream's decoding: what it was about to decode from."""

    def __init__(self, arguments: dict):
        super().__init__("prompt captured")
        self.arguments = arguments


def this_thread(mine: Callable, theirs: Callable) -> Callable:
    """A wrapper that calls `mine` in the thread that made it and `theirs` (upstream's own) in any other."""
    owner = threading.get_ident()

    def wrapper(*args, **kwargs):
        return (mine if threading.get_ident() == owner else theirs)(*args, **kwargs)
    return wrapper


@contextlib.contextmanager
def patched(patches: dict[tuple[object, str], Callable]) -> Iterator[None]:
    """Instance attributes (object, name) set to the given functions while held; put back as they were after (the
    class's method again, or another hook's instance wrapper)."""
    before = {(owner, name): vars(owner).get(name) for owner, name in patches}
    for (owner, name), function in patches.items():
        setattr(owner, name, function)
    try:
        yield
    finally:
        for (owner, name), saved in before.items():
            if saved is None:
                delattr(owner, name)
            else:
                setattr(owner, name, saved)


def capture(lock: threading.Lock, hooks: contextlib.AbstractContextManager, generate: Callable[[], object],
            refused: tuple[type[Exception], ...], what: str) -> dict | None:
    """The prompt capture shared by the adapters: upstream's `generate` runs while `hooks` (which patch it: `patched`,
    `this_thread`) record its settings into the dict they yield and raise Captured where its decoding would start.
    Returns the settings with Captured's arguments, or None if upstream never got there; `refused` (upstream's way
    of refusing the arguments) becomes one line naming `what` was called. One capture at a time per model (`lock`):
    the hooks are the model's instance attributes."""
    with lock, hooks as seen:
        try:
            generate()
        except Captured as e:
            return {**seen, **e.arguments}
        except refused as e:
            raise RvqspecError(f"{what} does not take these arguments: {e}") from None
    return None


