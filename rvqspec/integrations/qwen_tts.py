"""Drop-in acceleration for the upstream `qwen-tts` package (tested against qwen-tts 0.1.1).

    from rvqspec.integrations.qwen_tts import accelerate
    handle = accelerate(tts)  # tts: qwen_tts.Qwen3TTSModel; add drafter=..., tree=... to decode speculatively
    wavs, sr = tts.generate_custom_voice(text=..., speaker=..., language=...)  # the same call as before
    print(handle.stats)       # frames, predictor calls per frame, tokens per step
    handle.undo()

How it hooks in: for every frame, upstream's talker (`Qwen3TTSTalkerForConditionalGeneration.forward`) calls
`talker.code_predictor.generate(inputs_embeds=cat(past_hidden, codec_embedding(c0)), max_new_tokens=15,
do_sample=, top_k=, top_p=, temperature=, ...)` and reads only `.sequences` [B, 15]. `accelerate` replaces
that one method, on that instance, with `rvqspec.decode_frames` (all B rows at once) over a MultiCodeDecoder
that holds a copy of the predictor's weights. Every generate entry point (custom voice, voice design, voice clone) goes through
it and nothing else changes: the codes are drawn from upstream's distribution (greedy: the same codes).

Corpora from recordings (the talker's teacher-forced state) are built in `rvqspec.tuning.qwen_tts_corpus`.
"""

import contextlib
import importlib
import importlib.machinery
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor

from rvqspec.core.checkpoint import official_layout, official_state_dict
from rvqspec.core.config import config_from_upstream
from rvqspec.core.errors import RvqspecError
from rvqspec.core.frame_loop import CHUNK_FRAMES
from rvqspec.core.model import MultiCodeDecoder
from rvqspec.core.talker import Talker, TalkerConfig
from rvqspec.core.tree import Tree
from rvqspec.integrations.base import AccelerateOptions, Acceleration
from rvqspec.integrations.qwen_tts_stream import stream_speech

# Only qwen_tts's 25 Hz tokenizer imports these, when the package is imported: torchaudio has no build that
# loads beside torch 2.13, and sox wraps a system binary. The 12 Hz models never call them.
UNLOADABLE_MODULES = ("torchaudio", "torchaudio.compliance", "torchaudio.compliance.kaldi", "sox")
# Arguments upstream's talker passes that ask for outputs it never reads; any other one goes to upstream.
IGNORED_GENERATE_ARGS = {"output_hidden_states", "return_dict_in_generate"}


def import_qwen_tts() -> types.ModuleType:
    """`import qwen_tts`, with empty stand-ins for the modules above when they cannot be imported."""
    for name in UNLOADABLE_MODULES:
        if name in sys.modules:
            continue
        try:
            importlib.import_module(name)
        except Exception:  # absent, or present but broken against this torch (OSError from its library)
            sys.modules.pop(name, None)
            module = types.ModuleType(name)
            module.__spec__ = importlib.machinery.ModuleSpec(name, None)  # transformers calls find_spec on it
            sys.modules[name] = module
    try:
        with contextlib.redirect_stdout(sys.stderr):  # its 25 Hz tokenizer prints a flash-attn notice on import
            return importlib.import_module("qwen_tts")
    except ImportError as e:
        raise RvqspecError(f"cannot import qwen_tts ({e}): install it with `pip install -e '.[ref]'` and "
                           "`pip install --no-deps qwen-tts==0.1.1`") from None


def find_talker(model) -> torch.nn.Module:
    """The talker of a `Qwen3TTSModel`, of a `Qwen3TTSForConditionalGeneration`, or the talker itself."""
    if hasattr(model, "code_predictor"):
        return model
    if hasattr(model, "talker"):
        return model.talker
    if hasattr(getattr(model, "model", None), "talker"):
        return model.model.talker
    raise RvqspecError(f"{type(model).__name__} is not a qwen-tts model: pass a qwen_tts.Qwen3TTSModel, its .model "
                       "(Qwen3TTSForConditionalGeneration) or its .model.talker")


