"""`rvqspec eval`: the two-sample test, Holm, WER scoring, and the pipeline on a tiny random stand-in."""

import json

import numpy as np
import pytest
import torch

from rvqspec.cli.main import main
from rvqspec.core.drafters import MedusaHeads, Offsets, ReusedHeads, model_fingerprint
from rvqspec.core.tree import default_tree
from rvqspec.standin import evaluate as rvqspec_eval
from rvqspec.standin.evaluate import evaluate, holm, load_drafters, merge_rare, report_markdown, two_sample_test
from rvqspec.standin.quality import error_rates, transcripts
from rvqspec.standin.speech import write_manifest
from rvqspec.standin.synthesis import Run
from rvqspec.standin.talker import save_standin

from helpers.standin import random_utterances, tiny_standin, write_corpus

pytest.importorskip("scipy")


def histograms(probs: np.ndarray, utterances: int, frames: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack([rng.multinomial(frames, probs) for _ in range(utterances)])


def test_two_sample_test_accepts_one_distribution_and_rejects_a_shifted_one():
    probs = np.random.default_rng(0).dirichlet(np.ones(40))
    same = two_sample_test(histograms(probs, 60, 50, 1), histograms(probs, 60, 50, 2), permutations=499)
    assert same["p_chi2"] > 0.05 and same["p_permutation"] > 0.05
    shifted = np.roll(probs, 1)
    differ = two_sample_test(histograms(probs, 60, 50, 1), histograms(shifted, 60, 50, 2), permutations=499)
    assert differ["p_chi2"] < 1e-6 and differ["p_permutation"] == pytest.approx(1 / 500)


def test_permutation_p_value_survives_dependent_frames():
    """Each utterance repeats one code: same distribution, but far fewer independent draws than frames.
    The iid chi-square is fooled; swapping whole utterances is not."""
    rng = np.random.default_rng(3)

    def utterances(seed):
        codes = np.random.default_rng(seed).integers(0, 10, 80)
        return np.stack([np.bincount([c] * 30, minlength=10) for c in codes])

    result = two_sample_test(utterances(1), utterances(2), permutations=499, seed=int(rng.integers(100)))
    assert result["p_chi2"] < 1e-3 < 0.05 < result["p_permutation"]


def test_merge_rare_and_holm():
    bins = merge_rare(np.array([50, 3, 0, 4, 20, 5]), min_count=10)
    assert bins.tolist() == [0, 2, -1, 2, 1, 2]  # 3 + 4 + 5 = 12 rare counts share a bin; unseen codes none
    assert merge_rare(np.array([50, 3, 20]), min_count=10).tolist() == [0, 1, 1]  # too rare alone: folded
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])


def test_error_rates_per_language():
    sentences = [{"lang": "en", "text": "Hello, world!"}, {"lang": "en", "text": "Good day."},
                 {"lang": "de", "text": "Guten Tag."}]
    runs = [Run(torch.zeros(3, 16, dtype=torch.long), 45) for _ in sentences]
    heard = {"Hello, world!": "hello world", "Good day.": "good night", "Guten Tag.": "Guten Tag"}
    texts = iter(heard.values())
    hyps = transcripts(runs, sentences, vocoder=lambda codes: np.zeros(len(codes) * 1280),
                       asr=lambda wav, lang: next(texts))
    assert hyps == list(heard.values())
    assert error_rates(hyps, sentences) == pytest.approx({"en": 0.25, "de": 0.0})
    # chance: "hello world" vs "good day", "good night" vs "hello world" (4 of 4 words wrong); de has one sentence
    assert error_rates(hyps, sentences, shift=1) == pytest.approx({"en": 1.0, "de": 0.0})


def fake_asr(wav, lang):
    return "hello there"


def test_evaluate_produces_the_tables_on_a_tiny_stand_in():
    tts = tiny_standin(seed=1)
    torch.manual_seed(0)
    sentences = [{"id": f"{lang}{i}", "lang": lang, "text": text} for i, (lang, text) in
                 enumerate([("en", "Hello there."), ("en", "Hi."), ("de", "Hallo.")])]
    drafters = {"reused": ReusedHeads(tts.predictor), "offsets": Offsets.for_model(tts.predictor),
                "medusa": MedusaHeads.for_model(tts.predictor)}
    report = evaluate(tts, sentences, drafters, default_tree(6), seeds=[0, 1], max_frames=4, progress=False,
                      vocoder=lambda codes: np.zeros(len(codes) * 1280), asr=fake_asr)
    rows = {row["drafter"]: row for row in report["table2"]}
    assert list(rows) == ["reused", "offsets", "medusa"]
    assert rows["reused"]["added_parameters"] == 0 and rows["offsets"]["added_parameters"] == 3 * 32
    assert rows["medusa"]["added_parameters"] == sum(p.numel() for p in drafters["medusa"].parameters())
    for row in rows.values():
        stat = row["tokens_per_step"]
        assert len(stat["per_seed"]) == 2 and 1.0 <= stat["min"] <= stat["mean"] <= stat["max"] <= 3.0
    table3 = {row["lang"]: row for row in report["table3"]["rows"]}
    assert list(table3) == ["en", "de"] and table3["en"]["sentences"] == 2
    assert table3["de"]["ar"]["tokens_per_step"]["mean"] == 1.0  # AR: one code per call
    assert table3["en"]["ar"]["wer"]["mean"] == pytest.approx(2 / 3)  # 0 + 2 edits for "Hello there.", "Hi."
    assert report["table3"]["drafter"] == "offsets" and table3["en"]["spec"]["wer"] is not None
    assert table3["en"]["chance_wer"]["mean"] == pytest.approx(2 / 3)  # "hello there" vs "Hi.", "Hello there."
    for check in report["distribution"].values():
        assert [r["codebook"] for r in check["codebooks"]] == list(range(16))
        assert all(0 < r["p_permutation"] <= 1 and 0 <= r["p_holm"] <= 1 for r in check["codebooks"])
        assert check["utterances"] == 2 * len(sentences)
    markdown = report_markdown(report)
    assert "## Table 2" in markdown and "| offsets |" in markdown and "| de |" in markdown


