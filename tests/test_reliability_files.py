"""Issue 36, cases 10 (`tune` on a full disk), 11 and 12: every file of a tuned folder is checked when it is read
(one RvqspecError naming the file, the field and the `--force STAGE` that rewrites it, at load time rather than in
the middle of generate), and `rvqspec tune` resuming a damaged folder redoes the damaged stage or names the
`--force` that does. A tiny stand-in is tuned once; each case damages a copy of its folder."""

import errno
import json
import shutil

import pytest
import torch

from hypothesis import given, settings, strategies as st
from test_file_fuzz import JUNK, damage_json, refused_or_read

from rvqspec import RvqspecError
from rvqspec.cli.main import main
from rvqspec.core.policy import setting_key
from rvqspec.integrations.tuned import load_tuned
from rvqspec.tuning.tune import STAGES, TuneSettings, tune

from helpers.standin import tiny_standin


@pytest.fixture(scope="module")
def standin(tmp_path_factory):
    from rvqspec.standin.talker import save_standin

    folder = tmp_path_factory.mktemp("standin") / "model"
    save_standin(tiny_standin(seed=2), folder, torch.float32)
    return folder


def tune_cli(standin, out, *extra) -> int:
    return main(["tune", "--model", str(standin), "--out", str(out), "--minutes", "0.05", "--epochs", "1", "--quiet",
                 "--no-bench", *extra])


SMALL = TuneSettings(minutes=0.05, epochs=1, budgets=(4, 8), progress=False)  # two trees: a quick calibration


def run_tune(standin, out, force: str | None = None) -> list[str]:
    """`tune` from Python with SMALL settings; its stage lines."""
    from rvqspec.cli.tune import standin_subject

    lines: list[str] = []
    tune(standin_subject(str(standin), 0), out, SMALL, force, log=lines.append)
    return lines


@pytest.fixture(scope="module")
def tuned(standin, tmp_path_factory):
    out = tmp_path_factory.mktemp("tuned") / "run"
    run_tune(standin, out)
    return out


@pytest.fixture(scope="module")
def predictor(standin):
    from rvqspec.standin.talker import load_standin

    return load_standin(standin).predictor


def latency_entry(predictor) -> dict:
    return {"key": setting_key(predictor), "ms": {"1": {"0": 1.0, "4": 1.2, "8": 1.3}, "2": {"0": 1.5, "4": 1.9}},
            "measured_on": "by hand"}


@pytest.fixture
def copy(tuned, predictor, tmp_path):
    """A copy of the tuned folder (without its corpus) with a valid latency.json for this thread count."""
    folder = tmp_path / "copy"
    shutil.copytree(tuned, folder, ignore=shutil.ignore_patterns("corpus"))
    (folder / "latency.json").write_text(json.dumps(latency_entry(predictor)))
    return folder


def edit_json(path, change) -> None:
    path.write_text(json.dumps(change(json.loads(path.read_text()))))


def with_field(name, value):
    return lambda obj: obj | {name: value}


def with_ms(rows):
    return lambda entry: entry | {"ms": rows}


def wide_tree(tree):
    return tree | {"paths": tree["paths"] + [[30]]}  # rank 30 of a 24-code vocabulary


