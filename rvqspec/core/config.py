"""Configuration of a depth decoder, the MultiCodeDecoder: Qwen3-TTS's code predictor (upstream
`talker.code_predictor`) or Sesame CSM's depth decoder (transformers `CsmDepthDecoderForCausalLM`), and the map
from each one's config.json onto it. `layout` names the checkpoint layout the weights come in.
"""

import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from rvqspec.core.errors import RvqspecError
from rvqspec.core.files import read_json

FRAME_RATE = 12.5  # code frames a second (80 ms): Qwen3-TTS, CSM (Mimi) and the stand-in alike
LAYOUTS = ("qwen3_tts", "csm")
ROPE_TYPES = ("default", "llama3")
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# Physical caps, far above any depth decoder (Qwen3-TTS 1.7B: 5 layers, width 2048; CSM-1B: 32 codebooks of 2051):
# a config past them is damaged, and building it would allocate until memory runs out.
CAPS = {"hidden_size": 1 << 15, "intermediate_size": 1 << 17, "num_hidden_layers": 256, "num_attention_heads": 1024,
        "num_key_value_heads": 1024, "head_dim": 1024, "vocab_size": 1 << 18, "num_code_groups": 256,
        "max_position_embeddings": 1 << 24, "talker_hidden_size": 1 << 15, "talker_vocab_size": 1 << 20}


@dataclass(frozen=True)
class PredictorConfig:
    """Field names follow upstream `Qwen3TTSTalkerCodePredictorConfig`, plus the talker sizes we need and the
    few things in which CSM's Llama layers differ. "Talker" means the model that emits c0 and conditions the
    predictor (CSM: the backbone)."""

    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_hidden_layers: int = 5
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    head_dim: int = 128
    vocab_size: int = 2048
    num_code_groups: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    max_position_embeddings: int = 32768
    hidden_act: str = "silu"
    attention_bias: bool = False
    talker_hidden_size: int = 1024  # width of the talker hidden state and of every code embedding
    talker_vocab_size: int = 3072  # rows of the talker's c0 table (codes + special tokens)
    qk_norm: bool = True  # RMSNorm on every head's q and k (Qwen3); Llama layers (CSM) have none
    rope_scaling: dict | None = None  # None (plain RoPE) or transformers' {"rope_type": "llama3", ...}
    always_project: bool = False  # project the inputs even when widths agree (CSM's inputs_embeds_projector)
    projection_bias: bool = True  # the input projection has a bias (Qwen3-TTS's small_to_mtp_projection)
    layout: str = "qwen3_tts"  # the checkpoint layout: "qwen3_tts" or "csm"

    def __post_init__(self) -> None:
        for name, cap in CAPS.items():
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= cap):
                raise RvqspecError(f"config field {name}={value!r} is out of range: it must be an integer in [1, {cap}] "
                                   "(a depth decoder is far smaller; the config is damaged)")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                    and (value > 0 if name == "rope_theta" else value >= 0)):
                raise RvqspecError(f"config field {name}={value!r} is not physical: it must be a finite number "
                                   f"{'> 0' if name == 'rope_theta' else '>= 0'}")
        if self.hidden_act != "silu" or self.attention_bias:
            raise RvqspecError(
                f"unsupported depth decoder: hidden_act={self.hidden_act!r}, attention_bias={self.attention_bias}; "
                "rvqspec implements Qwen3 and Llama layers (silu, no biases)"
            )
        if self.layout not in LAYOUTS:
            raise RvqspecError(f"unknown checkpoint layout {self.layout!r}: use one of {', '.join(LAYOUTS)}")
        if self.rope_type not in ROPE_TYPES:
            raise RvqspecError(f"unsupported RoPE scaling {self.rope_type!r}: rvqspec implements {', '.join(ROPE_TYPES)}")
        missing = [key for key in LLAMA3_ROPE_KEYS if key not in self.rope_scaling] if self.rope_type == "llama3" else []
        if missing:
            raise RvqspecError(f"rope_scaling of type llama3 lacks {', '.join(missing)}: fix or re-download config.json")
        if self.num_attention_heads % self.num_key_value_heads:
            raise RvqspecError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.num_code_groups < 2:
            raise RvqspecError(f"num_code_groups must be >= 2, got {self.num_code_groups}")

    @property
    def num_residual_codes(self) -> int:
        """Codes the predictor emits per frame: c1..c_{G-1} (15 for Qwen3-TTS)."""
        return self.num_code_groups - 1

    @property
    def rope_type(self) -> str:
        scaling = self.rope_scaling or {}
        return scaling.get("rope_type", scaling.get("type", "default"))  # "type": transformers' older name

    @property
    def projects(self) -> bool:
        """Whether the predictor's inputs go through a projection (else they are already of its width)."""
        return self.always_project or self.talker_hidden_size != self.hidden_size

    def to_dict(self) -> dict:
        return asdict(self)