def predictor_from_upstream(talker) -> MultiCodeDecoder:
    """A MultiCodeDecoder with a copy of the talker's code predictor and c0 table, on their device and dtype."""
    config = config_from_upstream({"talker_config": talker.config.to_dict()})
    wanted = {name for _, parts in official_layout(config).values() for name, _ in parts}
    tensors = {f"talker.{key}": value for key, value in talker.state_dict().items() if f"talker.{key}" in wanted}
    return MultiCodeDecoder.from_official(config, tensors, talker.code_predictor.lm_head[0].weight.device)


def talker_from_upstream(talker) -> Talker:
    """The talker's transformer and c0 head on the core's blocks (`core.talker.Talker`), on its device and dtype.
    Norms, output projections and the head share upstream's tensors; q/k/v and gate/up are concatenated (copies:
    one matmul each, as in the predictor)."""
    c = talker.config
    if getattr(c, "attention_bias", False) or c.hidden_act != "silu" \
            or (c.rope_scaling or {}).get("rope_type", "default") != "default":
        raise RvqspecError("this talker's layers differ from Qwen3-TTS's (attention bias, activation or RoPE type): "
                           "use accelerate(tts) instead of rvqspec.Engine for it")
    config = TalkerConfig(c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads,
                          c.num_key_value_heads, getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
                          c.vocab_size, c.rms_norm_eps, c.rope_theta,
                          c.max_position_embeddings)
    return Talker.from_official(config, talker.state_dict(), "model.", "codec_head.weight")


class QwenTTSAcceleration(Acceleration):
    """A qwen-tts talker's `code_predictor.generate`, routed through `rvqspec.decode_frames`."""

    KIND = "qwen-tts"

    def __init__(self, talker, options: AccelerateOptions, tts=None):
        self.talker, self.tts = talker, tts
        super().__init__(talker, talker.code_predictor, options)

    def stream_custom_voice(self, *args, chunk_frames: int = CHUNK_FRAMES, first_chunk_frames: int | None = None,
                            **kwargs) -> Iterator[tuple]:
        """`tts.generate_custom_voice(...)` as (audio, sample_rate) chunks (rvqspec.integrations.qwen_tts_stream)."""
        return self.stream("custom_voice", args, kwargs, chunk_frames, first_chunk_frames)

    def stream_voice_design(self, *args, chunk_frames: int = CHUNK_FRAMES, first_chunk_frames: int | None = None,
                            **kwargs) -> Iterator[tuple]:
        """`tts.generate_voice_design(...)` as (audio, sample_rate) chunks."""
        return self.stream("voice_design", args, kwargs, chunk_frames, first_chunk_frames)

    def stream_voice_clone(self, *args, chunk_frames: int = CHUNK_FRAMES, first_chunk_frames: int | None = None,
                           **kwargs) -> Iterator[tuple]:
        """`tts.generate_voice_clone(...)` as (audio, sample_rate) chunks."""
        return self.stream("base", args, kwargs, chunk_frames, first_chunk_frames)

    def stream(self, kind: str, args: tuple, kwargs: dict, chunk_frames, first_chunk_frames) -> Iterator[tuple]:
        if self.tts is None:
            raise RvqspecError("streaming needs the whole qwen-tts model: accelerate the Qwen3TTSModel itself "
                               "(accelerate(tts)), not its .model or its talker")
        return stream_speech(self.tts, kind, self.streams, args, kwargs, chunk_frames, first_chunk_frames)

    def build_decoder(self) -> MultiCodeDecoder:
        return predictor_from_upstream(self.talker)

    def followed_weight(self) -> Tensor:
        return self.talker.code_predictor.lm_head[0].weight

    def talker_parts(self) -> tuple[torch.nn.Module, tuple[torch.nn.Module, ...]]:
        return self.talker, (self.talker.code_predictor,)  # its 28 layers, text projection and c0 head

    def watched(self) -> list[Tensor]:
        return super().watched() + [self.talker.get_input_embeddings().weight]  # the c0 table

    def c0_codes(self, c0_embeds: Tensor) -> Tensor | None:
        """Recover each row's c0 from its embedding: upstream passes `codec_embedding(c0)`, not c0. Two codes
        with equal embeddings are interchangeable (c0 reaches the predictor only through its embedding). Row by
        row: comparing a batch at once would hold B x vocab x hidden booleans; the rows whose first element matches
        are the only ones compared whole."""
        table = self.talker.get_input_embeddings().weight
        codes = []
        for row in c0_embeds:
            candidates = (table[:, 0] == row[0]).nonzero()[:, 0]  # one column first: 6 ms -> ~0.1 ms at 3072 x 1024
            match = candidates[(table[candidates] == row).all(-1)]
            if not len(match):
                return None
            codes.append(match[0])
        return torch.stack(codes)

    def generate(self, inputs_embeds: Tensor | None = None, max_new_tokens: int | None = None, do_sample=None,
                 top_k=None, top_p=None, temperature=None, **kwargs):
        """Stands in for `code_predictor.generate` in the per-frame call; any other call goes to upstream."""
        groups = self.talker.code_predictor.config.num_code_groups
        frame_call = (isinstance(inputs_embeds, Tensor) and inputs_embeds.dim() == 3 and inputs_embeds.shape[1] == 2
                      and max_new_tokens == groups - 1 and not set(kwargs) - IGNORED_GENERATE_ARGS)
        c0 = self.c0_codes(inputs_embeds[:, 1]) if frame_call else None
        if c0 is not None and self.unsupported_settings():
            self.stats.upstream_steps += 1
            c0 = None
        if c0 is None:
            return self.upstream_generate(inputs_embeds=inputs_embeds, max_new_tokens=max_new_tokens,
                                          do_sample=do_sample, top_k=top_k, top_p=top_p, temperature=temperature,
                                          **kwargs)
        from transformers.generation.utils import GenerateDecoderOnlyOutput

        result = self.decode(inputs_embeds[:, 0], c0, self.sampler(do_sample, top_k, top_p, temperature))
        sequences = result.codes.to(inputs_embeds.device)
        as_dict = kwargs.get("return_dict_in_generate")
        if as_dict is None:
            as_dict = self.talker.code_predictor.generation_config.return_dict_in_generate
        return GenerateDecoderOnlyOutput(sequences=sequences) if as_dict else sequences


