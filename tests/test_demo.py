"""`rvqspec demo` end to end on a tiny random stand-in written to a temporary assets folder."""

import json

import pytest
import soundfile
import torch

from rvqspec import demo
from rvqspec.cli import main
from rvqspec.drafters import Offsets
from rvqspec.standin import codec
from rvqspec.standin.talker import save_standin
from rvqspec.tree import default_tree
from tests.test_standin_model import tiny_codec, tiny_standin


@pytest.fixture(autouse=True)
def isolated(monkeypatch, tmp_path):
    """Decode with the Griffin-Lim fallback (what a machine without the vocoder extra uses: fast and light),
    and read the bench's device file from an empty cache unless a test writes one."""
    monkeypatch.setattr(codec, "hifigan", lambda: None)
    monkeypatch.setenv("RVQSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(demo, "COMMITTED_BENCH", tmp_path / "no-bench.json")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    folder = tmp_path_factory.mktemp("assets")
    tts = tiny_standin(seed=5)
    save_standin(tts, folder / "model", torch.float16)
    tiny_codec(tts.config.num_codes).save(folder / "codec.safetensors")
    Offsets.for_model(tts.predictor).save(folder / "offsets.safetensors")
    for size in (4, 16):
        default_tree(size).save(folder / "trees" / f"tree-N{size}.json")
    return folder


def test_demo_json_on_a_tiny_stand_in(assets, tmp_path, capsys):
    out = tmp_path / "wavs"
    assert main(["demo", "Hi.", "--lang", "en", "--assets", str(assets), "--out", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    for name in ("ar", "speculative"):
        wav, rate = soundfile.read(report["wav"][name])
        assert rate == 16000 and len(wav) == report["frames"][name] * 1280 and report["frames"][name] >= 1
    assert report["ar_calls_per_frame"] == 15 and report["ar_tokens_per_step"] == 1
    assert 1 <= report["calls_per_frame"] <= 15
    assert report["tokens_per_step"] == pytest.approx(15 / report["calls_per_frame"])
    assert report["speedup"] > 0 and 0 < report["mean_top1"] <= 1 and report["tree_nodes"] == 16
    assert report["vocoder"] == "griffin-lim" and report["real_0_6b_at_paper_acceptance"] is None


def test_demo_uses_the_benchmarked_tree_size_and_reports_the_real_model(assets, tmp_path, capsys):
    real = {"model": "0.6b (random weights, acceptance controlled)", "dtype": "bfloat16", "threads": 2,
            "tree_size": 32, "target_tokens_per_step": 2.47, "tokens_per_step": 2.46, "calls_per_frame": 6.1,
            "speedup": 1.91, "predicted_speedup": 2.0}
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "device.json").write_text(json.dumps(
        {"format": "rvqspec-device/1", "tree_size": 4, "paper_acceptance": real}))
    assert main(["demo", "Hi.", "--assets", str(assets), "--out", str(tmp_path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tree_nodes"] == 4 and report["real_0_6b_at_paper_acceptance"] == real
    assert main(["demo", "Hi.", "--assets", str(assets), "--out", str(tmp_path)]) == 0
    assert "NOT THE STAND-IN" in capsys.readouterr().out


def test_demo_quotes_the_committed_bench_run_until_this_device_is_benchmarked(assets, tmp_path, capsys,
                                                                            monkeypatch):
    real = {"dtype": "bfloat16", "threads": 2, "tree_size": 32, "tokens_per_step": 2.49, "calls_per_frame": 6.0,
            "speedup": 1.77}
    committed = tmp_path / "bench.json"
    committed.write_text(json.dumps({"paper_acceptance": real, "machine": {"cpu": "Some CPU", "cores": 2,
                                                                           "date": "2026-11-30"}}))
    monkeypatch.setattr(demo, "COMMITTED_BENCH", committed)
    assert main(["demo", "Hi.", "--assets", str(assets), "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "on the development machine (Some CPU, 2 cores, 2026-11-30" in printed and "speed-up 1.77x" in printed
    assert "not this one: run `rvqspec bench`" in printed


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


def test_engine_demo_when_no_stand_in_is_shipped():
    from rvqspec.demo import run_engine_demo

    report = run_engine_demo(frames=2, nodes=4)
    assert report["stand_in_shipped"] is False and report["ar_calls_per_frame"] == 15
    assert 1 <= report["calls_per_frame"] <= 15 and report["tokens_per_step"] == 30 / (2 * report["calls_per_frame"])
