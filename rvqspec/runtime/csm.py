"""Sesame CSM (transformers' `CsmForConditionalGeneration`, tested with 4.57.3) in the engine's frame loop.

    engine = rvqspec.Engine(model)                             # model: CsmForConditionalGeneration
    inputs = processor.apply_chat_template(conversation, tokenize=True, return_dict=True)
    request = engine.submit("csm", **inputs, max_new_tokens=125)   # upstream's generate arguments, one conversation

Prompts stay upstream's: `prompts` runs the model's own `generate` with the same arguments and stops it at its first
backbone forward (`prepare_inputs_for_generation` in `CsmGenerationMixin._sample`), keeping what upstream built: the
prefill embeddings (text tokens, the audio context encoded by Mimi and merged in), their position ids, the backbone's
generation_config with the call's settings, its logits processors, its frame limit (`MaxLengthCriteria`, counted in
frames) and the depth decoder's settings (`depth_decoder_*`). The depth decoder's generation_config, which upstream's
generate updates in place and keeps, is left as it was. From there the loop is ours (`runtime/scheduler.py`), as
upstream's `_sample` steps: c0 from `lm_head` through its logits processing (greedy or its sampler), c1..c{G-1} from
the depth decoder's settings, the next input the sum of the frame's G codebook embeddings
(`backbone_model.embed_tokens`), and the request ends after its first frame whose codes c0..c{G-2} are all
`codebook_eos_token_id` (that frame is returned, as upstream's sequences hold it) or after max_new_tokens frames.

Audio: transformers' Mimi keeps no convolution state between decode calls, so a request's stream decodes each chunk
with left context (`integrations.csm_stream.MimiAudio`: exact while the utterance fits in that context, an
approximation beyond); `whole` decodes each utterance at once, as `generate(output_audio=True)` does.
"""

import contextlib
import copy
import threading
from collections.abc import Callable, Iterator

import numpy as np
import torch
from torch import Tensor

from rvqspec.core.errors import RvqspecError
from rvqspec.core.sampling import Sampler, TalkerRules
from rvqspec.integrations.base import UNSUPPORTED_SETTINGS
from rvqspec.integrations.csm import depth_decoder_from_transformers, talker_from_csm
from rvqspec.integrations.csm_stream import MimiAudio
from rvqspec.runtime.adapter import Captured, TalkerAdapter, capture, patched, this_thread
from rvqspec.runtime.request import AudioStream, Prompt

KIND = "csm"
NO_EOS = -1  # TalkerRules.eos: CSM ends on a whole frame (`last_frame`), never on c0 alone
REFUSED = ("streamer", "logits_processor", "stopping_criteria", "assistant_model", "synced_gpus", "inputs_embeds")
IGNORED = ("output_audio", "return_dict_in_generate")  # the engine's results have their own form


