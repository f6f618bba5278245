"""`rvqspec tune` end to end on tiny models: the folder is complete, `accelerate(tuned=)` decodes with it (greedy
codes equal AR), an interrupted run resumes without redoing finished stages, the corpus holds what the hook
fed the predictor, and folders tuned for another model are refused."""

import json

import pytest
import torch

import rvqspec
from rvqspec import RvqspecError
from rvqspec.cli.main import main
from rvqspec.core.policy import SIZES
from rvqspec.integrations.base import Acceleration
from rvqspec.integrations.qwen_tts import predictor_from_upstream
from rvqspec.integrations.tuned import check_identity
from rvqspec.tuning import tune as tune_module
from rvqspec.tuning.corpus import Corpus
from rvqspec.tuning.self_synthesis import qwen_tts_utterances

from helpers.upstream_models import upstream_available

if not upstream_available():
    pytest.skip("qwen-tts reference not installed: run `make install`", allow_module_level=True)

from helpers.upstream_tts import save_checkpoint, tiny_qwen3_tts  # noqa: E402

GREEDY = {"do_sample": False, "subtalker_dosample": False}
FILES = ["tune.json", "corpus/index.json", "train/offsets.safetensors", "train/metrics.json", "trees/report.json",
         "trees/tree-N4.json", "latency.json", "report.json", "README.md"]



@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_checkpoint(tiny_qwen3_tts(seed=1), tmp_path_factory.mktemp("checkpoint"),
                           {"max_new_tokens": 12, **GREEDY})


def tune_cli(checkpoint, out, *extra) -> int:
    return main(["tune", "--model", str(checkpoint), "--out", str(out), "--minutes", "0.1", "--epochs", "1",
                 "--device", "cpu", "--quiet", *extra])


@pytest.fixture(scope="module")
def tuned(checkpoint, tmp_path_factory):
    import os

    os.environ["HF_HUB_OFFLINE"] = "1"
    out = tmp_path_factory.mktemp("tuned") / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the latency table is per thread count: the tests run with one
    try:
        assert tune_cli(checkpoint, out) == 0
    finally:
        torch.set_num_threads(threads)
    return out


def test_tune_writes_a_complete_folder_that_accelerate_uses(tuned, checkpoint, capsys):
    for name in FILES:
        assert (tuned / name).exists(), name
    report = json.loads((tuned / "report.json").read_text())
    assert report["corpus"]["train_frames"] + report["corpus"]["validation_frames"] >= 0.1 * 60 * 12.5
    assert report["corpus"]["validation_frames"] > 0 and set(report["timings_seconds"]) >= {"synthesize", "train"}
    assert [row["nodes"] for row in report["trees"]] == list(SIZES)
    tts = rvqspec.integrations.qwen_tts.load_tts(checkpoint, "cpu", torch.float32)
    texts = dict(text=["hello there", "a second line"], speaker=["tiny"] * 2, language=["english"] * 2,
                 max_new_tokens=8, **GREEDY)
    reference, _ = tts.generate_custom_voice(**texts)
    handle = rvqspec.accelerate(tts, tuned=str(tuned))
    try:
        chosen = json.loads((tuned / "tune.json").read_text())
        measured = chosen["measured_tokens_per_step"]  # the drafter in use is the one that measured more
        assert chosen["drafter"] == ("train/offsets.safetensors" if measured["trained"] > measured["reused"]
                                     else "reused")
        assert handle.drafter.kind == ("offsets" if chosen["drafter"] != "reused" else "reused")
        assert handle.policy is not None and (tuned / "trees-other" / "report.json").exists()
        assert "measured by rvqspec tune" in handle.policy.latency.source
        handle.policy.choices.update({1: 8, 2: 8})  # speculate, whatever the tiny model's latencies chose
        wavs, _ = tts.generate_custom_voice(**texts)
    finally:
        handle.undo()
    assert handle.stats.tree_sizes.get(8) and all(torch.equal(torch.as_tensor(a), torch.as_tensor(b))
                                                  for a, b in zip(wavs, reference))


