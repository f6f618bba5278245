"""`rvqspec.Engine`: the whole frame loop of a TTS model in rvqspec, serving many requests at once.

    engine = rvqspec.Engine(tts)                       # a qwen_tts.Qwen3TTSModel, a checkpoint folder, or "standin"
    wavs, sr = engine.generate_custom_voice(text=..., speaker=..., language=...)   # upstream's arguments and result
    for audio, sr in engine.stream_custom_voice(text=..., speaker=..., language=...): ...
    request = engine.submit("custom_voice", text=..., speaker=..., language=..., seed=7)   # any thread
    for chunk in request: ...                          # or request.audio(), request.cancel()
    engine.close()

Where `rvqspec.accelerate(tts)` swaps the predictor inside upstream's own loop (one request at a time, upstream's
talker), the engine runs the loop itself (`runtime/scheduler.py`): the talker on the core's blocks
(`core/talker.py`), the predictor through `decode_frames` with the policy's tree per batch size, and every live
request in one batch that new ones join at frame boundaries. Prompts and settings stay upstream's
(`runtime/qwen_tts.py`), so the codes keep upstream's distribution (greedy: the same codes).
"""

import inspect
import random
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from rvqspec.core import device_path
from rvqspec.core import policy as policy_choice
from rvqspec.core.drafters import Offsets, ReusedHeads
from rvqspec.core.errors import RvqspecError
from rvqspec.core.files import read_json
from rvqspec.core.frame_loop import CHUNK_FRAMES, check_arguments, check_chunks, decoding_policy
from rvqspec.core.tree import Tree
from rvqspec.runtime.adapter import ModelAdapter
from rvqspec.runtime.capacity import Capacity, frame_scaling
from rvqspec.runtime.codec_worker import CodecWorker, Cores
from rvqspec.runtime.live_text import is_live, text_stream
from rvqspec.runtime.passage import Passage
from rvqspec.runtime.request import Request
from rvqspec.runtime.scheduler import PREFILL_CHUNK, Scheduler
from rvqspec.runtime.sentences import SentenceSplitter, split_sentences
from rvqspec.runtime.threads import ThreadBudget, fixed_where_bits_vary, quick_gil_handoff, warn_if_openmp_spins

MAX_BATCH, MAX_QUEUE = 8, 32