QWEN3_TTS_0_6B = PredictorConfig()
QWEN3_TTS_1_7B = PredictorConfig(talker_hidden_size=2048)
# sesame/csm-1b's depth decoder: 4 Llama layers of width 1024 behind a 2048-wide backbone, 32 codebooks of 2048
# codes + 3 special ones.
CSM_1B = PredictorConfig(
    hidden_size=1024, intermediate_size=8192, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
    head_dim=128, vocab_size=2051, num_code_groups=32, rms_norm_eps=1e-5, rope_theta=500000.0,
    max_position_embeddings=33, talker_hidden_size=2048, talker_vocab_size=2051, qk_norm=False,
    rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 16},
    always_project=True, projection_bias=False, layout="csm")
# The real architectures benchmarks run (random weights, acceptance controlled): `rvqspec bench --archs`.
ARCHITECTURES = {"0.6b": QWEN3_TTS_0_6B, "1.7b": QWEN3_TTS_1_7B, "csm-1b": CSM_1B}


def layer_shapes(c: PredictorConfig, layers: int | None = None) -> list[tuple[int, int]]:
    """(out, in) of every layer matrix of a predictor of config `c` (or of its first `layers` layers), in a step's
    order: qkv, o, gate+up, down per layer."""
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    layer = [(q + 2 * kv, c.hidden_size), (c.hidden_size, q), (2 * c.intermediate_size, c.hidden_size),
             (c.hidden_size, c.intermediate_size)]
    return layer * (c.num_hidden_layers if layers is None else layers)


def config_from_json(upstream: dict) -> PredictorConfig:
    """The depth decoder of a checkpoint's config.json: Qwen3-TTS (talker_config.code_predictor_config) or CSM
    (model_type "csm", depth_decoder_config); anything else is refused."""
    if isinstance(upstream, dict) and "talker_config" in upstream:
        return config_from_upstream(upstream)
    if isinstance(upstream, dict) and (upstream.get("model_type") == "csm" or "depth_decoder_config" in upstream):
        return config_from_csm(upstream)
    kind = upstream.get("model_type") if isinstance(upstream, dict) else None
    raise RvqspecError(
        f"config.json describes {'a ' + repr(kind) + ' model' if kind else 'no known model'}, not a checkpoint rvqspec "
        "can load: expected Qwen3-TTS (talker_config.code_predictor_config, as written by qwen-tts or `rvqspec standin "
        "build`) or Sesame CSM (model_type 'csm' with a depth_decoder_config, as saved by transformers)")


def config_from_upstream(upstream: dict) -> PredictorConfig:
    """Build from an upstream `config.json` dict (Qwen3TTSConfig: talker_config.code_predictor_config)."""
    talker = upstream.get("talker_config") if isinstance(upstream, dict) else None
    if not isinstance(talker, dict) or not isinstance(talker.get("code_predictor_config"), dict):
        raise RvqspecError(
            "config.json has no talker_config.code_predictor_config: this is not a Qwen3-TTS checkpoint "
            "(expected the upstream nested layout, as written by qwen-tts or `rvqspec standin build`)"
        )
    predictor = talker["code_predictor_config"]
    scaling = predictor.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, dict):
        raise RvqspecError(f"config.json: rope_scaling must be null or an object, got {scaling!r}")
    if predictor.get("use_sliding_window") or (scaling or {}).get("rope_type", "default") != "default":
        raise RvqspecError("unsupported code predictor: sliding-window attention or scaled RoPE")
    values = known_values(predictor, exclude=CSM_ONLY)
    values["talker_hidden_size"] = talker.get("hidden_size", values.get("hidden_size", 1024))
    values["talker_vocab_size"] = talker.get("vocab_size", 3072)
    check_types(values)
    return PredictorConfig(**values)


