"""`rvqspec demo` end to end on a tiny random stand-in written to a temporary assets folder."""

import json

import pytest
import soundfile
import torch

from rvqspec.cli import demo
from rvqspec.cli.main import main
from rvqspec.core.drafters import Offsets
from rvqspec.core.tree import PRIOR_ACCEPTANCE, default_tree
from rvqspec.standin import codec
from rvqspec.standin.talker import save_standin

from helpers.standin import tiny_codec, tiny_standin
from helpers.tiny import tiny_config


@pytest.fixture(autouse=True)
def isolated(monkeypatch, tmp_path):
    """Decode with the Griffin-Lim fallback (what a machine without the vocoder extra uses: fast and light),
    read the bench's device file from an empty cache, and run the live real-architecture comparison on a tiny
    architecture of the same structure."""
    monkeypatch.setattr(codec, "hifigan", lambda: None)
    monkeypatch.setenv("RVQSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(demo, "REAL_ARCH", tiny_config(vocab=64, hidden=32))
    monkeypatch.setattr(demo, "REAL_FRAMES", 2)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    folder = tmp_path_factory.mktemp("assets")
    tts = tiny_standin(seed=5)
    save_standin(tts, folder / "model", torch.float16)
    tiny_codec(tts.config.num_codes).save(folder / "codec.safetensors")
    Offsets.for_model(tts.predictor).save(folder / "offsets.safetensors")
    for size in (4, 16):
        default_tree(size).save(folder / "trees" / f"tree-N{size}.json")
    acceptance = PRIOR_ACCEPTANCE[None].expand(tts.predictor.config.num_code_groups - 2, -1, -1).tolist()
    (folder / "trees" / "report.json").write_text(json.dumps({
        "acceptance_per_position": acceptance,
        "trees": [{"budget": size, "file": f"tree-N{size}.json"} for size in (4, 16)]}))
    return folder


def test_demo_json_on_a_tiny_stand_in(assets, tmp_path, capsys, monkeypatch):
    out, prepared, prepare = tmp_path / "wavs", [], demo.device_path.prepare
    monkeypatch.setattr(demo.device_path, "prepare", lambda model, *a, **k: prepared.append(model.config) or
                        prepare(model, *a, **k))
    assert main(["demo", "Hi.", "--lang", "en", "--assets", str(assets), "--out", str(out), "--json"]) == 0
    assert demo.REAL_ARCH in prepared  # the live comparison times prepared kernels, as a loaded model has them
    report = json.loads(capsys.readouterr().out)
    for name in ("ar", "speculative"):
        wav, rate = soundfile.read(report["wav"][name])
        assert rate == 16000 and len(wav) == report["frames"][name] * 1280 and report["frames"][name] >= 1
    assert report["ar_calls_per_frame"] == 15 and report["ar_tokens_per_step"] == 1
    assert 1 <= report["calls_per_frame"] <= 15
    assert report["tokens_per_step"] == pytest.approx(15 / report["calls_per_frame"])
    assert report["speedup"] > 0 and 0 < report["mean_top1"] <= 1 and report["tree_nodes"] in (4, 16)
    assert report["vocoder"] == "griffin-lim"
    for name in ("ar", "speculative"):  # streamed: the first chunk comes before the whole utterance is done
        assert 0 < report["first_audio_seconds"][name] <= report["whole_seconds"][name]
    policy = report["policy"]
    assert policy["tree_size"] in (0, 4, 16) and "latency measured live by the demo" in policy["why"]
    if policy["tree_size"]:
        assert report["tree_nodes"] == policy["tree_size"] and policy["why"].startswith("speculative")
    else:
        assert "deploys AR" in report["tree_source"] and policy["why"].startswith("AR: speculation predicted")
    real = report["real_0_6b"]
    assert real["frames"] == 2 and real["tree_size"] in (0, *demo.LIVE_SIZES) and real["target_tokens_per_step"] == 2.47
    assert real["speedup"] == pytest.approx(real["frames_per_second"]["policy"] / real["frames_per_second"]["ar"])
    int8 = real["int8"]
    if not int8.get("skipped"):  # the int8 row: AR or the tree its own policy picks from latencies measured now
        assert int8["tree_size"] in (0, *demo.LIVE_SIZES) and "latency measured live by the demo" in int8["why"]
        assert int8["policy_over_float_ar"] == pytest.approx(int8["frames_per_second"]["policy"]
                                                             / real["frames_per_second"]["ar"])


def test_demo_text_names_the_policy_and_the_live_real_comparison(assets, tmp_path, capsys):
    assert main(["demo", "Hi.", "--assets", str(assets), "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "decoding policy for the stand-in on this machine:" in printed
    assert "streamed: first audio    AR" in printed
    assert "NOT THE STAND-IN, measured live now" in printed and "frames/s against AR's" in printed


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


def test_core_demo_when_no_stand_in_is_shipped():
    from rvqspec.cli.demo import run_core_demo

    report = run_core_demo(frames=2, nodes=4)
    assert report["stand_in_shipped"] is False and report["ar_calls_per_frame"] == 15
    assert 1 <= report["calls_per_frame"] <= 15 and report["tokens_per_step"] == 30 / (2 * report["calls_per_frame"])