class Engine:
    """A TTS model's frame loop over every submitted request (module docstring).

    `model`: "standin" (the shipped stand-in), a folder (a qwen-tts 12 Hz checkpoint, loaded in `dtype`; "auto": the
    CPU class's fastest float, `device_path.fastest_float`; or a stand-in folder), or a loaded
    `qwen_tts.Qwen3TTSModel`. `drafter`: "auto" (the stand-in's shipped offsets, else the predictor's own heads:
    `ReusedHeads`), a drafter, or None (AR); `tree`: "auto" (the decoding policy per batch size, from `calibration`
    and this CPU's measured latencies) or a `Tree`. `weights` / `talker_weights`: int8
    schemes for the predictor / the talker (`rvqspec.quantize`: another model, opt-in). At most `max_batch` requests
    decode at once and `max_queue` wait (more: `QueueFull`); with `realtime`, a request joins the batch only while the
    running streams stay at real time (`runtime/capacity.py`). Chunks of `chunk_frames` frames (the first
    `first_chunk_frames`). `cores`: how many threads may do torch work at once (None: the cores this process may use);
    `threads` / `codec_threads`: the frame loop's intra-op threads / the codec workers (None: the measured split,
    `runtime/threads.py`). While requests decode, a new one's prompt is prefilled `prefill_chunk` tokens
    between two frame steps (`scheduler.PREFILL_CHUNK`: about one talker step's cost); None prefills each prompt
    whole. `decode_ahead` (opt-in): a lone stream's frames decoded ahead of its chunk boundaries where a core is
    left for the codec (`codec_worker.py`). Every request draws from its own generator, seeded with its `seed` (its
    audio is then the same bits alone and in any batch); `seed` here seeds the seeds of the requests submitted without one, in submission order
    (None: fresh entropy for each), so that a seeded engine repeats a run's audio. Making an engine prepares this
    CPU's kernel choices at the frame loop's thread count (`device_path.prepare`: measured once per CPU, with a
    one-line message), so that no request waits for them."""

    def __init__(self, model="standin", drafter="auto", tree: Tree | str | None = "auto", weights: str | None = None,
                 talker_weights: str | None = None, calibration: str | Path | None = None, max_batch: int = MAX_BATCH,
                 max_queue: int = MAX_QUEUE, chunk_frames: int = CHUNK_FRAMES, first_chunk_frames: int | None = None,
                 dtype: str | torch.dtype = "auto", seed: int | None = None, cores: int | None = None,
                 threads: int | None = None, codec_threads: int | None = None, realtime: bool = True,
                 prefill_chunk: int | None = PREFILL_CHUNK, decode_ahead: bool = False):
        for name, value in (("max_batch", max_batch), ("max_queue", max_queue), ("prefill_chunk", prefill_chunk)):
            if name == "prefill_chunk" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise RvqspecError(f"{name} must be a whole number >= 1, got {value!r}"
                                   + (" (prompt tokens per piece), or None for whole prompts"
                                      if name == "prefill_chunk" else ""))
        self.chunks = check_chunks(chunk_frames, first_chunk_frames)
        budget = ThreadBudget.split(cores, threads, codec_threads)
        self.seeds = random.SystemRandom() if check_seed(seed) is None else random.Random(seed)
        self.name, self.model, shipped = load_model(model, weights, talker_weights, dtype)
        predictor = self.model.predictor
        self.budget = fixed_where_bits_vary(budget, self.model.talker, predictor)
        quick_gil_handoff(self.budget)
        warn_if_openmp_spins(self.budget)
        for part in (self.model.talker, predictor):  # before any forward, the policy's latencies' included
            for threads in {self.budget.loop, self.budget.loop_most, self.budget.prefill_most}:  # runtime/threads.py
                device_path.prepare(part, threads, self.name)
        if drafter == "auto":
            drafter = Offsets.load(shipped / "offsets.safetensors", predictor) if shipped else ReusedHeads(predictor)
            calibration = calibration or (shipped / "trees" if shipped else None)
        if drafter is None and tree == "auto":
            tree = None
        check_arguments(drafter, tree)
        with device_path.intra_op_threads(self.budget.loop):  # the latencies of the frame loop's thread count
            policy = decoding_policy(predictor, drafter, tree, calibration, measure=True)
        self.policy, self.drafter = policy, drafter
        cores = Cores(self.budget.cores)
        self.codec = CodecWorker(self.model, cores, self.budget, decode_ahead)
        self.capacity = Capacity(self.model.frame_seconds, max_batch, realtime, frame_scaling(policy))
        self.scheduler = Scheduler(self.model, drafter, tree if isinstance(tree, Tree) else None, policy, max_batch,
                                   max_queue, cores, self.budget, self.codec, self.capacity, prefill_chunk)
        # An engine dropped without close(): its threads end with it (cancelling what it still decodes).
        self.finalizer = weakref.finalize(self, shut_down, self.scheduler, self.codec, 0)

    # ---------------------------------------------------------------- what the model offers

    @property
    def sample_rate(self) -> int:
        return self.model.sample_rate

    @property
    def can_clone(self) -> bool:
        return self.model.can_clone

    def voices(self) -> list[str]:
        """The built-in voices: a custom_voice model's speakers, the stand-in's languages; [] for the others."""
        return self.model.voices()

    def clone_prompt(self, audio: np.ndarray, sample_rate: int, transcript: str | None = None):
        """A voice-clone (Base) model's prompt for a reference clip (and its transcript, for in-context cloning)."""
        return self.model.clone_prompt(audio, sample_rate, transcript)

    # ---------------------------------------------------------------- requests

    def submit(self, kind: str, seed: int | None = None, **arguments) -> Request | Passage:
        """One request, from any thread: `kind` the entry point ("custom_voice", "voice_design", "voice_clone"; the
        stand-in's "speech"), `arguments` upstream's for it (one text). Iterate the request for its audio. The text
        may arrive over time (`live_text.is_live`: a `TextStream`, an iterable or async iterable of pieces)."""
        if is_live(arguments.get("text")):
            if self.text_mode == "sentence":
                return self.submit_sentences(kind, seed, arguments)
            return self.submit_live(kind, seed, arguments)
        prompts = self.model.prompts(kind, arguments)
        if len(prompts) != 1:
            raise RvqspecError(f"submit takes one text, got {len(prompts)}: submit each (they decode together), or "
                               f"call generate_{kind} with the list")
        return self.enqueue(prompts[0], seed)

    def submit_live(self, kind: str, seed: int | None, arguments: dict) -> Request:
        """A request whose text arrives over time: upstream's dual-track prompt (`live_prompt`), decoding from its
        first token, each frame t taking text token t as it comes."""
        if not getattr(self.model, "dual_track", False):
            raise RvqspecError(f"{self.name} has no dual-track talker: pass the whole text as a string")
        text = arguments.pop("text")
        if arguments.pop("non_streaming_mode", False):
            raise RvqspecError("text that arrives over time is spoken with the dual-track prompt: leave "
                               "non_streaming_mode out (or false), or pass the whole text as a string")
        prompt = self.model.live_prompt(kind, arguments)
        request = self.enqueue(prompt, seed)
        text_stream(text, request.cancelled).attach(prompt.live.read)
        return request

    def submit_sentences(self, kind: str, seed: int | None, arguments: dict) -> Passage:
        """Text arriving over time on a model without dual-track text: each sentence spoken as it completes
        (`SentenceSplitter`), one stream with the voice and seed carried on (a `Passage`)."""
        text, splitter = arguments.pop("text"), SentenceSplitter()
        passage = self.passage([], seed, complete=False)

        def read(piece: str | BaseException | None) -> None:
            try:
                if isinstance(piece, BaseException):
                    raise RvqspecError(f"the text's source failed ({type(piece).__name__}: {piece})")
                for sentence in splitter.end() if piece is None else splitter.feed(piece):
                    passage.add(self.model.prompts(kind, {**arguments, "text": sentence})[0])
            except RvqspecError as e:
                passage.end(e)
                passage.cancel()
            if piece is None:
                passage.end(None if passage.prompts else RvqspecError("the text was empty: send at least one word"))

        text_stream(text, passage.cancelled).attach(read)
        return passage

    @property
    def text_mode(self) -> str:
        """How text that arrives over time is spoken: "token" (dual-track: each text token as it comes), "sentence"
        (each sentence as it completes), "none" (a model that takes no text: CSM)."""
        if getattr(self.model, "dual_track", False):
            return "token"
        return "sentence" if self.model.kind == "speech" else "none"

    def speech(self, text: str, voice: str | None = None, instructions: str | None = None,
               language: str | None = None, clone=None, seed: int | None = None, temperature: float | None = None,
               top_k: int | None = None, top_p: float | None = None, sentences: bool = False,
               non_streaming_mode: bool | None = None) -> Request | Passage:
        """A request in one shape for every model (what a server maps OpenAI's fields to): `voice` a built-in voice,
        `instructions` a voice design or instruct, `clone` a `clone_prompt`; sampling settings for the talker. With
        `sentences`, a text of several sentences is spoken one sentence after another as one stream (a `Passage`:
        runtime/passage.py); without, as one utterance, as upstream speaks it. `text` may arrive over time
        (`submit`). `non_streaming_mode`: upstream's prompt choice on a dual-track model (None: its entry point's
        default; False: the dual-track prompt, the audio of the same text arriving over time)."""
        live = is_live(text)
        if not live and (not isinstance(text, str) or not text.strip()):
            raise RvqspecError("text must be a non-empty string: pass the sentence to speak")
        kind, arguments = self.model.speech("" if live else text, voice, instructions, language, clone)
        arguments.update(self.prompt_mode(non_streaming_mode))
        sampling = {k: v for k, v in dict(temperature=temperature, top_k=top_k, top_p=top_p).items() if v is not None}
        pieces = split_sentences(text) if sentences and not live else []
        if len(pieces) < 2:
            return self.submit(kind, seed=seed, **{**arguments, "text": text}, **sampling)
        prompts = [self.model.prompts(kind, {**arguments, **sampling, "text": piece})[0] for piece in pieces]
        return self.passage(prompts, seed)

    def prompt_mode(self, non_streaming_mode: bool | None) -> dict:
        """Upstream's `non_streaming_mode` argument, where the model has that choice; a model without a dual-track
        talker has only the whole-text prompt (True, or None), and refuses False."""
        dual_track = self.text_mode == "token"
        if non_streaming_mode is None or (non_streaming_mode and not dual_track):
            return {}
        if not dual_track:
            raise RvqspecError(f"{self.name} has no dual-track prompt: leave non_streaming_mode out (or true)")
        return {"non_streaming_mode": non_streaming_mode}

    def passage(self, prompts: list, seed: int | None, complete: bool = True) -> Passage:
        """Sentences spoken in turn as one stream: one generator carried across them, each next sentence queued
        ahead of the others (runtime/passage.py)."""
        generator = self.generator(seed)
        return Passage(prompts, lambda prompt, ended: self.queue(prompt, generator, first=True, on_end=ended),
                       self.sample_rate, complete=complete)

    def enqueue(self, prompt, seed: int | None) -> Request:
        return self.queue(prompt, self.generator(seed))

    def generator(self, seed: int | None) -> torch.Generator:
        """A request's own generator, seeded with `seed` (None: the engine's next seed)."""
        seed = self.seeds.getrandbits(62) if check_seed(seed) is None else seed
        return torch.Generator(self.model.predictor.device).manual_seed(seed)

    def queue(self, prompt, generator: torch.Generator, first: bool = False,
              on_end: Callable[[], None] | None = None) -> Request:
        request = Request(prompt, self.codec, self.sample_rate, self.chunks, generator)
        request.on_end = on_end
        self.scheduler.submit(request, first)
        return request

    # ---------------------------------------------------------------- upstream's entry points (qwen-tts)

    def generate_custom_voice(self, *args, seed: int | None = None, **kwargs) -> tuple[list[np.ndarray], int]:
        """`tts.generate_custom_voice(...)`'s arguments and result (wavs, sample_rate), decoded by the engine."""
        return self.whole("custom_voice", args, kwargs, seed)

    def generate_voice_design(self, *args, seed: int | None = None, **kwargs) -> tuple[list[np.ndarray], int]:
        """`tts.generate_voice_design(...)`, decoded by the engine."""
        return self.whole("voice_design", args, kwargs, seed)

    def generate_voice_clone(self, *args, seed: int | None = None, **kwargs) -> tuple[list[np.ndarray], int]:
        """`tts.generate_voice_clone(...)`, decoded by the engine."""
        return self.whole("voice_clone", args, kwargs, seed)

    def stream_custom_voice(self, *args, seed: int | None = None, **kwargs) -> Iterator[tuple[np.ndarray, int]]:
        """(audio, sample_rate) chunks of one text of `generate_custom_voice(...)` as it is decoded."""
        return self.stream("custom_voice", args, kwargs, seed)

    def stream_voice_design(self, *args, seed: int | None = None, **kwargs) -> Iterator[tuple[np.ndarray, int]]:
        return self.stream("voice_design", args, kwargs, seed)

    def stream_voice_clone(self, *args, seed: int | None = None, **kwargs) -> Iterator[tuple[np.ndarray, int]]:
        return self.stream("voice_clone", args, kwargs, seed)

    def whole(self, kind: str, args: tuple, kwargs: dict, seed: int | None) -> tuple[list[np.ndarray], int]:
        arguments = self.named(kind, args, kwargs)
        if is_live(arguments.get("text")):
            request = self.submit(kind, seed=seed, **arguments)
            try:
                codes = request.wait()
            finally:
                request.cancel()  # only if still running (an interrupted wait)
            return self.model.whole([codes], [request.prompt])
        prompts = self.model.prompts(kind, arguments)
        requests = []
        try:
            for i, prompt in enumerate(prompts):
                requests.append(self.enqueue(prompt, None if seed is None else seed + i))
            codes = [request.wait() for request in requests]
        finally:
            for request in requests:
                request.cancel()  # only those still running (an interrupted wait, a refused submit)
        return self.model.whole(codes, prompts)

    def stream(self, kind: str, args: tuple, kwargs: dict, seed: int | None) -> Iterator[tuple[np.ndarray, int]]:
        request = self.submit(kind, seed=seed, **self.named(kind, args, kwargs))

        def chunks():
            try:
                for audio in request:
                    yield audio, self.sample_rate
            finally:
                request.cancel()

        return chunks()

    def named(self, kind: str, args: tuple, kwargs: dict) -> dict:
        """Upstream's arguments by name (positional ones bound to its signature)."""
        if not args:
            return kwargs
        upstream = self.model.entry_point(kind)
        if upstream is None:
            raise RvqspecError(f"pass the arguments of {kind!r} by name")
        try:
            bound = inspect.signature(upstream).bind(*args, **kwargs)
        except TypeError as e:
            raise RvqspecError(f"generate_{kind} does not take these arguments: {e}") from None
        return {**bound.arguments.pop("kwargs", {}), **bound.arguments}

    # ---------------------------------------------------------------- state

    def status(self) -> dict:
        """Rows decoding, requests waiting, frames and audio seconds decoded, predictor tokens/step, the tree; the
        capacity (frames/s of the current batch, the most rows at real time), each row's real-time factor (audio
        seconds per second since its first frame), and the largest gap between two audio chunks of a stream (of
        those streaming now, and since the engine started), in seconds."""
        active, queued = self.scheduler.counts()
        stats = self.scheduler.stats
        now, ever = self.codec.gaps()
        return {"active": active, "queued": queued, "frames": stats.frames,
                "audio_seconds": stats.frames * self.model.frame_seconds, "tokens_per_step": stats.tokens_per_step,
                "tree": self.explain(max(active, 1)), **self.capacity.report(active),
                "real_time_factors": self.scheduler.real_time_factors(), "largest_chunk_gap": now,
                "largest_chunk_gap_ever": ever, "text_mode": self.text_mode, "cores": self.budget.cores, "threads": self.budget.loop,
                "codec_threads": self.budget.codec}

    def explain(self, batch: int = 1) -> str:
        """What decodes a batch of `batch` requests' frames, and why."""
        return policy_choice.explain(self.drafter, self.scheduler.tree, self.policy, batch)

    def close(self, grace: float | None = None) -> None:
        """Stop taking requests; those submitted finish within `grace` seconds (None: all of them), the rest are
        cancelled; the engine's thread ends."""
        shut_down(self.scheduler, self.codec, grace)
        self.finalizer.detach()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close(grace=0 if exc[0] is not None else None)