CSM_ONLY = ("qk_norm", "rope_scaling", "always_project", "projection_bias", "layout")


def known_values(source: dict, exclude: tuple[str, ...] = ()) -> dict:
    known = {f.name for f in fields(PredictorConfig)} - {"talker_hidden_size", "talker_vocab_size", *exclude}
    return {k: v for k, v in source.items() if k in known and v is not None}


def config_from_csm(upstream: dict) -> PredictorConfig:
    """Build from a transformers `CsmConfig` dict: its depth_decoder_config, with the shared embedding table
    (num_codebooks x vocab rows of the backbone's width; table 0 holds c0) and the llama3 RoPE it names."""
    depth = upstream.get("depth_decoder_config")
    if not isinstance(depth, dict):
        raise RvqspecError("config.json has model_type 'csm' but no depth_decoder_config: re-download the checkpoint")
    if depth.get("mlp_bias"):
        raise RvqspecError("unsupported CSM depth decoder: mlp_bias=True (rvqspec implements bias-free MLPs)")
    values = known_values(depth, exclude=("qk_norm", "always_project", "projection_bias", "layout"))
    heads, width = depth.get("num_attention_heads", 8), depth.get("hidden_size", 1024)
    if "head_dim" not in values and not (isinstance(heads, int) and isinstance(width, int) and heads >= 1):
        raise RvqspecError(f"config.json: depth_decoder_config needs integer hidden_size and num_attention_heads >= 1, "
                           f"got {width!r} and {heads!r}")
    values.setdefault("head_dim", width // heads)
    values["num_code_groups"] = depth.get("num_codebooks", upstream.get("num_codebooks", 32))
    values["talker_hidden_size"] = depth.get("backbone_hidden_size", 2048)
    values["talker_vocab_size"] = values.get("vocab_size", 2051)
    check_types(values)
    return PredictorConfig(**values, qk_norm=False, always_project=True, projection_bias=False, layout="csm")


def check_types(values: dict) -> None:
    """JSON values of the wrong type would fail later with an obscure error: name the field instead."""
    for f in fields(PredictorConfig):
        if f.name not in values:
            continue
        value, want = values[f.name], type(f.default) if f.default is not None else dict
        numeric = (int, float) if want is float else want  # JSON writes 1000000.0 as 1000000
        if not isinstance(value, numeric) or (isinstance(value, bool) and want is not bool):
            raise RvqspecError(f"config.json: {f.name} must be {want.__name__}, got {value!r}: fix or re-download "
                               "config.json")


def load_config(folder: str | Path) -> PredictorConfig:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise RvqspecError(f"no config.json in {folder}: pass the checkpoint folder that holds config.json and *.safetensors")
    return config_from_json(read_json(path, "re-download or rebuild the checkpoint"))


def upstream_config_dict(config: PredictorConfig, talker: dict | None = None) -> dict:
    """The config.json of `config`'s layout. Qwen3-TTS: the nested upstream layout, merged into `talker`
    (extra talker fields) if given; CSM: a transformers CsmConfig dict (its depth_decoder_config, and the
    backbone fields that tell the depth decoder's shape, merged into `talker`)."""
    if config.layout == "csm":
        return csm_config_dict(config, talker)
    predictor = {k: v for k, v in config.to_dict().items() if not k.startswith("talker_") and k not in CSM_ONLY}
    predictor["rope_scaling"] = None
    talker = dict(talker or {})
    talker.update(hidden_size=config.talker_hidden_size, vocab_size=config.talker_vocab_size,
                  num_code_groups=config.num_code_groups, code_predictor_config=predictor)
    return {"talker_config": talker}


def csm_config_dict(config: PredictorConfig, backbone: dict | None = None) -> dict:
    depth = {k: v for k, v in config.to_dict().items()
             if not k.startswith("talker_") and k not in CSM_ONLY + ("num_code_groups",)}
    depth.update(model_type="csm_depth_decoder_model", num_codebooks=config.num_code_groups,
                 backbone_hidden_size=config.talker_hidden_size, rope_scaling=config.rope_scaling, mlp_bias=False)
    out = dict(backbone or {})
    out.update(model_type="csm", num_codebooks=config.num_code_groups, vocab_size=config.vocab_size,
               depth_decoder_config=depth)
    out.setdefault("hidden_size", config.talker_hidden_size)
    return out
