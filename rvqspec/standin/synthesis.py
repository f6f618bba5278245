"""Text -> codes with the stand-in: the talker samples c0 frame by frame, the predictor fills c1..c15.

The predictor's inner loop is `rvqspec.decode_frame`, plain AR (drafter None) or speculative (a drafter
and a tree); everything else is identical, so the two modes differ only in predictor calls and time.
The talker keeps a static KV cache: one prefill over [lang, bytes, bos], then one call per frame.
"""

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from rvqspec.core.decode import decode_frame
from rvqspec.core.errors import RvqspecError
from rvqspec.core.sampling import Sampler
from rvqspec.core.tree import Tree
from rvqspec.standin.speech import read_manifest
from rvqspec.standin.talker import StandinTTS



@dataclass
class Synthesis:
    codes: Tensor  # [T, 16]
    hidden: Tensor  # [T, H] the talker state that conditioned each frame's predictor
    predictor_calls: int = 0
    frame_seconds: list[float] = field(default_factory=list)  # wall time inside decode_frame (the inner loop)
    talker_seconds: float = 0.0
    accepted: list[int] = field(default_factory=list)  # drafts accepted per speculative round
    on_frame_seconds: float = 0.0  # wall time in the on_frame callback (a stream's vocoding), not the talker's

    @property
    def frames(self) -> int:
        return len(self.codes)

    @property
    def predictor_seconds(self) -> float:
        return sum(self.frame_seconds)

    @property
    def calls_per_frame(self) -> float:
        return self.predictor_calls / max(self.frames, 1)

    @property
    def tokens_per_step(self) -> float:
        return self.frames * (self.codes.shape[1] - 1) / max(self.predictor_calls, 1)


DIGIT_FRAMES = 4  # a digit is spoken as a word: ~3.6 frames measured (benchmarks/results/speech-rate.md), not a byte's


def max_frames_for(tts: StandinTTS, text: str, lang: str) -> int:
    """The stand-in's frame budget of a text, so that a model that never emits eos stops: 3x the language's mean
    duration of the text (a byte at the language's mean rate, a digit DIGIT_FRAMES frames), + 2 s."""
    digits = sum(char.isdigit() for char in text)
    return int(3 * ((len(text.strip().encode()) - digits) / tts.config.frame_step(lang) + DIGIT_FRAMES * digits)) + 25


def sample_c0(tts: StandinTTS, hidden: Tensor, sampler: Sampler, generator, allow_eos: bool) -> int:
    """Draw c0 from the talker head, restricted to the codes (and eos once allowed)."""
    logits = tts.talker.codec_head(hidden).float()
    allowed = torch.zeros_like(logits, dtype=torch.bool)
    allowed[..., :tts.config.num_codes] = True
    allowed[..., tts.config.codec_eos_token_id] = allow_eos
    return int(sampler.sample(logits.masked_fill(~allowed, float("-inf")).view(1, -1), generator))


@torch.inference_mode()
def synthesize_codes(tts: StandinTTS, text: str, lang: str, sampler: Sampler = Sampler(),
                     talker_sampler: Sampler = Sampler(), generator: torch.Generator | None = None,
                     drafter=None, tree: Tree | None = None, max_frames: int | None = None,
                     on_frame: Callable[[Tensor], None] | None = None) -> Synthesis:
    """Codes [T, 16] for `text`; the predictor runs AR (drafter None) or speculative (drafter + tree).
    `on_frame(codes [16])` is called as each frame is done (streaming)."""
    talker = tts.talker
    device = talker.norm.weight.device
    prefix = tts.prefix_embed(text, lang).to(talker.norm.weight.dtype)
    max_frames = max_frames or max_frames_for(tts, text, lang)
    slots = len(prefix) + max_frames
    frame_positions = tts.frame_positions(torch.arange(max_frames, device=device), lang)
    if int(frame_positions[-1]) >= talker.config.max_position_embeddings:
        raise RvqspecError(f"text of {len(text.encode())} bytes is too long for the stand-in: split it into "
                           "sentences")
    talker.setup_cache(slots)
    all_slots = torch.arange(slots, device=device)
    masks = all_slots[None, :] <= all_slots[:, None]
    start = time.perf_counter()
    prefix_slots = all_slots[:len(prefix)]
    hidden = talker(prefix[None], tts.prefix_positions(len(prefix)), masks[prefix_slots], prefix_slots)[0, -1]
    frames, states = [], []
    out = Synthesis(codes=torch.empty(0, 16, dtype=torch.long), hidden=torch.empty(0, talker.config.hidden_size))
    for t in range(max_frames):
        c0 = sample_c0(tts, hidden, talker_sampler, generator, allow_eos=t > 0)
        if c0 == tts.config.codec_eos_token_id:
            break
        inner = time.perf_counter()
        result = decode_frame(tts.predictor, hidden, c0, sampler, generator, drafter=drafter, tree=tree)
        out.frame_seconds.append(time.perf_counter() - inner)
        out.predictor_calls += result.calls
        out.accepted += [r.accepted for r in result.rounds]
        frame = torch.cat([torch.tensor([c0], device=device), result.codes])
        frames.append(frame)
        states.append(hidden)
        if on_frame is not None:
            inner = time.perf_counter()
            on_frame(frame)
            out.on_frame_seconds += time.perf_counter() - inner
        if t + 1 < max_frames:
            slot = all_slots[len(prefix) + t:len(prefix) + t + 1]
            hidden = talker(tts.frame_embed(frame)[None, None], frame_positions[t:t + 1], masks[slot], slot)[0, -1]
    out.talker_seconds = time.perf_counter() - start - out.predictor_seconds - out.on_frame_seconds
    if frames:
        out.codes, out.hidden = torch.stack(frames).cpu(), torch.stack(states).float().cpu()
    return out