DAMAGED = {  # name: (file, change of its JSON or new text, what the error names)
    "identity a list": ("tune.json", lambda obj: [obj], r"tune.json must hold a JSON object.*--force synthesize"),
    "identity null": ("tune.json", lambda obj: None, r"tune.json must hold a JSON object, got NoneType"),
    "no weights digest": ("tune.json", lambda obj: {k: v for k, v in obj.items() if k != "weights_digest"},
                          r"tune.json: weights_digest must be a string.*--force synthesize"),
    "drafter a number": ("tune.json", with_field("drafter", 3), r"tune.json: drafter must be .*--force calibrate"),
    "drafter outside train/": ("tune.json", with_field("drafter", "../../x.safetensors"), r"drafter must be"),
    "latency not JSON": ("latency.json", "{'key': ", r"latency.json is not valid JSON.*--force bench"),
    "latency a list": ("latency.json", lambda entry: [entry], r"latency.json: key 'None' is not a setting key"),
    "figures as strings": ("latency.json", with_ms({"1": {"0": "1.0", "4": "1.2"}}), r"batch 1 N 0 must be a latency"),
    "row a list": ("latency.json", with_ms({"1": [1.0, 1.2]}), r"batch 1 must map tree sizes"),
    "batch not a number": ("latency.json", with_ms({"one": {"0": 1.0}}), r"batch 'one' must be an integer"),
    "zero figure": ("latency.json", with_ms({"1": {"0": 0, "4": 1.0}}), r"batch 1 N 0 must be a latency .* got 0"),
    "batch 0": ("latency.json", with_ms({"0": {"0": 1.0, "4": 1.0}}), r"batch '0' must be an integer in \[1"),
    "empty table": ("latency.json", with_ms({}), r"must hold a non-empty 'ms' table"),
    "negative figure": ("latency.json", with_ms({"1": {"0": 1.0, "4": -1.5}}), r"batch 1 N 4 must be .* got -1.5"),
    "NaN figure": ("latency.json", with_ms({"1": {"0": 1.0, "4": float("nan")}}), r"batch 1 N 4 must be .* got nan"),
    "trees report not JSON": ("trees/report.json", "{", r"trees/report.json is not valid JSON.*--force calibrate"),
    "trees report without trees": ("trees/report.json", with_field("trees", {}), r"trees must be a non-empty list"),
    "tree file outside trees/": ("trees/report.json", lambda r: r | {"trees": [{"budget": 4, "file": "../tune.json"}]},
                                 r"a tree's file must be a file name"),
    "tree rank past the vocabulary": ("trees/tree-N4.json", wide_tree,
                                      r"tree-N4.json: tree uses draft rank 30 but a codebook has only 24 codes.*"
                                      r"--force calibrate"),
}


def test_an_intact_tuned_folder_loads(copy, predictor):
    drafter, calibration, latency = load_tuned(copy, predictor, "standin")
    assert calibration == copy / "trees" and latency is not None and latency.ms[2][4] == 1.9


@pytest.mark.parametrize("case", DAMAGED)
def test_a_damaged_tuned_folder_is_refused_when_loaded(copy, predictor, case):
    name, change, message = DAMAGED[case]
    path = copy / name
    if isinstance(change, str):
        path.write_text(change)
    else:
        edit_json(path, change)
    with pytest.raises(RvqspecError, match=message) as refused:
        load_tuned(copy, predictor, "standin")
    assert "\n" not in str(refused.value) and str(path) in str(refused.value)


