"""A small predictor with a checkpoint folder of its own, for the tests of bad checkpoints and bad input.

Its fixtures `model` and `folder` reach every test module through conftest.py (`pytest_plugins`)."""

import pytest
import torch

from rvqspec import MultiCodeDecoder, PredictorConfig

# talker_hidden != hidden: the checkpoint also carries the input projection.
CONFIG = PredictorConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, vocab_size=16, num_code_groups=4, talker_hidden_size=24,
                         talker_vocab_size=20)


@pytest.fixture(scope="module")
def model() -> MultiCodeDecoder:
    torch.manual_seed(0)
    return MultiCodeDecoder(CONFIG).eval()


@pytest.fixture
def folder(model, tmp_path):
    model.save_pretrained(tmp_path / "ckpt")
    return tmp_path / "ckpt"


def load(folder):
    return MultiCodeDecoder.from_pretrained(folder)
