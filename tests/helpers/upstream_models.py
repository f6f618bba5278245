"""The tests' side of the upstream qwen-tts models: skipping where qwen-tts is missing, and `save_upstream(model,
folder)`, which writes a model as an official checkpoint folder. The builders (`tiny_upstream_model`,
`upstream_model_like`, ...) live in rvqspec.bench.upstream, shared with benchmarks/, and are re-exported here.
Upstream's `from_pretrained` cannot read back its own `save_pretrained` output (its speaker-encoder config rejects
`model_type`), so compare against the in-memory model that wrote the folder.
"""

import importlib.util
from pathlib import Path

import pytest
import torch

from rvqspec.bench.upstream import (  # noqa: F401 - the builders, for the tests that import them from here
    frame_prompt, tiny_upstream_model, upstream_classes, upstream_config_dict, upstream_generate, upstream_model_like)


def upstream_available() -> bool:
    return all(importlib.util.find_spec(name) is not None for name in ("qwen_tts", "transformers", "librosa"))


def require_upstream() -> None:
    """Skip the calling test when the reference package is not installed (`pip install -e '.[ref]'`
    and `pip install --no-deps qwen-tts==0.1.1`, as `make test` does)."""
    if not upstream_available():
        pytest.skip("qwen-tts reference not installed: run `make install` (installs the `ref` extra and qwen-tts)",
                    allow_module_level=True)


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