def test_a_finished_folder_is_skipped_and_an_interrupted_stage_resumes(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "run"

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(tune_module, "calibrate_stage", interrupted)
    assert tune_cli(checkpoint, out) == 130  # Ctrl-C during calibration
    assert (out / "train" / "offsets.safetensors").exists() and not (out / "trees").exists()
    corpus_written = (out / "corpus" / "index.json").stat().st_mtime_ns
    drafter_written = (out / "train" / "offsets.safetensors").stat().st_mtime_ns
    monkeypatch.undo()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    lines = []
    monkeypatch.setattr("builtins.print", lambda *a, **k: lines.append(" ".join(map(str, a))))
    assert main(["tune", "--model", str(checkpoint), "--out", str(out), "--minutes", "0.1", "--epochs", "1",
                 "--device", "cpu", "--no-bench"]) == 0
    assert "synthesize: done before, skipped" in lines and "train: done before, skipped" in lines
    assert (out / "corpus" / "index.json").stat().st_mtime_ns == corpus_written
    assert (out / "train" / "offsets.safetensors").stat().st_mtime_ns == drafter_written
    assert (out / "report.json").exists() and not (out / "latency.json").exists()


def test_the_corpus_holds_what_the_hook_fed_the_predictor(monkeypatch):
    """Greedy self-synthesis: each recorded frame's state and codes are those of a predictor call of the hook."""
    tts = tiny_qwen3_tts(seed=1)
    tts.generate_defaults = {"max_new_tokens": 10, **GREEDY}
    fed = []
    real_decode = Acceleration.decode

    def spy(self, hidden, c0, sampler):
        result = real_decode(self, hidden, c0, sampler)
        fed.append((hidden.clone(), torch.cat([c0[:, None], result.codes], dim=1)))
        return result

    monkeypatch.setattr(Acceleration, "decode", spy)
    utterances = qwen_tts_utterances(tts, batch=2)
    first = [next(utterances) for _ in range(2)]
    utterances.close()
    for row, (_, _, codes, hidden) in enumerate(first):
        assert len(codes) >= 2
        for t in range(len(codes)):
            step_hidden, step_codes = fed[t]
            torch.testing.assert_close(hidden[t], step_hidden[row].float(), atol=1e-5, rtol=1e-5)
            assert torch.equal(codes[t], step_codes[row])


def test_a_folder_tuned_for_another_model_is_refused(tuned, tmp_path):
    other = tiny_qwen3_tts(seed=5)
    with pytest.raises(RvqspecError, match="tuned for another checkpoint"):
        rvqspec.accelerate(other, tuned=str(tuned))
    predictor = predictor_from_upstream(tiny_qwen3_tts(seed=1).model.talker)
    check_identity(tuned, predictor, "qwen-tts")  # the same checkpoint passes
    with pytest.raises(RvqspecError, match="tuned for another dtype: float32 there, float64 here"):
        check_identity(tuned, predictor.to(torch.float64), "qwen-tts")
    with pytest.raises(RvqspecError, match="tuned for another model type"):
        check_identity(tuned, predictor, "csm")
    with pytest.raises(RvqspecError, match="is not a folder `rvqspec tune` wrote"):
        rvqspec.accelerate(other, tuned=str(tmp_path))
    with pytest.raises(RvqspecError, match="drop drafter= and calibration="):
        rvqspec.accelerate(other, drafter=rvqspec.ReusedHeads(), tuned=str(tuned))


def test_tune_refuses_a_voice_clone_model_and_another_models_folder(tuned, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    base = save_checkpoint(tiny_qwen3_tts(seed=1, model_type="base"), tmp_path / "base", {})
    assert tune_cli(base, tmp_path / "out") == 2
    assert "voice-clone (Base) model" in capsys.readouterr().err and not (tmp_path / "out").exists()
    other = save_checkpoint(tiny_qwen3_tts(seed=5), tmp_path / "other", {"max_new_tokens": 12})
    assert tune_cli(other, tuned) == 2
    assert "was tuned for another model" in capsys.readouterr().err
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "README.md").write_text("my notes")
    assert tune_cli(other, tmp_path / "mine") == 2  # a folder of the user's: nothing in it is overwritten
    assert "did not write" in capsys.readouterr().err and (tmp_path / "mine" / "README.md").read_text() == "my notes"


def test_self_synthesis_corpus_splits_by_utterance(tuned):
    corpus = Corpus(tuned / "corpus", 0.1)
    train_ids = {u["id"] for u in corpus.split("train")}
    validation_ids = {u["id"] for u in corpus.split("validation")}
    assert train_ids and validation_ids and not train_ids & validation_ids


@pytest.mark.long
def test_tune_a_tiny_csm_end_to_end(tmp_path):
    """CSM: self-synthesis through transformers' generate (rvqspec's AR), the backbone's state per frame, then
    offsets, trees, latency; accelerate(tuned=) takes the folder and greedy codes stay transformers' own."""
    from helpers.csm_models import prompts, tiny_csm
    from rvqspec.integrations.csm import depth_decoder_from_transformers
    from rvqspec.tuning.self_synthesis import csm_utterances
    from rvqspec.cli.tune import latency_bench

    model = tiny_csm(codebooks=16, seed=3, dtype=torch.float32)  # the latency bench times k = 9: 16 codebooks
    model.generation_config.do_sample, model.generation_config.max_new_tokens = False, 8
    model.depth_decoder.generation_config.do_sample = False
    model.save_pretrained(tmp_path / "csm")

    def processor(text: str, add_special_tokens: bool):  # "[speaker]text" -> text ids: a stand-in tokenizer
        return {"input_ids": [[1 + ord(ch) % 80 for ch in text]]}

    predictor = depth_decoder_from_transformers(model)
    subject = tune_module.Subject("csm", tmp_path / "csm", predictor, lambda: csm_utterances(model, processor),
                                  latency_bench(predictor))
    report = tune_module.tune(subject, tmp_path / "run", tune_module.TuneSettings(minutes=0.05, epochs=1,
                                                                                    progress=False), log=lambda _: None)
    assert report["identity"]["kind"] == "csm" and report["corpus"]["validation_frames"] > 0
    ids = prompts(2, seed=4)
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                  depth_decoder_do_sample=False)
    reference = model.generate(**kwargs)
    handle = rvqspec.accelerate(model, tuned=str(tmp_path / "run"))
    try:
        handle.policy.choices.update({2: 4})
        codes = model.generate(**kwargs)
    finally:
        handle.undo()
    assert torch.equal(codes, reference) and handle.stats.tree_sizes.get(4)


