"""The stand-in shipped in rvqspec/standin/assets: it loads like an official checkpoint, its files fit each
other, and the core's speculation is lossless on it (greedy speculative codes == AR codes on the real trained model)."""

import json

import pytest
import torch

from rvqspec.core.drafters import Offsets
from rvqspec.core.model import MultiCodeDecoder
from rvqspec.core.sampling import Sampler
from rvqspec.core.tree import Tree
from rvqspec.standin.codec import MelRVQCodec, griffin_lim
from rvqspec.standin.settings import ASSET_LIMIT_BYTES, ASSETS, BUDGETS, MODEL_DIR, OFFSETS_FILE, TREES_DIR
from rvqspec.standin.synthesis import synthesize_codes
from rvqspec.standin.talker import load_standin

pytestmark = pytest.mark.skipif(not (MODEL_DIR / "model.safetensors").is_file(), reason="no stand-in shipped")


@pytest.fixture(scope="module")
def tts():
    return load_standin(MODEL_DIR)


def test_the_predictor_loads_through_from_pretrained_like_an_official_checkpoint(tts):
    predictor = MultiCodeDecoder.from_pretrained(MODEL_DIR)
    assert predictor.config == tts.predictor.config
    for name, tensor in predictor.state_dict().items():
        torch.testing.assert_close(tensor, tts.predictor.state_dict()[name], rtol=0, atol=0)
    keys = json.loads((MODEL_DIR / "config.json").read_text())
    assert keys["talker_config"]["code_predictor_config"]["num_code_groups"] == 16


def test_shipped_files_fit_the_model_and_the_size_budget(tts):
    codec = MelRVQCodec.load(ASSETS / "codec.safetensors")
    assert tuple(codec.codebooks.shape[:2]) == (16, tts.predictor.config.vocab_size)
    assert Offsets.load(OFFSETS_FILE, tts.predictor).offsets.numel() == 3 * tts.predictor.config.hidden_size
    for n in BUDGETS:
        tree = Tree.load(TREES_DIR / f"tree-N{n}.json")
        assert tree.size == n
        tree.check_fits(3, tts.predictor.config.vocab_size)
    report = json.loads((ASSETS / "report.json").read_text())
    assert 0 < report["quality"]["test"]["mean_top1"] < 1 and report["asset_bytes"] <= ASSET_LIMIT_BYTES
    shipped = sum(f.stat().st_size for f in ASSETS.rglob("*") if f.is_file() and f != ASSETS / "report.json")
    assert shipped == report["asset_bytes"]


def test_greedy_speculative_synthesis_equals_ar_on_the_shipped_model(tts):
    greedy = Sampler(do_sample=False)
    drafter = Offsets.load(OFFSETS_FILE, tts.predictor)
    tree = Tree.load(TREES_DIR / "tree-N16.json")
    ar = synthesize_codes(tts, "Hello there.", "en", greedy, greedy, max_frames=12)
    spec = synthesize_codes(tts, "Hello there.", "en", greedy, greedy, drafter=drafter, tree=tree, max_frames=12)
    assert ar.frames >= 1 and torch.equal(ar.codes, spec.codes)
    assert spec.predictor_calls < ar.predictor_calls  # greedy drafts of a trained model are accepted sometimes
    codec = MelRVQCodec.load(ASSETS / "codec.safetensors")
    wav = griffin_lim(codec.codes_to_mel(spec.codes), codec.cfg.mel, iters=2)
    assert torch.isfinite(wav).all() and wav.abs().max() > 0
