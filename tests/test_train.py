import pytest
import torch
from safetensors.torch import load_file

from rvqspec.cli.main import main
from rvqspec.core.drafters import Drafter, MedusaHeads, Offsets, ReusedHeads
from rvqspec.core.errors import RvqspecError
from rvqspec.core.model import MultiCodeDecoder
from rvqspec.tuning.corpus import Corpus, CorpusWriter
from rvqspec.tuning.train import DraftLoss, TrainSettings, evaluate, train

from helpers.synthetic import write_model_and_corpus

FRACTION = 0.25
# lr 3e-2 instead of the default 1e-3: the tiny runs here take tens of steps, not thousands.
FAST = TrainSettings(batch_size=16, lr=3e-2, validation_fraction=FRACTION)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_model_and_corpus(tmp_path_factory.mktemp("synthetic"), utterances=60)


def held_out_accuracy(model_dir, corpus_dir, drafter) -> list[float]:
    model = MultiCodeDecoder.from_pretrained(model_dir)
    return evaluate(DraftLoss(model, drafter), Corpus(corpus_dir, FRACTION), 64)["accuracy"]


@pytest.mark.parametrize("kind, drafter_class", [("offsets", Offsets), ("medusa", MedusaHeads)])
def test_trained_drafters_beat_reused_heads_on_held_out_frames(data, tmp_path, kind, drafter_class):
    model_dir, corpus_dir = data
    settings = TrainSettings(kind, 3, 16, 3e-2 if kind == "offsets" else 3e-3, 0, FRACTION)
    metrics = train(model_dir, corpus_dir, tmp_path, settings, epochs=2, progress=False)
    model = MultiCodeDecoder.from_pretrained(model_dir)
    drafter = drafter_class.load(tmp_path / f"{kind}.safetensors", model)
    trained = held_out_accuracy(model_dir, corpus_dir, drafter)
    reused = held_out_accuracy(model_dir, corpus_dir, ReusedHeads(model))
    assert metrics["baseline"]["accuracy"] == pytest.approx(reused)
    assert metrics["best"]["val_loss"] == min(e["val_loss"] for e in metrics["epochs"]) < metrics["baseline"]["loss"]
    assert all(t > r for t, r in zip(trained, reused)), (trained, reused)
    assert sum(trained) / 3 > sum(reused) / 3 + 0.03, (trained, reused)
    assert (tmp_path / "metrics.json").is_file() and (tmp_path / "last.pt").is_file()


def drafter_state(out) -> dict:
    return torch.load(out / "last.pt", weights_only=True)


def test_resume_after_interruptions_matches_an_uninterrupted_run(data, tmp_path):
    model_dir, corpus_dir = data
    whole = train(model_dir, corpus_dir, tmp_path / "whole", FAST, epochs=2, progress=False)
    steps = whole["steps_per_epoch"]
    part = train(model_dir, corpus_dir, tmp_path / "part", FAST, epochs=2, max_steps=5, progress=False)
    assert part["epochs"] == [] and drafter_state(tmp_path / "part")["step"] == 5
    train(model_dir, corpus_dir, tmp_path / "part", FAST, epochs=2, max_steps=steps + 3, resume=True, progress=False)
    assert drafter_state(tmp_path / "part")["step"] == steps + 3
    resumed = train(model_dir, corpus_dir, tmp_path / "part", FAST, epochs=2, resume=True, progress=False)
    a, b = drafter_state(tmp_path / "whole"), drafter_state(tmp_path / "part")
    assert a["step"] == b["step"] == 2 * steps
    assert torch.equal(a["drafter"]["offsets"], b["drafter"]["offsets"])
    assert torch.equal(a["optimizer"]["state"][0]["exp_avg_sq"], b["optimizer"]["state"][0]["exp_avg_sq"])
    assert torch.equal(load_file(tmp_path / "whole" / "offsets.safetensors")["offsets"],
                       load_file(tmp_path / "part" / "offsets.safetensors")["offsets"])
    for x, y in zip(whole["epochs"], resumed["epochs"], strict=True):
        assert x["val_loss"] == y["val_loss"] and x["train_loss"] == pytest.approx(y["train_loss"], rel=1e-9)
    # Resuming a finished run does nothing; training on for another epoch works.
    assert train(model_dir, corpus_dir, tmp_path / "part", FAST, epochs=2, resume=True, progress=False) == resumed
    longer = train(model_dir, corpus_dir, tmp_path / "part", FAST, epochs=3, resume=True, progress=False)
    assert len(longer["epochs"]) == 3


def test_output_folder_is_never_clobbered(data, tmp_path):
    model_dir, corpus_dir = data
    train(model_dir, corpus_dir, tmp_path, FAST, max_steps=2, progress=False)
    with pytest.raises(RvqspecError, match="--resume"):
        train(model_dir, corpus_dir, tmp_path, FAST, progress=False)
    with pytest.raises(RvqspecError, match="same settings"):
        train(model_dir, corpus_dir, tmp_path, TrainSettings(batch_size=8, validation_fraction=FRACTION),
              resume=True, progress=False)
    train(model_dir, corpus_dir, tmp_path, FAST, max_steps=1, force=True, progress=False)
    assert drafter_state(tmp_path)["step"] == 1
    with pytest.raises(RvqspecError, match="nothing to resume"):
        train(model_dir, corpus_dir, tmp_path / "empty", FAST, resume=True, progress=False)


def test_cli_trains_and_reports(data, tmp_path, capsys):
    model_dir, corpus_dir = data
    code = main(["train-offsets", "--model", str(model_dir), "--corpus", str(corpus_dir), "--out", str(tmp_path),
                 "--validation-fraction", str(FRACTION), "--batch-size", "16", "--quiet"])
    assert code == 0 and "top-1 per depth" in capsys.readouterr().out
    assert isinstance(Drafter.load(tmp_path / "offsets.safetensors"), Offsets)


