"""Upstream qwen-tts model classes built from small random configs (no download), for parity tests.

Importable helper: tests and benchmarks call `tiny_upstream_model(...)` / `upstream_model_like(config)` to get
upstream's own `Qwen3TTSForConditionalGeneration`, and `save_upstream(model, folder)` to write it as an
official checkpoint folder. Upstream's `from_pretrained` cannot read back its own `save_pretrained`
output (its speaker-encoder config rejects `model_type`), so compare against the in-memory model
that wrote the folder.
"""

import importlib.util
from pathlib import Path

import pytest
import torch

from rvqspec.integrations.qwen_tts import import_qwen_tts


def upstream_available() -> bool:
    return all(importlib.util.find_spec(name) is not None for name in ("qwen_tts", "transformers", "librosa"))


def require_upstream() -> None:
    """Skip the calling test when the reference package is not installed (`pip install -e '.[ref]'`
    and `pip install --no-deps qwen-tts==0.1.1`, as `make test` does)."""
    if not upstream_available():
        pytest.skip("qwen-tts reference not installed: run `make install` (installs the `ref` extra and qwen-tts)",
                    allow_module_level=True)


def upstream_classes():
    """(Qwen3TTSConfig, Qwen3TTSForConditionalGeneration) from the installed qwen-tts."""
    models = import_qwen_tts().core.models
    return models.Qwen3TTSConfig, models.Qwen3TTSForConditionalGeneration


def upstream_config_dict(talker_hidden: int, predictor_hidden: int, vocab: int, groups: int,
                         predictor_layers: int = 2, predictor_heads: int = 4, predictor_kv_heads: int = 2,
                         predictor_head_dim: int = 16, predictor_intermediate: int | None = None,
                         talker_vocab: int = 96, rope_theta: float = 1e6) -> dict:
    """A Qwen3TTSConfig dict: a one-layer talker of width `talker_hidden` around a code predictor of the
    given size. The talker only has to exist (its c0 table and hidden size matter to the predictor)."""
    talker_heads = 4
    talker_head_dim = talker_hidden // talker_heads
    half = talker_head_dim // 2  # M-RoPE: mrope_section must sum to head_dim / 2
    mrope_section = [half - 2 * (half // 3), half // 3, half // 3]
    predictor = dict(
        vocab_size=vocab, hidden_size=predictor_hidden, num_hidden_layers=predictor_layers,
        intermediate_size=predictor_intermediate or 3 * predictor_hidden, num_attention_heads=predictor_heads,
        num_key_value_heads=predictor_kv_heads, head_dim=predictor_head_dim, rope_theta=rope_theta,
        num_code_groups=groups, rms_norm_eps=1e-6)
    talker = dict(
        code_predictor_config=predictor, vocab_size=talker_vocab, hidden_size=talker_hidden,
        intermediate_size=2 * talker_hidden, num_hidden_layers=1, num_attention_heads=talker_heads,
        num_key_value_heads=2, num_code_groups=groups, text_hidden_size=32, text_vocab_size=16,
        rope_scaling={"rope_type": "default", "mrope_section": mrope_section, "interleaved": False},
        spk_id={"tiny": 0}, spk_is_dialect={"tiny": False}, codec_language_id={"english": 1})
    return dict(talker_config=talker, tts_model_type="custom_voice", tokenizer_type="qwen3_tts_tokenizer_12hz",
                tts_model_size="tiny")


def tiny_upstream_model(seed: int = 0, talker_hidden: int = 64, predictor_hidden: int = 64, vocab: int = 32,
                        groups: int = 16, head_scale: float = 1.0, **predictor) -> torch.nn.Module:
    """Upstream `Qwen3TTSForConditionalGeneration` with random weights (std 0.02), float32, eval mode.

    `head_scale` multiplies the predictor's lm_heads: with std-0.02 weights the logits of a tiny model are
    nearly flat, which makes sampling tests weak (every warper keeps almost everything) and greedy
    comparisons fragile (near-ties); a larger scale spreads them out.
    """
    config_cls, model_cls = upstream_classes()
    config = config_cls(**upstream_config_dict(talker_hidden, predictor_hidden, vocab, groups, **predictor))
    torch.manual_seed(seed)
    model = model_cls(config).float().eval().requires_grad_(False)
    for head in model.talker.code_predictor.lm_head:
        head.weight.mul_(head_scale)
    return model


def upstream_model_like(config, seed: int = 0) -> torch.nn.Module:
    """Upstream model (random weights, float32, eval) whose code predictor has the sizes of `config`, an
    `rvqspec.PredictorConfig` such as `rvqspec.QWEN3_TTS_0_6B`; the talker around it has one layer."""
    return tiny_upstream_model(
        seed, talker_hidden=config.talker_hidden_size, predictor_hidden=config.hidden_size, vocab=config.vocab_size,
        groups=config.num_code_groups, predictor_layers=config.num_hidden_layers,
        predictor_heads=config.num_attention_heads, predictor_kv_heads=config.num_key_value_heads,
        predictor_head_dim=config.head_dim, predictor_intermediate=config.intermediate_size,
        talker_vocab=config.talker_vocab_size, rope_theta=config.rope_theta)


def save_upstream(model: torch.nn.Module, folder: str | Path, shards: int | None = None) -> Path:
    """Write `model` with upstream's own `save_pretrained` (config.json in the nested layout + safetensors),
    split into about `shards` files with a model.safetensors.index.json when `shards` is given."""
    folder = Path(folder)
    kwargs = {}
    if shards:
        total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        kwargs["max_shard_size"] = total // shards + 1
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    return folder


def frame_prompt(model: torch.nn.Module, talker_hidden: torch.Tensor, c0: torch.Tensor) -> torch.Tensor:
    """The predictor's prefill input [B, 2, talker_hidden] as upstream's talker builds it:
    cat(talker hidden state, talker codec_embedding(c0)). talker_hidden [B, H], c0 [B]."""
    return torch.cat([talker_hidden[:, None], model.talker.get_input_embeddings()(c0[:, None])], dim=1)


def upstream_generate(model: torch.nn.Module, talker_hidden: torch.Tensor, c0: torch.Tensor, sampler) -> torch.Tensor:
    """Codes [B, G-1] from upstream `talker.code_predictor.generate`, called as upstream's talker calls it,
    with an `rvqspec.Sampler`'s settings."""
    predictor = model.talker.code_predictor
    settings = dict(do_sample=True, top_k=sampler.top_k, top_p=sampler.top_p, temperature=sampler.temperature) \
        if sampler.do_sample else dict(do_sample=False)
    return predictor.generate(inputs_embeds=frame_prompt(model, talker_hidden, c0),
                              max_new_tokens=predictor.config.num_code_groups - 1, **settings)
