"""Code corpora for Sesame CSM from recordings (`rvqspec corpus from-audio` with a CSM checkpoint): each recording's
Mimi codes and the backbone's state per frame, rebuilt by teacher forcing, so that offsets can be trained and trees
calibrated for CSM."""

from pathlib import Path

import torch
from torch import Tensor

from rvqspec.tuning.corpus import CorpusWriter
from rvqspec.tuning.recordings import audio_with_transcripts, load_recording, utterance_id


@torch.inference_mode()
def teacher_forced_hidden(model, text_ids: Tensor, codes: Tensor) -> Tensor:
    """The backbone state that conditions the depth decoder for each frame of `codes` [T, G]: [T, H].

    As CSM's generate computes it (the last of the backbone's `hidden_states`, at the position before the
    frame), after the text prompt `text_ids` [L] (as its processor tokenizes "[speaker]text"), in one causal
    pass over the prompt and frames 0..T-2, each frame embedded as the backbone embeds a generated one."""
    device = model.depth_decoder.codebooks_head.weight.device
    text = model._merge_input_ids_with_input_values(text_ids.reshape(1, -1).to(device))["inputs_embeds"]
    frames = model.backbone_model.embed_tokens(codes[None, :-1].to(device))
    hidden = model(inputs_embeds=torch.cat([text, frames], dim=1), output_hidden_states=True).hidden_states[-1]
    start = text.shape[1] - 1
    return hidden[0, start:start + len(codes)]


def corpus_from_codes(model, items, out: str | Path, hidden_dtype: torch.dtype = torch.float16,
                      overwrite: bool = False, meta: dict | None = None) -> dict:
    """Write a code corpus for a CSM model from `items`: (utterance id, language, text token ids [L], codes
    [T, G]) each, the backbone's teacher-forced state per frame beside the codes."""
    config = model.config
    utterances = frames = 0
    with CorpusWriter(out, config.hidden_size, config.num_codebooks, hidden_dtype=hidden_dtype,
                      meta={"source": "rvqspec corpus from-audio (CSM)", **(meta or {})}, overwrite=overwrite) as writer:
        for utterance, language, text_ids, codes in items:
            hidden = teacher_forced_hidden(model, text_ids, codes)
            writer.add(utterance, language, codes.cpu(), hidden.float().cpu())
            utterances, frames = utterances + 1, frames + len(codes)
    return {"out": str(out), "utterances": utterances, "frames": frames}


def audio_items(model, processor, recordings, speaker: str, language: str):
    """(id, language, text ids, codes [T, G]) per recording (id, transcript, waveform at the codec's rate):
    "[speaker]transcript" tokenized by the processor, the audio encoded by the model's own Mimi codec."""
    weight = model.depth_decoder.codebooks_head.weight
    for utterance, text, wav in recordings:
        with torch.inference_mode():
            codes = model.codec_model.encode(torch.tensor(wav)[None, None].to(weight.device, weight.dtype)).audio_codes
        text_ids = torch.tensor(processor(text=f"[{speaker}]{text}", add_special_tokens=True)["input_ids"][0])
        yield utterance, language, text_ids, codes[0, :model.config.num_codebooks].T


def corpus_from_audio(model, processor, folder: str | Path, out: str | Path, speaker: str = "0",
                      language: str = "auto", hidden_dtype: torch.dtype = torch.float16, overwrite: bool = False,
                      meta: dict | None = None) -> dict:
    """Write a code corpus from the recordings under `folder` (each with its transcript) for a CSM model: the
    recordings encoded by its Mimi codec, the backbone's teacher-forced state per frame."""
    rate = processor.feature_extractor.sampling_rate
    loaded = ((utterance_id(path, folder), text, load_recording(path, rate)[0])
              for path, text in audio_with_transcripts(folder))
    items = audio_items(model, processor, loaded, speaker, language)
    return corpus_from_codes(model, items, out, hidden_dtype, overwrite, meta={"speaker": speaker, **(meta or {})})