# ---------------------------------------------------------------- the test sentences, synthesized free-running


def first_per_lang(sentences: list[dict], per_lang: int | None) -> list[int]:
    """Indices of the first `per_lang` sentences of each language (all with None)."""
    seen: dict[str, int] = {}
    picked = []
    for i, s in enumerate(sentences):
        seen[s["lang"]] = seen.get(s["lang"], 0) + 1
        if per_lang is None or seen[s["lang"]] <= per_lang:
            picked.append(i)
    return picked


def test_sentences(manifest: Path, langs: list[str], per_lang: int | None) -> list[dict]:
    """The test split of the stand-in's corpus: the first `per_lang` sentences of each language."""
    if not manifest.is_file():
        raise RvqspecError(f"no corpus manifest at {manifest}: build the corpus with `rvqspec corpus speech` "
                           "or pass --manifest")
    rows = [r for r in read_manifest(manifest) if r["split"] == "test"]
    picked = []
    for lang in langs:
        of_lang = [r for r in rows if r["lang"] == lang]
        if not of_lang:
            raise RvqspecError(f"the test split of {manifest} has no {lang!r} sentences: "
                               f"use --langs with some of {', '.join(sorted({r['lang'] for r in rows}))}")
        picked += of_lang[:per_lang]
    return picked


@dataclass
class Run:
    """One free-running synthesis of one sentence."""

    codes: Tensor  # [T, 16]
    calls: int  # predictor calls, the prefill of every frame included

    @property
    def frames(self) -> int:
        return len(self.codes)


def stream_seed(*parts) -> int:
    """Independent random stream per (seed, mode, sentence): AR and speculative never share draws."""
    return int(hashlib.sha256(":".join(map(str, parts)).encode()).hexdigest()[:15], 16)


def synthesize_all(tts, sentences: list[dict], seed: int, mode: str, drafter, tree,
                   max_frames: int | None = None) -> list[Run]:
    runs = []
    for sentence in sentences:
        generator = torch.Generator().manual_seed(stream_seed(seed, mode, sentence["id"]))
        out = synthesize_codes(tts, sentence["text"], sentence["lang"], generator=generator, drafter=drafter,
                               tree=tree if drafter is not None else None, max_frames=max_frames)
        runs.append(Run(out.codes, out.predictor_calls))
    return runs


def self_synthesis(tts: StandinTTS, seed: int = 0):
    """`rvqspec tune --model standin`: the built-in sentences in the stand-in's languages, free-running with the
    deployed sampling, again and again (other draws each pass): (id, language, codes [T, 16], hidden [T, H])."""
    from rvqspec.tuning.sentences import rounds

    for turn, index, lang, text in rounds(list(tts.config.languages)):
        generator = torch.Generator().manual_seed(stream_seed(seed, "tune", lang, index, turn))
        synthesis = synthesize_codes(tts, text, lang, generator=generator)
        if synthesis.frames >= 2:
            yield f"{lang}-{index:03d}-{turn}", lang, synthesis.codes, synthesis.hidden