class CsmModel(TalkerAdapter):
    """The backbone, depth decoder and Mimi of a CSM model as the scheduler uses them (the contract:
    `runtime/adapter.py`)."""

    kind = KIND
    can_clone = False

    def __init__(self, model, weights: str | None = None, talker_weights: str | None = None):
        self.upstream = model
        # talker_weights swaps the talker's own layers (q/k/v and gate/up are copies; the rest stay upstream's)
        super().__init__(talker_from_csm(model), depth_decoder_from_transformers(model), weights, talker_weights)
        codec = model.codec_model.config
        self.sample_rate = int(codec.sampling_rate)
        self.frame_seconds = 1.0 / float(codec.frame_rate)
        self.eos = int(model.config.codebook_eos_token_id)
        self.capture_lock = threading.Lock()

    def voices(self) -> list[str]:
        return []

    def frame_inputs(self, frames: Tensor) -> Tensor:
        """The backbone's next input [B, H] for frames [B, G]: upstream's own embedding of the frame (the sum of its
        G codebook embeddings)."""
        return self.upstream.backbone_model.embed_tokens(frames[:, None, :])[:, 0]

    def ends(self, frame: Tensor) -> bool:
        """Upstream's stop rule: the frame's codes but the last are all the EOS code."""
        return bool((frame[:-1] == self.eos).all())

    def speech(self, text: str, voice: str | None, instructions: str | None, language: str | None,
               clone) -> tuple[str, dict]:
        raise RvqspecError("CSM takes its processor's inputs, not text: build them with transformers' "
                           "AutoProcessor (processor.apply_chat_template(conversation, tokenize=True, return_dict="
                           "True)) and call engine.submit('csm', **inputs)")

    def clone_prompt(self, audio: np.ndarray, sample_rate: int, transcript: str | None):
        raise RvqspecError("CSM has no voice-clone prompt: put the reference audio and its text in the conversation "
                           "as context (processor.apply_chat_template) and submit those inputs")

    # ---------------------------------------------------------------- prompts

    def prompts(self, kind: str, arguments: dict) -> list[Prompt]:
        """One Prompt per row of `model.generate(**arguments)` (module docstring)."""
        if kind != KIND:
            raise RvqspecError(f"this is a CSM model: submit {KIND!r} requests (the processor's inputs), not {kind!r}")
        refused = sorted(set(arguments) & set(REFUSED))
        if refused:
            raise RvqspecError(f"the engine does not take {', '.join(refused)}: pass input_ids (and the processor's "
                               "other outputs) with generation settings; iterate the request to stream")
        arguments = {name: value for name, value in arguments.items() if name not in IGNORED}
        input_ids = arguments.get("input_ids")
        if not isinstance(input_ids, Tensor) or input_ids.dim() != 2:
            raise RvqspecError("input_ids must be a LongTensor [batch, length] of text tokens, as CSM's processor "
                               "makes them (processor.apply_chat_template(..., tokenize=True, return_dict=True))")
        captured = self.capture(arguments)
        rules, sampler, frames = self.settings(captured)
        inputs = captured["inputs"]
        return [self.prompt(inputs, row, rules, sampler, frames) for row in range(len(inputs["inputs_embeds"]))]

    def capture(self, arguments: dict) -> dict:
        captured = capture(self.capture_lock, self.stopping_backbone(), lambda: self.upstream.generate(**arguments),
                           (TypeError, ValueError), "CSM's generate")
        if captured is None:
            raise RvqspecError("CSM generated without its backbone forward: this transformers version is not "
                               "supported (4.57.3 is)")
        return captured

    @contextlib.contextmanager
    def stopping_backbone(self) -> Iterator[dict]:
        """While held (by this thread): upstream's generate records its generation config, logits processors and
        stopping criteria, and raises Captured at its first forward (`adapter.capture`); other threads' calls pass
        through. The depth decoder's generation_config is swapped for a copy during the call (generate updates it in
        place with depth_decoder_* arguments) and put back after."""
        model, seen = self.upstream, {}
        depth = model.depth_decoder
        kept = depth.generation_config

        def recording(name: str, key: str) -> Callable:
            original = getattr(model, name)

            def wrapper(*args, **kwargs):
                seen[key] = result = original(*args, **kwargs)
                if key == "generation":
                    seen["depth"] = copy.deepcopy(depth.generation_config)
                return result
            return this_thread(wrapper, original)

        def stopping(*args, **kwargs):
            raise Captured({"inputs": prepare(*args, **kwargs)})

        prepare = model.prepare_inputs_for_generation
        depth.generation_config = copy.deepcopy(kept)
        try:
            with patched({(model, "_prepare_generation_config"): recording("_prepare_generation_config", "generation"),
                          (model, "_get_logits_processor"): recording("_get_logits_processor", "processors"),
                          (model, "_get_stopping_criteria"): recording("_get_stopping_criteria", "criteria"),
                          (model, "prepare_inputs_for_generation"): this_thread(stopping, prepare)}):
                yield seen
        finally:
            depth.generation_config = kept

    def settings(self, captured: dict) -> tuple[TalkerRules, Sampler, int]:
        """(the backbone's c0 rules, the depth decoder's sampler, the frame limit) of the captured call."""
        generation = captured["generation"][0]
        sampler, suppressed = self.backbone_sampler(captured["processors"], bool(generation.do_sample))
        allowed = torch.ones(self.talker.config.vocab_size, dtype=torch.bool)
        if suppressed is not None:
            allowed[suppressed.long().cpu()] = False
        rules = TalkerRules(sampler, NO_EOS, allowed.to(self.talker.device))
        limits = [c.max_length for c in captured["criteria"] if hasattr(c, "max_length")]
        if not limits:
            raise RvqspecError("CSM's generate set no frame limit: pass max_new_tokens")
        return rules, self.depth_sampler(captured["depth"]), max(1, int(min(limits)))

    @staticmethod
    def backbone_sampler(processors, do_sample: bool) -> tuple[Sampler, Tensor | None]:
        """The Sampler of upstream's c0 logits processors (temperature, top-k, top-p: its warpers), and the tokens it
        suppresses; any other processor is refused (the engine would draw from another distribution)."""
        settings, suppressed = {}, None
        for processor in processors:
            name = type(processor).__name__
            if name == "TemperatureLogitsWarper":
                settings["temperature"] = float(processor.temperature)
            elif name == "TopKLogitsWarper":
                settings["top_k"] = int(processor.top_k)
            elif name == "TopPLogitsWarper" and processor.min_tokens_to_keep == 1:
                settings["top_p"] = float(processor.top_p)
            elif name == "SuppressTokensLogitsProcessor":
                suppressed = processor.suppress_tokens
            else:
                raise RvqspecError(f"the engine does not implement CSM's c0 logits processing by {name}: drop the "
                                   "setting that adds it (e.g. repetition_penalty, min_p, min_new_tokens with an EOS "
                                   "token), or use rvqspec.accelerate(model)")
        return Sampler(do_sample=do_sample, **{"temperature": 1.0, "top_k": 0, "top_p": 1.0, **settings}), suppressed

    @staticmethod
    def depth_sampler(config) -> Sampler:
        """The depth decoder's settings as its generate reads them (None: HF's neutral value)."""
        found = [f"depth_decoder_{name}={getattr(config, name)!r}" for name, neutral in UNSUPPORTED_SETTINGS.items()
                 if getattr(config, name, neutral) not in (neutral, None)]
        if found:
            raise RvqspecError(f"the engine does not implement the depth decoder's {', '.join(found)}: drop it, or "
                               "use rvqspec.accelerate(model)")

        def pick(name, neutral):
            value = getattr(config, name, None)
            return neutral if value is None else value

        return Sampler(do_sample=bool(pick("do_sample", False)), temperature=float(pick("temperature", 1.0)),
                       top_k=int(pick("top_k", 0)), top_p=float(pick("top_p", 1.0)))

    def prompt(self, inputs: dict, row: int, rules: TalkerRules, sampler: Sampler, frames: int) -> Prompt:
        """Row `row` of the captured inputs: its real tokens (the attention mask's) at upstream's position ids; frame
        t then goes in at the last of them + t + 1, as upstream's positions (the mask's cumulative sum) count on."""
        embeds, positions, mask = inputs["inputs_embeds"][row], inputs.get("position_ids"), inputs.get("attention_mask")
        real = mask[row].bool() if mask is not None else torch.ones(len(embeds), dtype=torch.bool,
                                                                      device=embeds.device)
        positions = positions[row][real] if positions is not None else torch.arange(int(real.sum()),
                                                                                   device=embeds.device)
        embeds = embeds[real]
        if not len(embeds):
            raise RvqspecError(f"row {row} of input_ids has no tokens its attention_mask keeps: pass a non-empty "
                               "prompt")
        first = int(positions[-1])
        if first + frames >= self.talker.config.max_position_embeddings:
            raise RvqspecError(f"a prompt of {len(embeds)} tokens and {frames} frames exceeds CSM's "
                               f"{self.talker.config.max_position_embeddings} positions: lower max_new_tokens or "
                               "shorten the context")
        return Prompt(embeds=embeds, positions=positions, frame_positions=list(range(first + 1, first + frames + 2)),
                      rules=rules,
                      sampler=sampler, max_new_tokens=frames + 1, last_frame=self.ends)

    # ---------------------------------------------------------------- audio

    def new_stream(self, prompt: Prompt) -> AudioStream:
        return MimiStream(MimiAudio(self.upstream.codec_model), self.eos)

    def whole(self, codes: list[Tensor], prompts: list[Prompt]) -> tuple[list[np.ndarray], int]:
        """`generate(output_audio=True)`'s audio for these codes (as float32 arrays) and the sample rate: each
        utterance cut before its first all-EOS frame and decoded by Mimi at once."""
        wavs = []
        for frames in codes:
            stop = (frames == self.eos).all(-1).nonzero() if len(frames) else frames.new_zeros(0, 1)
            frames = frames[:int(stop.min())] if len(stop) else frames
            if not len(frames):
                wavs.append(np.zeros(0, dtype=np.float32))
                continue
            with torch.no_grad():
                audio = self.upstream.codec_model.decode(frames.T[None].to(self.talker.device)).audio_values[0, 0]
            wavs.append(audio.float().cpu().numpy())
        return wavs, self.sample_rate


class MimiStream(AudioStream):
    """A request's frames through Mimi as they come (`MimiAudio`: left context; its audio ends at the all-EOS frame)."""

    def __init__(self, mimi: MimiAudio, eos: int):
        self.mimi, self.eos = mimi, eos

    def add(self, frames: list[Tensor]) -> np.ndarray:
        for frame in frames:
            self.mimi.add(frame, self.eos)
        return self.mimi.audio()