def accelerate(model, drafter=None, tree: Tree | str | None = "auto", generator: torch.Generator | None = None,
               calibration: str | None = None, weights: str | None = None,
               tuned: str | None = None, graphs: bool = True, talker_weights: str | None = None) -> QwenTTSAcceleration:
    """Route the code predictor of a qwen-tts model through `rvqspec.decode_frames` until `undo()`.

    `model`: a `qwen_tts.Qwen3TTSModel`, its `.model`, or its `.model.talker`. Each batched frame step of the
    talker is one `decode_frames` call for all its rows. No drafter: plain AR (15 calls per frame step); with a
    drafter (`rvqspec.Offsets.load(path)`, `rvqspec.ReusedHeads()`, ...): `tree="auto"` lets the decoding
    policy (`rvqspec.core.policy`) pick AR or a tree per batch size, from the call latencies `rvqspec bench --batch`
    measured on this device and the acceptance of `calibration` (an `rvqspec calibrate` folder; default: the
    prior of `default_tree`); a `Tree` decodes every step speculatively with it. Sampling settings come from
    each generate call; draws use `generator`, or torch's global RNG like upstream. Call it after moving or
    fine-tuning the model: it copies the predictor's weights (a later device or dtype change is followed, an
    in-place edit is not). `tuned`: a folder `rvqspec tune` wrote for this model (its drafter, trees and latency
    table, in place of drafter= and calibration=). On CUDA the predictor's calls replay from CUDA graphs
    (`rvqspec.core.graphs`, captured per batch bucket on first use); `graphs=False` runs them eagerly.
    `talker_weights="w8a8"` (or "w8a16"), opt-in and lossy: the talker's own linear layers (not the predictor's,
    which `weights=` sets) become int8 ones (`rvqspec.core.quantize.quantize_linears`, CPU) until `undo()`.
    """
    return accelerate_with(model, AccelerateOptions(drafter, tree, generator, calibration, weights, tuned, graphs,
                                                    talker_weights))