@pytest.fixture(scope="module")
def fuzzed(tuned, predictor, tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzzed") / "run"
    shutil.copytree(tuned, folder, ignore=shutil.ignore_patterns("corpus"))
    (folder / "latency.json").write_text(json.dumps(latency_entry(predictor)))
    return folder


@settings(max_examples=50, deadline=None)
@given(name=st.sampled_from(["tune.json", "latency.json", "trees/report.json", "trees/tree-N4.json"]),
       pick=st.floats(0, 1), junk=JUNK)
def test_any_damaged_tuned_file_loads_or_is_refused_in_one_line(fuzzed, predictor, name, pick, junk):
    path = fuzzed / name
    original = path.read_text()
    path.write_text(damage_json(original, pick, junk))
    try:
        refused_or_read(lambda: load_tuned(fuzzed, predictor, "standin"))
    finally:
        path.write_text(original)


@pytest.mark.parametrize("damage, redone", [
    (lambda out: (out / "trees" / "report.json").write_text("{"), "calibrate"),
    (lambda out: (out / "trees-other" / "report.json").unlink(), "calibrate"),
    (lambda out: (out / "train" / "metrics.json").write_text("[1, "), "train"),
    (lambda out: (out / "corpus" / "index.json").write_text("[]"), "synthesize"),
    (lambda out: (out / "report.json").write_text("[]"), "report"),
], ids=["trees report not JSON", "trees-other report missing", "metrics not JSON", "corpus index a list",
        "report a list"])
def test_tune_resuming_a_damaged_folder_redoes_the_damaged_stage(tuned, standin, tmp_path, damage, redone):
    out = tmp_path / "run"
    shutil.copytree(tuned, out)
    damage(out)
    lines = run_tune(standin, out)
    kept = [stage for stage in STAGES[:STAGES.index(redone)] if stage != "bench"]  # the subject has no bench
    assert all(f"{stage}: done before, skipped" in lines for stage in kept) and f"{redone}: ..." in lines
    for name in ("trees/report.json", "trees-other/report.json", "train/metrics.json", "report.json"):
        assert isinstance(json.loads((out / name).read_text()), dict), name


def test_tune_resuming_a_folder_with_a_damaged_identity_names_the_force(tuned, standin, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(tuned, out)
    edit_json(out / "tune.json", lambda obj: [obj])
    assert tune_cli(standin, out) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tune.json must hold a JSON object" in err and "--force synthesize" in err
    assert "synthesize: ..." in run_tune(standin, out, force="synthesize")
    assert isinstance(json.loads((out / "tune.json").read_text()), dict)


def test_tune_on_a_full_disk_says_so_in_one_line(standin, tmp_path, monkeypatch, capsys):
    """ENOSPC from each kind of writer `tune` uses: text (json), safetensors, the training checkpoint."""
    from safetensors import SafetensorError

    from rvqspec.core import checkpoint
    from rvqspec.tuning import train

    def full(tmp):
        raise OSError(errno.ENOSPC, "No space left on device")

    def full_safetensors(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    for where, name, replacement in ((checkpoint.Path, "write_text", lambda self, text: full(self)),
                                     (checkpoint, "save_file", full_safetensors),
                                     (train.Path, "write_bytes", lambda self, data: full(self))):
        with monkeypatch.context() as patch:
            patch.setattr(where, name, replacement)
            assert tune_cli(standin, tmp_path / name) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "No space left on device" in err and "Traceback" not in err, err


TRAIN = """
import os, signal, sys
from rvqspec.tuning import train

if sys.argv[4] == "kill":  # SIGKILL right after the first checkpoint
    save = train.save_checkpoint

    def save_then_die(out, state):
        save(out, state)
        os.kill(os.getpid(), signal.SIGKILL)

    train.save_checkpoint = save_then_die
train.train(*sys.argv[1:4], train.TrainSettings(batch_size=16, lr=3e-2, validation_fraction=0.25), epochs=2,
            resume=sys.argv[4] == "resume", progress=False)
"""
AVX2_CAP = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}  # the Zen 1-3 class, on any x86 CPU


@pytest.mark.long
@pytest.mark.parametrize("caps", [{}, AVX2_CAP], ids=["this-cpu", "avx2-caps"])
def test_training_killed_at_a_checkpoint_resumes_to_the_same_bits(tmp_path, caps):
    """Case 19 (issue 36) and issue 41, case 11: SIGKILL right after the first checkpoint (end of epoch 1, before
    metrics.json), in a process whose fast path is off (as where the fused kernels could not be built); resumed in
    another process, with it on: the same bits as an uninterrupted run, in the drafter and in its file's bytes
    (safetensors ordered its metadata differently in every process). Under the AVX2 caps every run is a process of
    its own, started with them."""
    import os
    import signal
    import subprocess
    import sys

    from helpers.synthetic import write_model_and_corpus

    model_dir, corpus_dir = write_model_and_corpus(tmp_path / "data", utterances=40)

    def child(out: str, mode: str, env: dict) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", TRAIN, str(model_dir), str(corpus_dir), str(tmp_path / out),
                               mode], env=os.environ | {"OMP_NUM_THREADS": "1"} | caps | env, capture_output=True)

    if caps:
        assert child("whole", "whole", {}).returncode == 0
    else:
        from rvqspec.tuning.train import TrainSettings, train

        train(model_dir, corpus_dir, tmp_path / "whole", TrainSettings(batch_size=16, lr=3e-2,
                                                                       validation_fraction=0.25), epochs=2,
              progress=False)
    killed = child("part", "kill", {"RVQSPEC_FUSED": "0"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()[-2000:]
    assert not (tmp_path / "part" / "metrics.json").exists()
    resumed = child("part", "resume", {})
    assert resumed.returncode == 0, resumed.stderr.decode()[-2000:]
    runs = [tmp_path / run for run in ("whole", "part")]
    assert json.loads((runs[0] / "metrics.json").read_text())["epochs"] == \
        json.loads((runs[1] / "metrics.json").read_text())["epochs"]
    last = [torch.load(run / "last.pt", weights_only=True)["drafter"]["offsets"] for run in runs]
    assert torch.equal(*last)
    assert (runs[0] / "offsets.safetensors").read_bytes() == (runs[1] / "offsets.safetensors").read_bytes()
