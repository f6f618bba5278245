"""Drop-in acceleration for Sesame CSM in transformers (`CsmForConditionalGeneration`, tested with 4.57.3).

    import rvqspec
    handle = rvqspec.accelerate(model, drafter=rvqspec.ReusedHeads())  # model: CsmForConditionalGeneration
    audio = model.generate(**inputs, output_audio=True)                # the same call as before
    print(handle.stats)
    handle.undo()

How it hooks in: for every frame, CSM's backbone samples c0 and calls `depth_decoder.generate(input_ids=[B, 2]
(a 0 placeholder, c0), backbone_last_hidden_state=[B, H])`, which returns [B, 2 + 31]: the inputs, then
c1..c31. `accelerate` replaces that one method, on that instance, with `rvqspec.decode_frames` over a
MultiCodeDecoder holding a copy of the depth decoder's weights; the sampling settings are the depth decoder's
generation_config (what `depth_decoder_do_sample=`, `depth_decoder_temperature=`, ... of the backbone's
generate set), read at every call. Any other call goes to upstream.

For `rvqspec corpus from-audio` with a CSM checkpoint, the module also rebuilds the backbone's state per frame
of known codes (teacher forcing), so that offsets can be trained and trees calibrated for CSM.
"""

from pathlib import Path

import torch
from torch import Tensor

from rvqspec.checkpoint import CSM_DEPTH, CSM_TIED_TABLES, official_layout, official_state_dict
from rvqspec.config import config_from_csm, csm_config_dict
from rvqspec.errors import RvqspecError
from rvqspec.integrations.base import Acceleration
from rvqspec.model import MultiCodeDecoder
from rvqspec.tree import Tree


def is_csm(model) -> bool:
    """Whether `model` is a transformers CSM model (its backbone and depth decoder)."""
    return hasattr(model, "depth_decoder") and hasattr(model, "backbone_model")


def depth_decoder_from_transformers(model) -> MultiCodeDecoder:
    """A MultiCodeDecoder with a copy of a CsmForConditionalGeneration's depth decoder, on its device and dtype."""
    config = config_from_csm(model.config.to_dict())
    wanted = {name for _, parts in official_layout(config).values() for name, _ in parts}
    state = model.state_dict()
    tensors = {name: state[name if name in state else CSM_TIED_TABLES[name]] for name in wanted}
    return MultiCodeDecoder.from_official(config, tensors, model.depth_decoder.codebooks_head.weight.device)


def upstream_depth_decoder(model: MultiCodeDecoder) -> torch.nn.Module:
    """transformers' own `CsmDepthDecoderForCausalLM` holding a copy of `model`'s weights, on its device and dtype:
    the reference that benchmarks time ours against."""
    from transformers import CsmDepthDecoderConfig, CsmDepthDecoderForCausalLM

    decoder = CsmDepthDecoderForCausalLM(CsmDepthDecoderConfig(**csm_config_dict(model.config)["depth_decoder_config"]))
    decoder.load_state_dict({key.removeprefix(CSM_DEPTH): value for key, value in official_state_dict(model).items()})
    return decoder.to(model.device, model.dtype).eval().requires_grad_(False)


class CsmAcceleration(Acceleration):
    """A CSM model's `depth_decoder.generate`, routed through `rvqspec.decode_frames`."""

    def __init__(self, model, drafter, tree: Tree | str | None, generator: torch.Generator | None,
                 calibration: str | None = None):
        self.model = model
        super().__init__(model, model.depth_decoder, drafter, tree, generator, calibration)

    def build_decoder(self) -> MultiCodeDecoder:
        return depth_decoder_from_transformers(self.model)

    def followed_weight(self) -> Tensor:
        return self.model.depth_decoder.codebooks_head.weight

    def generate(self, input_ids: Tensor | None = None, backbone_last_hidden_state: Tensor | None = None,
                 do_sample=None, top_k=None, top_p=None, temperature=None, max_new_tokens=None, min_new_tokens=None,
                 **kwargs):
        """Stands in for `depth_decoder.generate` in the per-frame call (sampling settings may be passed, as
        with upstream's generate); any other call goes to upstream."""
        codes = self.decoder.config.num_residual_codes
        settings = {"do_sample": do_sample, "top_k": top_k, "top_p": top_p, "temperature": temperature,
                    "max_new_tokens": max_new_tokens, "min_new_tokens": min_new_tokens}
        length = max_new_tokens or self.target.generation_config.max_new_tokens or codes
        frame_call = (isinstance(input_ids, Tensor) and input_ids.dim() == 2 and input_ids.shape[1] == 2
                      and isinstance(backbone_last_hidden_state, Tensor) and not kwargs and length == codes)
        if frame_call and self.unsupported_settings():
            self.stats.upstream_steps += 1
            frame_call = False
        if not frame_call:
            given = {name: value for name, value in settings.items() if value is not None}
            return self.upstream_generate(input_ids=input_ids, backbone_last_hidden_state=backbone_last_hidden_state,
                                          **given, **kwargs)
        result = self.decode(backbone_last_hidden_state, input_ids[:, 1],
                             self.sampler(do_sample, top_k, top_p, temperature))
        return torch.cat([input_ids, result.codes.to(input_ids.device)], dim=1)


def accelerate(model, drafter=None, tree: Tree | str | None = "auto", generator: torch.Generator | None = None,
               calibration: str | None = None) -> CsmAcceleration:
    """Route the depth decoder of a transformers `CsmForConditionalGeneration` through `rvqspec.decode_frames`
    until `undo()`: AR (31 calls per frame step) without a drafter; with one, the decoding policy's choice per
    batch size (`tree="auto"`) or a fixed `Tree`. As `rvqspec.integrations.qwen_tts.accelerate` otherwise."""
    if not is_csm(model):
        raise RvqspecError(f"{type(model).__name__} is not a transformers CSM model: pass a CsmForConditionalGeneration")
    return CsmAcceleration(model, drafter, tree, generator, calibration)


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
    from rvqspec.corpus import CorpusWriter

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