def test_tune_the_stand_in_end_to_end(tmp_path, capsys):
    from helpers.standin import tiny_standin
    from rvqspec.standin.talker import save_standin

    save_standin(tiny_standin(seed=2), tmp_path / "standin", torch.float32)
    assert main(["tune", "--model", str(tmp_path / "standin"), "--out", str(tmp_path / "run"), "--minutes", "0.05",
                 "--epochs", "1", "--quiet", "--no-bench"]) == 0
    assert "tokens/step on held-out frames" in capsys.readouterr().out
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["identity"]["kind"] == "standin" and report["trees"][0]["measured_tokens_per_step"] >= 1
    corpus_written = (tmp_path / "run" / "corpus" / "index.json").stat().st_mtime_ns
    per_position = ["tune", "--model", str(tmp_path / "standin"), "--out", str(tmp_path / "run"), "--minutes", "0.05",
                    "--epochs", "1", "--quiet", "--no-bench", "--offsets", "per-position"]
    assert main(per_position) == 2  # the folder holds shared offsets: retraining is asked for
    assert "pass --force train" in capsys.readouterr().err
    assert main([*per_position, "--force", "train"]) == 0
    assert json.loads((tmp_path / "run" / "tune.json").read_text())["trained"] == "train/position-offsets.safetensors"
    assert (tmp_path / "run" / "train" / "position-offsets.safetensors").exists()
    assert (tmp_path / "run" / "corpus" / "index.json").stat().st_mtime_ns == corpus_written  # not synthesized again
