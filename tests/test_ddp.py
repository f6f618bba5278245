"""`rvqspec train-offsets` under torchrun with 2 processes (gloo, CPU) equals one process."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from rvqspec.tuning.train import TrainSettings, train

from helpers.synthetic import write_model_and_corpus


@pytest.mark.long
def test_two_processes_reach_the_same_offsets_as_one(tmp_path):
    model_dir, corpus_dir = write_model_and_corpus(tmp_path, utterances=24)
    args = ["--model", model_dir, "--corpus", corpus_dir, "--validation-fraction", "0.25", "--batch-size", "8",
            "--lr", "0.03", "--epochs", "2", "--dtype", "float64", "--quiet"]
    # float64 so that the only difference, the order of the batch sums, stays far below the tolerance.
    single = train(model_dir, corpus_dir, tmp_path / "single", TrainSettings(batch_size=8, lr=0.03, validation_fraction=0.25),
                   epochs=2, dtype="float64", progress=False)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "rvqspec.cli.main", "train-offsets", "--out", tmp_path / "ddp", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}  # a crashing rank prints its Python stack
    for attempt in range(2):
        done = subprocess.run([str(a) for a in command], env=env, capture_output=True, text=True, timeout=300)
        # Under load a rank occasionally dies in C++ with this message and no Python error (seen in ~1 of 8 runs, not
        # root-caused: see the 2026-11-30 closing note); one retry, from scratch, for that signature only.
        if done.returncode == 0 or "terminate called without an active exception" not in done.stderr:
            break
        print(f"attempt {attempt + 1}: a rank aborted ({done.stderr[:200]!r}); retrying once")
        shutil.rmtree(tmp_path / "ddp", ignore_errors=True)
    assert done.returncode == 0, done.stderr[:3000]
    ddp = json.loads((tmp_path / "ddp" / "metrics.json").read_text())
    assert ddp["world_size"] == 2 and single["world_size"] == 1
    offsets = [load_file(tmp_path / run / "offsets.safetensors")["offsets"] for run in ("single", "ddp")]
    assert offsets[0].abs().max() > 0.1  # it trained
    torch.testing.assert_close(offsets[1], offsets[0], rtol=1e-9, atol=1e-12)
    last = [torch.load(tmp_path / run / "last.pt", weights_only=True) for run in ("single", "ddp")]
    assert last[0]["step"] == last[1]["step"] == 2 * single["steps_per_epoch"]
    for a, b in zip(single["epochs"], ddp["epochs"], strict=True):
        assert abs(a["val_loss"] - b["val_loss"]) < 1e-9 and abs(a["train_loss"] - b["train_loss"]) < 1e-9
