"""The stand-in's paths, sizes and build settings: where its assets ship and its work files go.

A leaf of the stand-in package: the build, the evaluation and the diagnosis read it, and it reads none of them.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rvqspec.core.errors import RvqspecError
from rvqspec.standin.talker import TalkerConfig

ASSETS = Path(__file__).parent / "assets"
MODEL_DIR = ASSETS / "model"
OFFSETS_FILE = ASSETS / "offsets.safetensors"
TREES_DIR = ASSETS / "trees"
BUDGETS = [4, 8, 16, 32, 64]  # the tree sizes N the shipped stand-in's trees were grown for (its assets)
SPLITS = ("train", "validation", "test")
SHIPPED_DTYPE = torch.float16
ASSET_LIMIT_BYTES = 20 * 10**6

TALKER = TalkerConfig(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64)
PREDICTOR_SIZES = dict(hidden_size=192, intermediate_size=576, num_hidden_layers=3, num_attention_heads=3,
                       num_key_value_heads=1, head_dim=64)


@dataclass
class Settings:
    work: Path = Path("data/standin")
    assets: Path = ASSETS
    talker: TalkerConfig = TALKER
    predictor_sizes: dict = field(default_factory=lambda: dict(PREDICTOR_SIZES))
    hours: float = 3.4
    joint_steps: int = 1600
    joint_minutes: float = 32.0
    predictor_fraction: float = 0.25
    predictor_steps: int = 1500
    predictor_batch_frames: int = 256
    predictor_minutes: float = 22.0
    offsets_epochs: int = 2
    quality_limit: int | None = 25  # test sentences per language for WER (None: all)
    seed: int = 0

    @property
    def manifest(self) -> Path:
        return self.work / "corpus" / "manifest.jsonl"

    @property
    def codes_dir(self) -> Path:
        return self.work / "codes"

    @property
    def joint_dir(self) -> Path:
        return self.work / "joint"

    def code_corpus(self, split: str) -> Path:
        return self.work / "code-corpus" / split

    @property
    def codec_file(self) -> Path:
        return self.assets / "codec.safetensors"

    @property
    def codec_report_file(self) -> Path:
        return self.work / "codec_report.json"

    @property
    def model_dir(self) -> Path:
        return self.assets / "model"

    @property
    def offsets_file(self) -> Path:
        return self.assets / "offsets.safetensors"

    @property
    def trees_dir(self) -> Path:
        return self.assets / "trees"

    @property
    def report_file(self) -> Path:
        return self.assets / "report.json"


def load_utterances(s: Settings, split: str):
    from safetensors.torch import load_file

    from rvqspec.standin.training import Utterance

    if not (s.codes_dir / "utterances.json").is_file():
        raise RvqspecError(f"no encoded corpus in {s.codes_dir}: run `rvqspec standin build --from encode`")
    rows = json.loads((s.codes_dir / "utterances.json").read_text())
    data = load_file(s.codes_dir / "codes.safetensors")
    offsets = data["offsets"].tolist()
    return [Utterance(r["id"], r["lang"], r["text"], data["codes"][offsets[i]:offsets[i + 1]].long())
            for i, r in enumerate(rows) if r["split"] == split]
