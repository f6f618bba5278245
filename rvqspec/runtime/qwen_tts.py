"""A qwen-tts model (`qwen_tts.Qwen3TTSModel`, 12 Hz) in the engine's frame loop.

Prompts stay upstream's: `prompts` runs the model's own `generate_<entry point>` with the same arguments, and stops
it where upstream's talker would start generating (`Qwen3TTSForConditionalGeneration.generate` ->
`talker.generate(inputs_embeds=..., attention_mask=..., trailing_text_hidden=..., tts_pad_embed=..., **settings)`):
every prompt upstream builds (custom voice with its speaker and instruct, voice design, voice clone with its
reference codes) is what the engine decodes from, with upstream's settings (generate_config.json defaults
included). From there the loop is ours (`runtime/scheduler.py`), doing what upstream's talker forward does per
step: c0 through its logits processing, c1..c15 from the predictor, then the next input, the sum of the 16 code
embeddings plus the trailing text (or the pad embedding once the text is used up).

Text that arrives over time (`live_prompt`) runs upstream's dual-track prompt (`non_streaming_mode=False`): captured
with a one-token stand-in text, whose rows (the first text token's, or an in-context clone's reference transcript
and text beside its reference codes) are replaced by the request's own as they arrive (`runtime/live_text.py`).
"""

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace

import numpy as np
import torch
from torch import Tensor

from rvqspec.core.errors import RvqspecError
from rvqspec.core.sampling import Sampler, TalkerRules
from rvqspec.integrations.qwen_tts import predictor_from_upstream, talker_from_upstream, upstream_refusals
from rvqspec.integrations.qwen_tts_audio import CodecBatchUnsupported, StreamingCodec, decode_together
from rvqspec.runtime.adapter import Captured, TalkerAdapter, capture, frame_budget, patched, this_thread
from rvqspec.runtime.live_text import LiveText, StableTokens
from rvqspec.runtime.request import AudioStream, Prompt

ENTRY_POINTS = {"custom_voice": "custom_voice", "voice_design": "voice_design", "base": "voice_clone"}  # type: kind
# The default frame budget of a text (`frame_budget`; docs/limits.md): 8 frames (0.64 s) per text token, at least
# 125 frames (10 s). Speech runs at about 3-4 frames per token of Qwen's tokenizer (English words, CJK characters,
# digits), the slow ones (a digit or symbol spelled out) 5-6; mlx-audio's rule is max(75, 6 per token).
FRAMES_PER_TOKEN, FLOOR_FRAMES = 8.0, 125
STAND_IN_TEXT = "a"  # one token: the text a live prompt is captured with (its rows are replaced)
CHAT_TOKENS = 8  # the tokens around a text in upstream's input_ids: "<|im_start|>assistant\n" and 5 after it


def text_budget(input_ids: Tensor) -> int:
    """The default frame budget (c0 draws, upstream's max_new_tokens) of a text, from upstream's input_ids [1, L]
    for it (the chat tokens around it included)."""
    return frame_budget(input_ids.shape[-1] - CHAT_TOKENS, FRAMES_PER_TOKEN, FLOOR_FRAMES)


def upstream_text_budget(tts, text: str) -> int:
    """For upstream's own loop: `text_budget` of `text` tokenized as upstream's generate_* tokenize it, within the
    checkpoint's own default (generate_config.json's max_new_tokens), as the Engine bounds it."""
    budget = text_budget(tts._tokenize_texts([tts._build_assistant_text(text)])[0])
    return min(budget, int(tts.generate_defaults.get("max_new_tokens") or budget))


