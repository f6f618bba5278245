"""Code corpora for Qwen3-TTS from recordings (`rvqspec corpus from-audio`): each recording's 12 Hz codes and the
talker's hidden state per frame, rebuilt by teacher forcing from the prompt that upstream's own entry points build."""

from pathlib import Path

import torch
from torch import Tensor

from rvqspec.integrations.qwen_tts import generate_speech
from rvqspec.tuning.corpus import CorpusWriter
from rvqspec.tuning.recordings import audio_with_transcripts, load_recording, utterance_id


def corpus_from_audio(tts, folder: str | Path, out: str | Path, language: str = "Auto", speaker: str | None = None,
                      instruct: str | None = None, hidden_dtype: torch.dtype = torch.float16,
                      overwrite: bool = False, meta: dict | None = None) -> dict:
    """Write a code corpus from the audio under `folder`: per frame, the 12 Hz codes of the recording and
    the talker's hidden state for them under teacher forcing, conditioned as `generate_speech` would be
    (a Base model is conditioned on each recording's own x-vector)."""
    items = audio_with_transcripts(folder)
    talker = tts.model.talker
    meta = {"source": "rvqspec corpus from-audio", "language": language, "speaker": speaker, **(meta or {})}
    frames = 0
    with CorpusWriter(out, talker.config.hidden_size, talker.config.num_code_groups, hidden_dtype=hidden_dtype,
                      meta=meta, overwrite=overwrite) as writer:
        for path, text in items:
            wav, sample_rate = load_recording(path)
            codes = tts.model.speech_tokenizer.encode(wav, sr=sample_rate).audio_codes[0]
            prompt = talker_prompt(tts, text, language=language, speaker=speaker, instruct=instruct,
                                   ref_audio=(wav, sample_rate))
            hidden = teacher_forced_hidden(talker, prompt, codes)
            writer.add(utterance_id(path, folder), language.lower(), codes.cpu(), hidden.float().cpu())
            frames += len(codes)
    return {"out": str(out), "utterances": len(items), "frames": frames}


class PromptCaptured(Exception):
    """Raised from upstream's generate once the talker's inputs are built, so that nothing is generated."""


def talker_prompt(tts, text: str, **speech_args) -> dict[str, Tensor]:
    """The inputs upstream's `talker.generate` gets for `text` (a batch of one), as built by `generate_speech`
    with the same arguments; the talker generates nothing."""
    talker, captured = tts.model.talker, {}

    def capture(**kwargs):
        captured.update(kwargs)
        raise PromptCaptured

    talker.generate = capture
    try:
        generate_speech(tts, text, **speech_args)
    except PromptCaptured:
        pass
    finally:
        del talker.generate
    return {name: captured[name] for name in ("inputs_embeds", "attention_mask", "trailing_text_hidden",
                                             "tts_pad_embed")}


@torch.inference_mode()
def teacher_forced_hidden(talker, prompt: dict[str, Tensor], codes: Tensor) -> Tensor:
    """The talker's hidden state that conditions the predictor for each frame of `codes` [T, G]: [T, hidden].

    That is upstream's `past_hidden`: the final (normed) hidden state at the step that emitted the frame's
    c0. One causal pass over the prompt and frames 0..T-2, each frame's input built as upstream's talker
    builds it in `forward`: the sum of its G code embeddings plus the next text embedding (or tts_pad).
    """
    codes = codes.to(talker.device)
    frames = codes[:-1]
    tables = [talker.get_input_embeddings()] + list(talker.code_predictor.get_input_embeddings())
    codec = torch.stack([table(frames[:, g]) for g, table in enumerate(tables)], dim=1).sum(1)
    text = prompt["trailing_text_hidden"][0, :len(frames)]
    text = torch.cat([text, prompt["tts_pad_embed"][0].expand(len(frames) - len(text), -1)])
    inputs = torch.cat([prompt["inputs_embeds"], (codec + text)[None]], dim=1)
    mask = torch.cat([prompt["attention_mask"], prompt["attention_mask"].new_ones(1, len(frames))], dim=1)
    position_ids, _ = talker.get_rope_index(mask)
    hidden = talker.model(inputs_embeds=inputs, attention_mask=mask, position_ids=position_ids,
                          use_cache=False).last_hidden_state
    start = prompt["inputs_embeds"].shape[1] - 1
    return hidden[0, start:start + len(codes)]