def shut_down(scheduler: Scheduler, codec: CodecWorker, grace: float | None) -> None:
    """The frame loop ends (what it holds within `grace`), then the codec workers, once every stream got its end."""
    scheduler.close(grace)
    codec.close()


def check_seed(seed: int | None) -> int | None:
    """`seed` if it is None or a torch generator's seed, else a clear error."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 63):
        raise RvqspecError(f"seed must be an integer from 0 to 2**63 - 1 (a torch generator's seed), got {seed!r}")
    return seed


def load_model(model, weights: str | None, talker_weights: str | None,
               dtype) -> tuple[str, ModelAdapter, Path | None]:
    """(name, adapter, the shipped stand-in's assets folder or None) for Engine's `model`."""
    from rvqspec.runtime.qwen_tts import QwenTTSModel

    if isinstance(model, str) and model == "standin":
        from rvqspec.runtime.standin import ASSETS, StandinModel

        return "standin", StandinModel.shipped(weights, talker_weights), ASSETS
    if isinstance(model, (str, Path)):
        folder = Path(model)
        if "stand_in" in model_config(folder)["talker_config"]:
            from rvqspec.runtime.standin import StandinModel

            return folder.name, StandinModel.from_folder(folder, weights, talker_weights), None
        from rvqspec.core.device_path import fastest_float
        from rvqspec.core.model import resolve_dtype
        from rvqspec.integrations.qwen_tts import load_tts

        dtype = fastest_float() if dtype == "auto" else resolve_dtype(dtype)
        return folder.name, QwenTTSModel(load_tts(folder, "cpu", dtype), weights, talker_weights), None
    if hasattr(model, "generate_custom_voice"):
        return type(model).__name__, QwenTTSModel(model, weights, talker_weights), None
    from rvqspec.integrations.csm import is_csm

    if is_csm(model):
        from rvqspec.runtime.csm import CsmModel

        return type(model).__name__, CsmModel(model, weights, talker_weights), None
    if hasattr(model, "talker") and hasattr(model, "predictor"):
        from rvqspec.runtime.standin import StandinModel

        return "standin", StandinModel.from_tts(model, weights, talker_weights), None
    raise RvqspecError(f"rvqspec.Engine takes 'standin', a checkpoint folder or a qwen_tts.Qwen3TTSModel, not "
                       f"{type(model).__name__}: for other models use rvqspec.accelerate(model)")


def model_config(folder: Path) -> dict:
    """A model folder's config.json, parsed and checked (an object, its talker_config an object), so that a damaged
    one is refused in one line before anything loads."""
    path = folder / "config.json"
    if not path.is_file():
        raise RvqspecError(f"{folder} is not a model folder (no config.json): pass 'standin', a qwen-tts 12 Hz "
                           "checkpoint folder or a stand-in folder")
    config = read_json(path, "restore the checkpoint's config.json")
    if not isinstance(config, dict) or not isinstance(config.setdefault("talker_config", {}), dict):
        raise RvqspecError(f"{path} is not a model config (a JSON object with an object talker_config): restore the "
                           "checkpoint's config.json")
    return config
