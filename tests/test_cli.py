"""The command line (`cli/main.py`, `cli/flags.py`): an error is one line on stderr and exit 2, no traceback, and bad
flags are refused before any work or any write."""

import json
import os
import subprocess
import sys

import pytest

from rvqspec.cli import main as main_module
from rvqspec.cli.main import entry, main

from helpers.checkpoints import CONFIG
from helpers.cli import assert_refused_first


def test_cli_prints_one_line_and_exits_2(folder, capsys):
    (folder / "model.safetensors").write_bytes(b"\0" * 16)
    assert main(["inspect", "--model", str(folder)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith("rvqspec inspect: error: ") and "is not a readable safetensors file" in err


def test_cli_process_exit_code_and_no_traceback(tmp_path):
    missing = tmp_path / "nonexistent"
    done = subprocess.run([sys.executable, "-m", "rvqspec.cli.main", "inspect", "--model", str(missing)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == f"rvqspec inspect: error: checkpoint folder {missing} does not exist: pass the folder that " \
                          "holds config.json and *.safetensors\n"


def test_the_console_command_runs_with_sleeping_openmp_workers(monkeypatch):
    """`rvqspec` starts itself again with OMP_WAIT_POLICY=PASSIVE (libgomp reads it when torch loads); a wait
    policy the user chose is kept, and then the command runs in this process."""
    execs = []

    def execv(path, args):
        execs.append([path, *args[1:]])
        raise SystemExit(0)

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setattr(os, "execv", execv)
    monkeypatch.setattr(sys, "argv", ["rvqspec", "inspect", "--model", "x"])
    monkeypatch.setattr(main_module, "main", lambda: 7)
    with pytest.raises(SystemExit):
        entry()
    assert execs == [[sys.executable, "-m", "rvqspec.cli", "inspect", "--model", "x"]]
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    execs.clear()
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert entry() == 7 and not execs and os.environ["OMP_WAIT_POLICY"] == "ACTIVE"


def test_cli_inspect_reports_the_checkpoint(folder, model, capsys):
    assert main(["inspect", "--model", str(folder), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["config"] == CONFIG.to_dict()
    assert report["parameters"]["total"] == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("argv, message", [
    (["standin", "build", "--from", "quality", "--to", "corpus", "--work", "{tmp}/w"], "comes after --to"),
    (["calibrate", "--model", "m", "--drafter", "reused", "--corpus", "c", "--out", "{tmp}/o", "--budgets", "100000"],
     "at most 1024"),
    (["demo", "--threads", "100000"], "--threads: 100000 is out of range"),
    (["eval", "--manifest", "{tmp}/X.md", "--out", "{tmp}/o", "--no-asr"], "is not a corpus manifest"),
])
def test_inputs_that_lost_data_or_hung_are_refused_first(argv, message, tmp_path, capsys):
    assert_refused_first(main, argv, message, tmp_path, capsys)


def test_an_unwritable_out_folder_is_refused_before_the_work(tmp_path, capsys, monkeypatch):
    import os

    real = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: False if str(path) == str(tmp_path) else real(path, mode))
    assert main(["demo", "--out", str(tmp_path / "new" / "wavs")]) == 2  # the nearest existing folder is checked
    assert f"cannot write into {tmp_path}" in capsys.readouterr().err


@pytest.mark.parametrize("argv, missing, extra", [
    (["corpus", "speech", "--work", "{tmp}/w"], "tqdm", "standin"),
    (["standin", "build", "--work", "{tmp}/w"], "soundfile", "standin"),
    (["demo", "--out", "{tmp}/o"], "soundfile", "demo"),
])
def test_a_missing_extra_is_named_before_any_work(argv, missing, extra, tmp_path, capsys, monkeypatch):
    """corpus speech and standin build raised a ModuleNotFoundError traceback; demo said so after both syntheses."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == missing else real(name, *a))
    assert main([a.format(tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"needs {missing}: pip install 'rvqspec[{extra}]'" in err
    assert not (tmp_path / "w").exists() and not (tmp_path / "o").exists()
