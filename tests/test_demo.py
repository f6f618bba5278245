"""`rvqspec demo` end to end on a tiny random stand-in written to a temporary assets folder."""

import json

import pytest
import soundfile
import torch

from rvqspec.cli import main
from rvqspec.standin import codec
from rvqspec.drafters import Offsets
from rvqspec.standin.codec import CodecConfig, MelRVQCodec
from rvqspec.standin.talker import save_standin
from rvqspec.tree import default_tree
from tests.test_standin_model import tiny_standin


def tiny_codec(codes: int, seed: int = 0) -> MelRVQCodec:
    """A random 16-level codec over an 8-dim latent, `codes` entries per level (the talker's num_codes)."""
    generator = torch.Generator().manual_seed(seed)
    cfg = CodecConfig(codebook_size=codes, dim=8)
    features = cfg.mels_per_frame * cfg.mel.n_mels
    proj = torch.linalg.qr(torch.randn(features, cfg.dim, generator=generator)).Q
    codebooks = torch.randn(cfg.num_codebooks, codes, cfg.dim, generator=generator)
    return MelRVQCodec(cfg, torch.full((features,), -4.0), proj, codebooks)


@pytest.fixture(autouse=True)
def griffin_lim(monkeypatch):
    """Decode with the Griffin-Lim fallback (what a machine without the vocoder extra uses): fast and light."""
    monkeypatch.setattr(codec, "hifigan", lambda: None)
    torch.set_num_threads(1)  # tiny models: threads only add synchronisation


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    folder = tmp_path_factory.mktemp("assets")
    tts = tiny_standin(seed=5)
    save_standin(tts, folder / "model", torch.float16)
    tiny_codec(tts.config.num_codes).save(folder / "codec.safetensors")
    Offsets.for_model(tts.predictor).save(folder / "offsets.safetensors")
    default_tree(4).save(folder / "trees" / "tree-N4.json")
    return folder


def test_demo_json_on_a_tiny_stand_in(assets, tmp_path, capsys):
    out = tmp_path / "wavs"
    assert main(["demo", "Hi.", "--lang", "en", "--assets", str(assets), "--out", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    for name in ("ar", "speculative"):
        wav, rate = soundfile.read(report["wav"][name])
        assert rate == 16000 and len(wav) == report["frames"][name] * 1280 and report["frames"][name] >= 1
    assert report["ar_calls_per_frame"] == 15 and report["ar_tokens_per_step"] == 1
    assert 1 <= report["calls_per_frame"] <= 15 and report["tokens_per_step"] == pytest.approx(15 / report["calls_per_frame"])
    assert report["speedup"] > 0 and 0 < report["mean_top1"] <= 1 and report["tree_nodes"] == 4
    assert report["vocoder"] == "griffin-lim"


def test_demo_text_report(assets, tmp_path, capsys):
    assert main(["demo", "Hallo.", "--lang", "de", "--assets", str(assets), "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "tokens per step" in text and "inner-loop time ratio" in text and (tmp_path / "standin_ar.wav").is_file()


def test_demo_without_a_built_model_says_how_to_build_it(tmp_path, capsys):
    assert main(["demo", "--assets", str(tmp_path / "nothing"), "--json"]) == 2
    assert "rvqspec standin build" in capsys.readouterr().err


def test_demo_rejects_an_unknown_language(assets, tmp_path, capsys):
    assert main(["demo", "--lang", "xx", "--assets", str(assets), "--out", str(tmp_path)]) == 2
    assert "language" in capsys.readouterr().err