@pytest.fixture
def tiny_assets(tmp_path):
    tts = tiny_standin(seed=2)
    save_standin(tts, tmp_path / "model", torch.float32)
    Offsets.for_model(tts.predictor).save(tmp_path / "offsets.safetensors")
    default_tree(4).save(tmp_path / "trees" / "tree-N4.json")
    rows = [{"id": f"s{i}", "lang": lang, "split": split, "text": "Hi there.", "wav": "-", "duration": 1.0}
            for i, (lang, split) in enumerate([("en", "test"), ("de", "test"), ("en", "train")])]
    write_manifest(tmp_path / "manifest.jsonl", rows)
    return tmp_path


def test_cli_quick_run_writes_json_and_markdown(tiny_assets, capsys):
    d = tiny_assets
    code = main(["eval", "--quick", "--no-asr", "--model", str(d / "model"),
                 "--drafters", f"reused,{d / 'offsets.safetensors'},medusa",
                 "--trees", str(d / "trees"), "--tree", "4",
                 "--manifest", str(d / "manifest.jsonl"), "--langs", "en,de", "--out", str(d / "out")])
    assert code == 0
    report = json.loads((d / "out" / "eval-quick.json").read_text())
    assert report["sentences"] == {"en": 1, "de": 1} and report["seeds"] == [0]
    medusa = next(row for row in report["table2"] if row["drafter"] == "medusa")
    assert "train-offsets --drafter medusa" in medusa["missing"]
    markdown = (d / "out" / "eval-quick.md").read_text()
    assert "not yet measured: run `rvqspec train-offsets --drafter medusa" in markdown
    assert "WER not measured" in markdown


def test_cli_names_missing_inputs(tiny_assets, capsys):
    d = tiny_assets
    assert main(["eval", "--quick", "--model", str(d / "nothing")]) == 2
    assert "rvqspec standin build" in capsys.readouterr().err
    assert main(["eval", "--quick", "--model", str(d / "model"), "--manifest", str(d / "no.jsonl")]) == 2
    assert "no corpus manifest" in capsys.readouterr().err
    assert main(["eval", "--quick", "--model", str(d / "model"), "--manifest", str(d / "manifest.jsonl"),
                 "--langs", "fr"]) == 2
    assert "no 'fr' sentences" in capsys.readouterr().err


def test_medusa_heads_are_trained_when_missing_or_stale(tiny_assets, monkeypatch):
    d = tiny_assets
    monkeypatch.setattr(rvqspec_eval, "MEDUSA_STEPS", 2)
    tts = tiny_standin(seed=2)
    write_corpus(tts, random_utterances(40), d / "corpus")  # ids u0..u39: u31 is the validation split
    model = tts.predictor
    medusa = d / "medusa" / "medusa.safetensors"
    drafters, missing, _ = load_drafters(["medusa"], model, d / "model", None, d / "none", medusa)
    assert not drafters and "train-offsets --drafter medusa" in missing["medusa"]
    drafters, missing, files = load_drafters(["medusa"], model, d / "model", d / "corpus", d / "none", medusa)
    heads = drafters["medusa"]
    assert not missing and medusa.is_file() and heads.fingerprint == model_fingerprint(model)
    assert files == {"medusa": str(medusa)}
    assert rvqspec_eval.medusa_training(medusa) == "2 batches of 32 frames"
    assert heads.res_bias.abs().sum() > 0  # trained: Adam moved the zero-initialised ResBlocks
    assert torch.equal(load_drafters(["medusa"], model, d / "model", None, d / "none", medusa)[0]["medusa"].res_bias,
                       heads.res_bias)  # reused as is
    other = tiny_standin(seed=5).predictor  # same sizes, other weights: the file is stale, so retrained
    assert load_drafters(["medusa"], other, d / "model", None, d / "none", medusa)[1]
    # A drafter file stands for its kind.
    drafters, missing, files = load_drafters([str(medusa), "reused"], model, d / "model", None, d / "none", medusa)
    assert list(drafters) == ["medusa", "reused"] and not missing and files == {"medusa": str(medusa)}
