"""Configuration of the code predictor (upstream: `talker.code_predictor`), the MultiCodeDecoder."""

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from rvqspec.errors import RvqspecError


@dataclass(frozen=True)
class PredictorConfig:
    """Field names follow upstream `Qwen3TTSTalkerCodePredictorConfig`, plus the talker sizes we need."""

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

    def __post_init__(self) -> None:
        if self.hidden_act != "silu" or self.attention_bias:
            raise RvqspecError(
                f"unsupported code predictor: hidden_act={self.hidden_act!r}, attention_bias={self.attention_bias}; "
                "rvqspec implements the Qwen3 layer (silu, no biases)"
            )
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

    def to_dict(self) -> dict:
        return asdict(self)


QWEN3_TTS_0_6B = PredictorConfig()
QWEN3_TTS_1_7B = PredictorConfig(talker_hidden_size=2048)


def config_from_upstream(upstream: dict) -> PredictorConfig:
    """Build from an upstream `config.json` dict (Qwen3TTSConfig: talker_config.code_predictor_config)."""
    talker = upstream.get("talker_config") if isinstance(upstream, dict) else None
    if not isinstance(talker, dict) or not isinstance(talker.get("code_predictor_config"), dict):
        raise RvqspecError(
            "config.json has no talker_config.code_predictor_config: this is not a Qwen3-TTS checkpoint "
            "(expected the upstream nested layout, as written by qwen-tts or `rvqspec standin build`)"
        )
    predictor = talker["code_predictor_config"]
    if predictor.get("use_sliding_window") or (predictor.get("rope_scaling") or {}).get("rope_type", "default") != "default":
        raise RvqspecError("unsupported code predictor: sliding-window attention or scaled RoPE")
    known = {f.name for f in fields(PredictorConfig)}
    values = {k: v for k, v in predictor.items() if k in known and v is not None}
    values["talker_hidden_size"] = talker.get("hidden_size", values.get("hidden_size", 1024))
    values["talker_vocab_size"] = talker.get("vocab_size", 3072)
    check_types(values)
    return PredictorConfig(**values)


def check_types(values: dict) -> None:
    """JSON values of the wrong type would fail later with an obscure error: name the field instead."""
    for f in fields(PredictorConfig):
        if f.name not in values:
            continue
        value, want = values[f.name], type(f.default)
        numeric = (int, float) if want is float else want  # JSON writes 1000000.0 as 1000000
        if not isinstance(value, numeric) or (isinstance(value, bool) and want is not bool):
            raise RvqspecError(f"config.json: {f.name} must be {want.__name__}, got {value!r}: fix or re-download "
                               "config.json")


def load_config(folder: str | Path) -> PredictorConfig:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise RvqspecError(f"no config.json in {folder}: pass the checkpoint folder that holds config.json and *.safetensors")
    try:
        upstream = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise RvqspecError(f"{path} is not valid JSON ({e}): re-download or rebuild the checkpoint") from None
    return config_from_upstream(upstream)


def upstream_config_dict(config: PredictorConfig, talker: dict | None = None) -> dict:
    """The nested upstream layout for `config`, merged into `talker` (extra talker fields) if given."""
    predictor = {k: v for k, v in config.to_dict().items() if not k.startswith("talker_")}
    predictor["rope_scaling"] = None
    talker = dict(talker or {})
    talker.update(hidden_size=config.talker_hidden_size, vocab_size=config.talker_vocab_size,
                  num_code_groups=config.num_code_groups, code_predictor_config=predictor)
    return {"talker_config": talker}