def accelerate_with(model, options: AccelerateOptions) -> QwenTTSAcceleration:
    """`accelerate` with its arguments as one `AccelerateOptions`."""
    tts = model if hasattr(model, "generate_custom_voice") else None
    return QwenTTSAcceleration(find_talker(model), options, tts)


def speech_request(tts, text: str, language: str = "Auto", speaker: str | None = None, instruct: str | None = None,
                   ref_audio=None, ref_text: str | None = None) -> tuple[str, dict]:
    """(entry point, its arguments) for the model's type: custom_voice (`speaker`, optional `instruct`),
    voice_design (`instruct`), or voice_clone (`ref_audio`; ICL with `ref_text`, else x-vector only)."""
    kind = tts.model.tts_model_type
    if kind == "base" and ref_audio is None:
        raise RvqspecError("this is a voice-clone (Base) model: it needs reference audio (--ref-audio), and its "
                           "transcript (--ref-text) for in-context cloning")
    requests = {
        "custom_voice": ("custom_voice", dict(text=text, speaker=speaker, language=language, instruct=instruct)),
        "voice_design": ("voice_design", dict(text=text, instruct=instruct or "", language=language)),
        "base": ("voice_clone", dict(text=text, language=language, ref_audio=ref_audio, ref_text=ref_text,
                                     x_vector_only_mode=ref_text is None))}
    if kind not in requests:
        raise RvqspecError(f"unknown qwen-tts model type {kind!r}: expected one of {', '.join(requests)}")
    return requests[kind]


def generate_speech(tts, text: str, language: str = "Auto", speaker: str | None = None,
                    instruct: str | None = None, ref_audio=None, ref_text: str | None = None,
                    **kwargs) -> tuple[list, int]:
    """(wavs, sample_rate) from the generate entry point of the model's type (`speech_request`). `kwargs`
    (sampling settings, max_new_tokens, non_streaming_mode) go to the entry point."""
    entry_point, arguments = speech_request(tts, text, language, speaker, instruct, ref_audio, ref_text)
    with upstream_refusals():
        return getattr(tts, f"generate_{entry_point}")(**arguments, **kwargs)


@contextlib.contextmanager
def upstream_refusals():
    """Upstream's way of refusing a speaker, language or mode (ValueError, NotImplementedError), as one line."""
    try:
        yield
    except (ValueError, NotImplementedError) as e:
        raise RvqspecError(f"qwen-tts refused the request: {e}") from None


def upstream_code_predictor(model: MultiCodeDecoder) -> torch.nn.Module:
    """Upstream's own code predictor (`Qwen3TTSTalkerCodePredictorModelForConditionalGeneration`) holding a copy
    of `model`'s weights, on its device and dtype: the reference that benchmarks time ours against."""
    from rvqspec.core.config import upstream_config_dict

    import_qwen_tts()
    from qwen_tts.core.models.configuration_qwen3_tts import Qwen3TTSTalkerConfig
    from qwen_tts.core.models.modeling_qwen3_tts import Qwen3TTSTalkerCodePredictorModelForConditionalGeneration

    talker_config = Qwen3TTSTalkerConfig(**upstream_config_dict(model.config)["talker_config"])
    predictor = Qwen3TTSTalkerCodePredictorModelForConditionalGeneration(talker_config.code_predictor_config,
                                                                         talker_config)
    prefix = "talker.code_predictor."
    predictor.load_state_dict({key.removeprefix(prefix): value for key, value in official_state_dict(model).items()
                               if key.startswith(prefix)})
    return predictor.to(model.device, model.dtype).eval().requires_grad_(False)


def load_tts(folder: Path, device: str, dtype: torch.dtype):
    """Upstream's `Qwen3TTSModel` (talker, predictor, 12 Hz speech tokenizer, text processor) from `folder`."""
    from safetensors import SafetensorError

    qwen_tts = import_qwen_tts()
    try:
        return qwen_tts.Qwen3TTSModel.from_pretrained(str(folder), device_map=device, dtype=dtype)
    except (OSError, ValueError, KeyError, SafetensorError) as e:  # a truncated file: SafetensorError
        raise RvqspecError(f"qwen-tts cannot load {folder} ({type(e).__name__}: {e}): pass a complete Qwen3-TTS "
                           "12 Hz checkpoint folder") from None
