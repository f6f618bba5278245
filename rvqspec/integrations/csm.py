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

Corpora from recordings (the backbone's teacher-forced state) are built in `rvqspec.tuning.csm_corpus`.
"""

from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor

from rvqspec.core.checkpoint import CSM_DEPTH, CSM_TIED_TABLES, official_layout, official_state_dict
from rvqspec.core.config import config_from_csm, csm_config_dict
from rvqspec.core.errors import RvqspecError
from rvqspec.core.frame_loop import CHUNK_FRAMES
from rvqspec.core.model import MultiCodeDecoder
from rvqspec.core.talker import Talker, TalkerConfig
from rvqspec.core.tree import Tree
from rvqspec.integrations.base import AccelerateOptions, Acceleration
from rvqspec.integrations.csm_stream import stream_audio


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


def talker_from_csm(model) -> Talker:
    """The backbone (Llama layers, llama3-scaled RoPE) and its c0 head (`lm_head`) of a CsmForConditionalGeneration
    on the core's blocks (`core.talker.Talker`, qk_norm=False), on its device and dtype. Norms, output projections
    and the head share upstream's tensors; q/k/v and gate/up are concatenated (copies: one matmul each)."""
    c = model.config
    if getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False) or c.hidden_act != "silu":
        raise RvqspecError("this CSM backbone's layers differ from Llama's (biases or activation): use "
                           "rvqspec.accelerate(model) instead of rvqspec.Engine for it")
    scaling = c.rope_scaling if (c.rope_scaling or {}).get("rope_type", "default") != "default" else None
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) != "llama3":
        raise RvqspecError(f"rvqspec.Engine's talker implements plain and llama3 RoPE, not {scaling!r}: use "
                           "rvqspec.accelerate(model) for this CSM model")
    config = TalkerConfig(c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads,
                          c.num_key_value_heads, getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
                          c.vocab_size, c.rms_norm_eps, c.rope_theta, c.max_position_embeddings, qk_norm=False,
                          rope_scaling=scaling)
    return Talker.from_official(config, model.state_dict(), "backbone_model.", "lm_head.weight")


def upstream_depth_decoder(model: MultiCodeDecoder) -> torch.nn.Module:
    """transformers' own `CsmDepthDecoderForCausalLM` holding a copy of `model`'s weights, on its device and dtype:
    the reference that benchmarks time ours against."""
    from transformers import CsmDepthDecoderConfig, CsmDepthDecoderForCausalLM

    decoder = CsmDepthDecoderForCausalLM(CsmDepthDecoderConfig(**csm_config_dict(model.config)["depth_decoder_config"]))
    decoder.load_state_dict({key.removeprefix(CSM_DEPTH): value for key, value in official_state_dict(model).items()})
    return decoder.to(model.device, model.dtype).eval().requires_grad_(False)


class CsmAcceleration(Acceleration):
    """A CSM model's `depth_decoder.generate`, routed through `rvqspec.decode_frames`."""

    KIND = "csm"

    def __init__(self, model, options: AccelerateOptions):
        self.model = model
        super().__init__(model, model.depth_decoder, options)

    def stream(self, chunk_frames: int = CHUNK_FRAMES, first_chunk_frames: int | None = None,
               **generate_kwargs) -> Iterator[tuple]:
        """`model.generate(**generate_kwargs)` as (audio, sample_rate) chunks (rvqspec.integrations.csm_stream)."""
        return stream_audio(self.model, self.streams, generate_kwargs, chunk_frames, first_chunk_frames)

    def build_decoder(self) -> MultiCodeDecoder:
        return depth_decoder_from_transformers(self.model)

    def followed_weight(self) -> Tensor:
        return self.model.depth_decoder.codebooks_head.weight

    def talker_parts(self) -> tuple[torch.nn.Module, tuple[torch.nn.Module, ...]]:
        kept = (self.model.depth_decoder, getattr(self.model, "codec_model", None))
        return self.model, tuple(m for m in kept if m is not None)  # the backbone and its c0 head

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
               calibration: str | None = None, weights: str | None = None,
               tuned: str | None = None, graphs: bool = True, talker_weights: str | None = None) -> CsmAcceleration:
    """Route the depth decoder of a transformers `CsmForConditionalGeneration` through `rvqspec.decode_frames`
    until `undo()`: AR (31 calls per frame step) without a drafter; with one, the decoding policy's choice per
    batch size (`tree="auto"`) or a fixed `Tree`. As `rvqspec.integrations.qwen_tts.accelerate` otherwise
    (`talker_weights=` quantizes the backbone and its c0 head)."""
    return accelerate_with(model, AccelerateOptions(drafter, tree, generator, calibration, weights, tuned, graphs,
                                                    talker_weights))


def accelerate_with(model, options: AccelerateOptions) -> CsmAcceleration:
    """`accelerate` with its arguments as one `AccelerateOptions`."""
    if not is_csm(model):
        raise RvqspecError(f"{type(model).__name__} is not a transformers CSM model: pass a CsmForConditionalGeneration")
    return CsmAcceleration(model, options)


def load_model(folder: Path, device: str, dtype: torch.dtype):
    """transformers' `CsmForConditionalGeneration` (eval) and its processor from a checkpoint folder."""
    try:
        from transformers import AutoProcessor, CsmForConditionalGeneration

        model = CsmForConditionalGeneration.from_pretrained(str(folder), device_map=device, dtype=dtype).eval()
        return model, AutoProcessor.from_pretrained(str(folder))
    except (OSError, ValueError, KeyError, ImportError) as e:
        raise RvqspecError(f"transformers cannot load the CSM model and processor in {folder} ({type(e).__name__}: "
                           f"{e}): pass a complete CSM checkpoint folder (e.g. sesame/csm-1b)") from None