def cli_error(capsys, *args) -> str:
    assert main(["train-offsets", *map(str, args)]) == 2
    return capsys.readouterr().err


def test_cli_errors_name_the_problem(data, tmp_path, capsys):
    model_dir, corpus_dir = data
    assert "not a code corpus" in cli_error(capsys, "--model", model_dir, "--corpus", tmp_path / "none", "--out", tmp_path / "o")
    with CorpusWriter(tmp_path / "wide", 7) as writer:  # talker hidden size 7: not this model's
        writer.add("a", "en", torch.zeros(3, 16, dtype=torch.long), torch.zeros(3, 7))
    assert "talker hidden size 7" in cli_error(capsys, "--model", model_dir, "--corpus", tmp_path / "wide",
                                                "--out", tmp_path / "o")
    with CorpusWriter(tmp_path / "big-codes", 48) as writer:  # right sizes, codes past the 16-code vocabulary
        for i in range(10):
            writer.add(f"u{i}", "en", torch.full((4, 16), 99), torch.zeros(4, 48))
    assert "vocabularies" in cli_error(capsys, "--model", model_dir, "--corpus", tmp_path / "big-codes", "--out",
                                       tmp_path / "o", "--validation-fraction", 0.5, "--batch-size", 8)
    assert "--batch-size: 0 is out of range" in cli_error(capsys, "--model", model_dir, "--corpus", corpus_dir, "--out",
                                                          tmp_path / "o", "--batch-size", 0)
    assert "fewer than one batch" in cli_error(capsys, "--model", model_dir, "--corpus", corpus_dir, "--out",
                                               tmp_path / "o", "--batch-size", 100_000)


def test_files_of_the_user_are_not_overwritten_and_a_damaged_checkpoint_is_named(data, tmp_path, capsys):
    model_dir, corpus_dir = data
    (tmp_path / "metrics.json").write_text("mine")
    args = ("--model", model_dir, "--corpus", corpus_dir, "--out", tmp_path, "--validation-fraction", FRACTION,
            "--batch-size", 16, "--quiet", "--max-steps", 1)
    assert "already holds metrics.json" in cli_error(capsys, *args)
    assert (tmp_path / "metrics.json").read_text() == "mine"
    assert main(["train-offsets", *map(str, args), "--force"]) == 0  # asked for: overwritten
    capsys.readouterr()
    last = tmp_path / "last.pt"
    last.write_bytes(last.read_bytes()[:100])  # a run killed while copying, a disk error...
    assert "cannot be read" in cli_error(capsys, *args, "--resume")


def test_a_nan_in_the_corpus_is_one_line_for_train_and_calibrate(tmp_path, capsys):
    """train-offsets trained every epoch, then KeyError: 'best' (no drafter written); calibrate a RuntimeError."""
    from safetensors.torch import load_file, save_file

    from rvqspec.cli.main import main
    from rvqspec.tuning.corpus import Corpus

    model_dir, corpus_dir = write_model_and_corpus(tmp_path, utterances=40)
    for shard in Corpus(corpus_dir).shards:
        data = load_file(corpus_dir / shard["file"])
        data["hidden"][3, 0] = float("nan")
        save_file(data, corpus_dir / shard["file"])
    for argv in (["train-offsets", "--model", str(model_dir), "--corpus", str(corpus_dir), "--out", str(tmp_path / "r"),
                  "--batch-size", "4", "--validation-fraction", "0.3", "--quiet"],
                 ["calibrate", "--model", str(model_dir), "--drafter", "reused", "--corpus", str(corpus_dir), "--out",
                  str(tmp_path / "c"), "--budgets", "2", "--frames", "10", "--eval-frames", "4",
                  "--validation-fraction", "0.3"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "row 3: the hidden state is not finite" in err, err
    assert not (tmp_path / "r" / "offsets.safetensors").exists() and not (tmp_path / "c" / "report.json").exists()


def test_the_acceptance_objective_uses_the_verifiers_own_distribution(data):
    """p in -log sum q p is what AR decoding draws from for each codebook: the model's teacher-forced logits under
    the deployed sampler (a shifted position, for instance, fails this)."""
    from rvqspec.core.sampling import Sampler

    model_dir, corpus_dir = data
    model = MultiCodeDecoder.from_pretrained(model_dir)
    codes, hidden = Corpus(corpus_dir, FRACTION).sample("train", 8, seed=0)
    sampler = Sampler()
    loss = DraftLoss(model, ReusedHeads(model), "acceptance", sampler)
    with torch.no_grad():
        ours = loss.verifier_log_probs(model, model.teacher_forced_hidden(hidden.to(model.dtype), codes)).exp()
        wanted = sampler.probs(model.teacher_forced_logits(hidden.to(model.dtype), codes))
    torch.testing.assert_close(ours.float(), wanted.float(), atol=1e-5, rtol=1e-4)
    with pytest.raises(RvqspecError, match="unknown training objective"):
        DraftLoss(model, ReusedHeads(model), "nope")


def test_offsets_trained_for_acceptance_raise_the_verifiers_match_probability(data, tmp_path):
    model_dir, corpus_dir = data
    settings = TrainSettings("offsets", 3, 16, 3e-2, 0, FRACTION, objective="acceptance")
    metrics = train(model_dir, corpus_dir, tmp_path, settings, epochs=2, progress=False)
    assert metrics["best"]["val_loss"] < metrics["baseline"]["loss"]  # -log P(match) fell below the reused heads'
