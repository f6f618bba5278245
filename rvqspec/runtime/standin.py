"""The stand-in Qwen3-TTS in the engine's frame loop, step for step what `standin.synthesis.synthesize_codes` does
(its talker already runs on the core's blocks): prefill [lang, UTF-8 bytes, bos]; frame t's input is the sum of its
16 code embeddings at the text-aligned RoPE id round((t + 1) * bytes per frame); c0 among the codes, EOS from the
second frame on.

The contract it keeps: `runtime/adapter.py`. The rest of runtime/ reaches the stand-in only through this module (its
loaders: `StandinModel.shipped`, `from_folder`, `from_tts`).
"""

from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from rvqspec.core.errors import RvqspecError
from rvqspec.core.sampling import Sampler, TalkerRules
from rvqspec.runtime.adapter import TalkerAdapter
from rvqspec.runtime.request import AudioStream, Prompt
from rvqspec.standin.audio import SAMPLE_RATE
from rvqspec.standin.codec import MelRVQCodec
from rvqspec.standin.streaming import CONTEXT_FRAMES, ChunkedVocoder
from rvqspec.standin.synthesis import max_frames_for
from rvqspec.standin.settings import ASSETS
from rvqspec.standin.talker import StandinTTS, load_standin

KIND = "speech"  # the stand-in's one entry point: text and language
# Sampler field: (the talker's setting, the predictor's), under qwen-tts's names
SAMPLING = {"do_sample": ("do_sample", "subtalker_dosample"), "temperature": ("temperature", "subtalker_temperature"),
            "top_k": ("top_k", "subtalker_top_k"), "top_p": ("top_p", "subtalker_top_p")}


class StandinModel(TalkerAdapter):
    """The stand-in `tts` and its `codec` as the scheduler uses them."""

    kind = KIND
    can_clone = False
    sample_rate = SAMPLE_RATE

    def __init__(self, tts: StandinTTS, codec: MelRVQCodec, weights: str | None = None,
                 talker_weights: str | None = None):
        self.tts, self.codec = tts, codec
        # talker_weights on a copy of the talker: the caller's model keeps its float layers
        super().__init__(tts.talker, tts.predictor, weights, talker_weights, shared_talker=True)
        c = tts.config
        allowed = torch.zeros(c.vocab_size, dtype=torch.bool)
        allowed[:c.num_codes] = allowed[c.codec_eos_token_id] = True
        self.allowed = allowed.to(self.talker.norm.weight.device)
        self.frame_seconds = codec.cfg.samples_per_frame / SAMPLE_RATE

    @classmethod
    def shipped(cls, weights: str | None = None, talker_weights: str | None = None) -> "StandinModel":
        """The shipped stand-in (its assets folder: `ASSETS`)."""
        return cls.from_folder(ASSETS / "model", weights, talker_weights)

    @classmethod
    def from_folder(cls, folder: Path, weights: str | None = None,
                    talker_weights: str | None = None) -> "StandinModel":
        """A stand-in model folder, with the codec beside it (codec.safetensors in its parent) or the shipped one."""
        codec = folder.parent / "codec.safetensors"
        return cls(load_standin(folder), MelRVQCodec.load(codec if codec.is_file() else ASSETS / "codec.safetensors"),
                   weights, talker_weights)

    @classmethod
    def from_tts(cls, tts: StandinTTS, weights: str | None = None,
                 talker_weights: str | None = None) -> "StandinModel":
        """A loaded stand-in model, with the shipped codec."""
        return cls(tts, MelRVQCodec.load(), weights, talker_weights)

    def voices(self) -> list[str]:
        return list(self.tts.config.languages)

    def frame_inputs(self, frames: Tensor) -> Tensor:
        return self.tts.frame_embed(frames)

    def speech(self, text: str, voice: str | None, instructions: str | None, language: str | None,
               clone) -> tuple[str, dict]:
        if instructions or clone is not None:
            raise RvqspecError("the stand-in takes neither instructions nor cloned voices: pass text and a voice")
        if voice is not None and language is not None and voice != language:
            raise RvqspecError(f"the stand-in's voices are its languages: voice {voice!r} and language {language!r} "
                               "disagree; pass one of them")
        return KIND, dict(text=text, language=voice or language or self.voices()[0])

    def clone_prompt(self, audio: np.ndarray, sample_rate: int, transcript: str | None):
        raise RvqspecError("the stand-in does not clone voices: serve a qwen-tts Base model to register voices")

    def prompts(self, kind: str, arguments: dict) -> list[Prompt]:
        if kind != KIND:
            raise RvqspecError(f"the stand-in decodes {KIND!r} requests (text, language), not {kind!r}")
        unknown = set(arguments) - {"text", "language", "max_new_tokens", *sum(SAMPLING.values(), ())}
        if unknown:
            raise RvqspecError(f"the stand-in does not take {', '.join(sorted(unknown))}: pass text, language and "
                               "sampling settings")
        text, lang = arguments.get("text"), arguments.get("language", self.voices()[0])
        if not isinstance(text, str) or not text.strip():
            raise RvqspecError("text must be a non-empty string: pass a sentence to synthesize")
        embeds = self.tts.prefix_embed(text, lang)
        max_frames = arguments.get("max_new_tokens") or max_frames_for(self.tts, text, lang)
        frame_positions = self.tts.frame_positions(torch.arange(max_frames + 1), lang).tolist()
        if frame_positions[max_frames - 1] >= self.talker.config.max_position_embeddings:
            raise RvqspecError(f"text of {len(text.encode())} bytes is too long for the stand-in: split it into "
                               "sentences")
        prompt = Prompt(embeds=embeds, positions=self.tts.prefix_positions(len(embeds)),
                        frame_positions=frame_positions, rules=TalkerRules(self.sampler(arguments, 0), self.tts.config.codec_eos_token_id,
                                          self.allowed, min_new_tokens=1),
                        sampler=self.sampler(arguments, 1), max_new_tokens=max_frames + 1)
        return [prompt]

    @staticmethod
    def sampler(arguments: dict, which: int) -> Sampler:
        """The stand-in's default Sampler with the settings given for the talker (`which` 0) or the predictor (1)."""
        given = {field: arguments[names[which]] for field, names in SAMPLING.items()
                 if arguments.get(names[which]) is not None}
        return Sampler(**given)

    def new_stream(self, prompt: Prompt) -> AudioStream:
        return VocoderStream(self.codec)

    def whole(self, codes: list[Tensor], prompts: list[Prompt]) -> tuple[list[np.ndarray], int]:
        """Each utterance's audio at once: what its stream gives (the vocoder with its context each side)."""
        wavs = []
        for frames, prompt in zip(codes, prompts):
            stream = self.new_stream(prompt)
            wavs.append(np.concatenate([stream.add(list(frames)), stream.finish()]))
        return wavs, self.sample_rate


class VocoderStream(AudioStream):
    """Mel frame by frame, vocoded with CONTEXT_FRAMES of context each side (`standin.streaming`): it lags that much."""

    lag = CONTEXT_FRAMES

    def __init__(self, codec: MelRVQCodec):
        self.vocoder = ChunkedVocoder(codec)

    def add(self, frames: list[Tensor]) -> np.ndarray:
        for frame in frames:
            self.vocoder.add(frame)
        return self.audio(len(self.vocoder.mels) - CONTEXT_FRAMES)

    def finish(self) -> np.ndarray:
        return self.audio(len(self.vocoder.mels))

    def audio(self, end: int) -> np.ndarray:
        return self.vocoder.audio(end) if end > self.vocoder.done else np.zeros(0, dtype=np.float32)