class QwenTTSModel(TalkerAdapter):
    """The talker, predictor and codec of `tts` as the scheduler uses them (the contract: `runtime/adapter.py`).
    Its streams' chunks due at once decode in one forward of the 12 Hz decoder (1.2-1.5x faster than one by one at
    the 0.6B sizes: benchmarks/results/codec-batch-streaming.md)."""

    codec_batches = True
    decodes_ahead = True  # the 12 Hz decoder runs incrementally (`StreamingCodec`): a call pays only its own cost
    dual_track = True  # text can arrive over time (`live_prompt`)

    def __init__(self, tts, weights: str | None = None, talker_weights: str | None = None):
        self.tts, self.upstream = tts, tts.model.talker
        self.kind = ENTRY_POINTS.get(tts.model.tts_model_type)
        if self.kind is None:
            raise RvqspecError(f"unknown qwen-tts model type {tts.model.tts_model_type!r}: rvqspec.Engine decodes "
                               f"{', '.join(ENTRY_POINTS)} models")
        super().__init__(talker_from_upstream(self.upstream), predictor_from_upstream(self.upstream), weights,
                         talker_weights)
        self.sample_rate = int(tts.model.speech_tokenizer.get_output_sample_rate())
        self.frame_seconds = int(tts.model.speech_tokenizer.model.decoder.total_upsample) / self.sample_rate
        self.capture_lock = threading.Lock()

    @property
    def can_clone(self) -> bool:
        return self.kind == "voice_clone"

    def voices(self) -> list[str]:
        return list(self.tts.get_supported_speakers() or []) if self.kind == "custom_voice" else []

    def frame_inputs(self, frames: Tensor) -> Tensor:
        """The talker's next input [B, H] for frames [B, 16], summed as upstream's forward does (its own tables: the
        same rows in the same [B, 16, H] layout, the same sum; read as index_select, not 16 module calls: 0.7x the
        time per frame)."""
        tables = [self.upstream.get_input_embeddings()] + list(self.upstream.code_predictor.get_input_embeddings())
        return torch.stack([table.weight.index_select(0, frames[:, i]) for i, table in enumerate(tables)], 1).sum(1)

    def speech(self, text: str, voice: str | None, instructions: str | None, language: str | None,
               clone) -> tuple[str, dict]:
        """(kind, arguments) of `Engine.speech`'s request for this model's entry point."""
        arguments = dict(text=text, language=language or "Auto")
        if self.kind == "custom_voice":
            voices = self.voices()
            if voice is None or voice.lower() not in {v.lower() for v in voices}:
                raise RvqspecError(f"unknown voice {voice!r}: this model speaks as {', '.join(voices)}")
            return self.kind, dict(arguments, speaker=voice, instruct=instructions)
        if self.kind == "voice_design":
            if not instructions:
                raise RvqspecError("a voice-design model needs instructions (a description of the voice)")
            return self.kind, dict(arguments, instruct=instructions)
        if clone is None:
            raise RvqspecError("a voice-clone model needs a registered voice (clone=engine.clone_prompt(...))")
        return self.kind, dict(arguments, voice_clone_prompt=clone)

    def clone_prompt(self, audio: np.ndarray, sample_rate: int, transcript: str | None):
        if not self.can_clone:
            raise RvqspecError(f"this is a {self.kind} model: only a voice-clone (Base) model clones voices")
        with upstream_refusals():
            return self.tts.create_voice_clone_prompt(ref_audio=(audio, sample_rate), ref_text=transcript,
                                                      x_vector_only_mode=not transcript)

    def prompts(self, kind: str, arguments: dict) -> list[Prompt]:
        """One Prompt per text of `tts.generate_<kind>(**arguments)` (module docstring)."""
        if kind != self.kind:
            raise RvqspecError(f"this is a {self.tts.model.tts_model_type} model: submit {self.kind!r} requests")
        captured = self.capture(kind, arguments)
        prompts = [self.prompt(captured, row) for row in range(len(captured["inputs_embeds"]))]
        if arguments.get("max_new_tokens") is None:  # an explicit limit always wins
            for prompt, ids in zip(prompts, captured["input_ids"]):
                prompt.max_new_tokens = min(prompt.max_new_tokens, text_budget(ids))
        return prompts

    def capture(self, kind: str, arguments: dict) -> dict:
        with upstream_refusals():
            captured = capture(self.capture_lock, self.stopping_talker(),
                               lambda: getattr(self.tts, f"generate_{kind}")(**arguments), (TypeError,),
                               f"generate_{kind}")
        if captured is None:
            raise RvqspecError("qwen-tts generated without its talker: this qwen-tts version is not supported (0.1.1 "
                               "is)")
        return captured

    @contextlib.contextmanager
    def stopping_talker(self) -> Iterator[dict]:
        """While held (by this thread): upstream's model.generate records its arguments, its talker.generate raises
        Captured (`adapter.capture`); other threads' calls pass through."""
        model, talker, seen = self.tts.model, self.upstream, {}
        model_generate, talker_generate = model.generate, talker.generate

        def recording(*args, **kwargs):
            seen.update(kwargs)
            return model_generate(*args, **kwargs)

        def stopping(*args, **kwargs):
            raise Captured(kwargs)

        with patched({(model, "generate"): this_thread(recording, model_generate),
                      (talker, "generate"): this_thread(stopping, talker_generate)}):
            yield seen

    def entry_point(self, kind: str) -> Callable | None:
        return getattr(self.tts, f"generate_{kind}", None)

    def prompt(self, captured: dict, row: int) -> Prompt:
        real = captured["attention_mask"][row].bool()
        embeds = captured["inputs_embeds"][row][real]
        max_new_tokens = int(captured["max_new_tokens"])  # frame t sits at RoPE id L + t (upstream's rope_deltas)
        get = captured.get
        rules = TalkerRules(
            sampler=Sampler(do_sample=bool(get("do_sample")), temperature=float(get("temperature") or 1.0),
                            top_k=int(get("top_k") or 0), top_p=float(get("top_p") or 1.0)),
            eos=int(captured["eos_token_id"]), allowed=self.allowed(get("suppress_tokens") or []),
            min_new_tokens=int(get("min_new_tokens") or 0), repetition_penalty=float(get("repetition_penalty") or 1.0))
        sampler = Sampler(do_sample=bool(get("subtalker_dosample")), temperature=float(get("subtalker_temperature")),
                          top_k=int(get("subtalker_top_k") or 0), top_p=float(get("subtalker_top_p") or 1.0))
        return Prompt(embeds=embeds, positions=torch.arange(len(embeds), device=embeds.device),
                      frame_positions=list(range(len(embeds), len(embeds) + max_new_tokens)), rules=rules,
                      sampler=sampler, max_new_tokens=max_new_tokens, text=captured["trailing_text_hidden"][row],
                      pad=captured["tts_pad_embed"].reshape(-1), prefix=self.reference_codes(captured, row))

    def live_prompt(self, kind: str, arguments: dict) -> Prompt:
        """The Prompt of `tts.generate_<kind>(**arguments, non_streaming_mode=False)` for a text still to come: its
        `live` takes the text's pieces (`live.read`), the rows that depend on it filled as they arrive."""
        captured = self.capture(kind, {**arguments, "text": STAND_IN_TEXT, "non_streaming_mode": False})
        if len(captured["inputs_embeds"]) != 1:
            raise RvqspecError("text that arrives over time is one text: submit one request per text")
        prompt, config = self.prompt(captured, 0), self.tts.model.config
        bos, eos, pad = self.project(torch.tensor([config.tts_bos_token_id, config.tts_eos_token_id,
                                                   config.tts_pad_token_id], device=self.upstream.device))
        tokens = StableTokens(self.tts.processor.tokenizer)
        reference = self.reference_codes(captured, 0)
        clone = captured.get("voice_clone_prompt") or {}
        if reference is not None and clone["icl_mode"][0]:  # the text goes beside the reference codes
            codes = self.reference_embeds(reference)
            known = captured["ref_ids"][0][0, 3:-2].tolist()
            live = LiveText(tokens, self.project, eos, pad, len(codes),
                            lambda text: torch.stack([text.row(k) for k in range(len(codes))]) + codes, known)
        else:
            first = self.upstream.get_input_embeddings()(torch.tensor(
                [[self.upstream.config.codec_pad_id, self.upstream.config.codec_bos_id]], device=pad.device))[:, -1:]
            live = LiveText(tokens, self.project, eos, pad, 1, lambda text: self.project_first(text.ids[0]) + first[0])
        prompt = replace(prompt, text=None, pad=None, live=live)
        if arguments.get("max_new_tokens") is None:  # the text budget, once the text is known (`text_budget`)
            live.on_end = lambda tokens: setattr(prompt, "max_new_tokens", min(
                prompt.max_new_tokens, frame_budget(tokens, FRAMES_PER_TOKEN, FLOOR_FRAMES)))
        return prompt

    def project(self, ids: Tensor) -> Tensor:
        """Text ids [n] -> the talker's text rows [n, H], as upstream projects them."""
        return self.upstream.text_projection(self.upstream.get_text_embeddings()(ids[None].to(self.upstream.device)))[0]

    def project_first(self, token: int) -> Tensor:
        """The first text token's row [1, H], in a call of one row as upstream's (its `input_id[:, 3:4]`)."""
        return self.project(torch.tensor([token]))

    def reference_embeds(self, codes: Tensor) -> Tensor:
        """An in-context clone's codec rows [1 + n, H]: codec BOS, then each reference frame's summed embeddings
        (upstream's generate_icl_prompt, the same calls)."""
        talker, device = self.upstream, self.upstream.device
        codes = codes.to(device)
        groups = [talker.get_input_embeddings()(codes[:, :1])] + [
            talker.code_predictor.get_input_embeddings()[i - 1](codes[:, i:i + 1])
            for i in range(1, talker.config.num_code_groups)]
        frames = torch.cat(groups, dim=1).sum(1).unsqueeze(0)
        bos = talker.get_input_embeddings()(torch.tensor([[self.tts.model.config.talker_config.codec_bos_id]],
                                                         device=device))
        return torch.cat([bos, frames], dim=1)[0]

    def allowed(self, suppressed: list[int]) -> Tensor:
        allowed = torch.ones(self.upstream.config.vocab_size, dtype=torch.bool)
        allowed[torch.tensor(suppressed, dtype=torch.long)] = False
        return allowed.to(self.talker.device)

    @staticmethod
    def reference_codes(captured: dict, row: int) -> Tensor | None:
        prompt = captured.get("voice_clone_prompt") or {}
        codes = prompt.get("ref_code") if isinstance(prompt, dict) else None
        return None if codes is None or codes[row] is None else codes[row]

    def new_stream(self, prompt: Prompt) -> AudioStream:
        return CodecStream(StreamingCodec(self.tts.model.speech_tokenizer.model.decoder), prompt.prefix)

    def add_together(self, streams: list[AudioStream], frames: list[list[Tensor]]) -> list[np.ndarray]:
        if not self.codec_batches:
            return super().add_together(streams, frames)
        try:
            audio = decode_together([stream.codec for stream in streams], [torch.stack(chunk) for chunk in frames])
        except CodecBatchUnsupported:
            self.codec_batches = False  # the streams of this call are part-decoded: they end with the error
            raise
        return [samples.float().cpu().numpy() for samples in audio]

    def whole(self, codes: list[Tensor], prompts: list[Prompt]) -> tuple[list[np.ndarray], int]:
        """Upstream's result for these codes: its decode, a clone's reference audio cut off, as generate_* does."""
        full = [torch.cat([p.prefix.to(c.device), c]) if p.prefix is not None else c for c, p in zip(codes, prompts)]
        wavs, sample_rate = self.tts.model.speech_tokenizer.decode([{"audio_codes": c} for c in full])
        out = []
        for wav, c, p in zip(wavs, full, prompts):
            cut = 0 if p.prefix is None else int(len(p.prefix) / max(len(c), 1) * wav.shape[0])
            out.append(wav[cut:])
        return out, sample_rate


class CodecStream(AudioStream):
    """The 12 Hz codec run incrementally (`StreamingCodec`); a clone's reference codes decoded first, unheard."""

    def __init__(self, codec: StreamingCodec, prefix: Tensor | None):
        self.codec = codec
        if prefix is not None:
            codec.decode(prefix.reshape(len(prefix), -1).cpu())

    def add(self, frames: list[Tensor]) -> np.ndarray:
        return self.codec.decode(torch.stack(frames)).float().cpu().numpy()
