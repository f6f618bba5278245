"""Code corpora from a model's own speech (`rvqspec tune`): the built-in sentences synthesized free-running with
the model's deployed sampling, per frame the state that conditions its depth decoder and all its codes.

That is the distribution the verifier samples from at deployment (the paper calibrates on free-running synthesis):
no recordings, no transcripts. Each utterance yields (id, language, codes [T, G], hidden [T, H]).
"""

import itertools
from collections.abc import Iterator

import torch
from torch import Tensor

from rvqspec.core.errors import RvqspecError
from rvqspec.integrations.qwen_tts import accelerate, speech_request
from rvqspec.tuning.sentences import LANGUAGE_NAMES, VOICE_DESCRIPTIONS, rounds

Utterance = tuple[str, str, Tensor, Tensor]


def qwen_tts_languages(tts) -> list[str]:
    supported = tts.get_supported_languages()
    if supported is None:
        return list(LANGUAGE_NAMES)
    names = {name.lower() for name in supported}
    return [code for code, name in LANGUAGE_NAMES.items() if name.lower() in names]


def qwen_tts_utterances(tts, batch: int = 4, seed: int = 0) -> Iterator[Utterance]:
    """Free-running synthesis through upstream's own entry point for the model's type (CustomVoice: its speakers
    in turn; VoiceDesign: the built-in descriptions), `batch` texts per call, codes drawn by rvqspec (lossless:
    upstream's distribution) and recorded as upstream's `generate` returns them with the talker's states."""
    kind = tts.model.tts_model_type
    if kind == "base":
        raise RvqspecError("a voice-clone (Base) model speaks only in a reference voice, which rvqspec tune does not "
                           "have: tune the CustomVoice or VoiceDesign model of the same size, or build a corpus from "
                           "recordings with `rvqspec corpus from-audio`")
    speakers = tts.get_supported_speakers() or [None]
    handle = accelerate(tts)  # rvqspec's AR: the same draws as upstream's predictor, faster
    try:
        pending = rounds(qwen_tts_languages(tts))
        for call in itertools.count():
            items = [next(pending) for _ in range(batch)]
            torch.manual_seed(seed * 1_000_003 + call)
            codes, hidden = generate_codes(tts, items, speakers, call)
            for (turn, index, lang, _), row_codes, row_hidden in zip(items, codes, hidden):
                yield f"{lang}-{index:03d}-{turn}", lang, row_codes.cpu(), row_hidden.float().cpu()
    finally:
        handle.undo()


def generate_codes(tts, items, speakers: list, call: int) -> tuple[list[Tensor], list[Tensor]]:
    """Upstream's `model.generate` for the items' texts, conditioned as its entry point conditions them."""
    from rvqspec.tuning.qwen_tts_corpus import PromptCaptured

    texts = [text for _, _, _, text in items]
    languages = [LANGUAGE_NAMES[lang] for _, _, lang, _ in items]
    entry_point, arguments = speech_request(tts, texts, languages, speaker=[speakers[(call + i) % len(speakers)]
                                                                            for i in range(len(items))])
    if entry_point == "voice_design":
        arguments["instruct"] = [VOICE_DESCRIPTIONS[(call + i) % len(VOICE_DESCRIPTIONS)] for i in range(len(items))]
    captured = {}
    generate = tts.model.generate

    def capture(**kwargs):  # the entry point's inputs to model.generate, then upstream's generate with them
        captured.update(kwargs)
        raise PromptCaptured

    tts.model.generate = capture
    try:
        getattr(tts, f"generate_{entry_point}")(**arguments)
    except PromptCaptured:
        pass
    finally:
        del tts.model.generate
    return generate(**captured)


def csm_utterances(model, processor, speaker: str = "0", seed: int = 0) -> Iterator[Utterance]:
    """Free-running synthesis with transformers' CSM generate (its generation_config's sampling), one text per
    call, the backbone's state per frame rebuilt by teacher forcing (`csm_corpus.teacher_forced_hidden`: the
    state generate passes, tested)."""
    from rvqspec.integrations.csm import accelerate as accelerate_csm
    from rvqspec.tuning.csm_corpus import teacher_forced_hidden

    handle = accelerate_csm(model)
    device = model.depth_decoder.codebooks_head.weight.device
    try:
        for call, (turn, index, lang, text) in enumerate(rounds(["en"])):  # CSM-1B speaks English
            ids = torch.tensor(processor(text=f"[{speaker}]{text}", add_special_tokens=True)["input_ids"][0])
            torch.manual_seed(seed * 1_000_003 + call)
            with torch.inference_mode():
                out = model.generate(input_ids=ids[None].to(device), attention_mask=torch.ones_like(ids[None]).to(device),
                                     max_new_tokens=csm_max_frames(text))
            codes = out[0] if isinstance(out, Tensor) else out.sequences[0]
            ended = (codes == model.config.codebook_eos_token_id).all(-1).nonzero()
            codes = codes[:int(ended[0, 0])] if len(ended) else codes
            if len(codes) >= 2:
                yield f"{lang}-{index:03d}-{turn}", lang, codes.cpu(), teacher_forced_hidden(model, ids, codes).float().cpu()
    finally:
        handle.undo()


def csm_max_frames(text: str) -> int:
    """A cap on a CSM utterance's frames: ~3x a normal speaking rate (about 15 characters a second), + 2 s."""
    return int(3 * 12.5 * len(text) / 15) + 25
