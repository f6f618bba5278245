"""The package installs beside a user's torch with its base dependencies alone (torch, safetensors, numpy: no
plots, audio, recognisers or progress bars) and decodes a frame from a checkpoint folder.

The install runs with a cache folder of its own and the fused kernels off, so that what it prints does not depend on
what an earlier run left in ~/.cache (measured kernel choices, built kernels) nor on a compiler being there: the load
measures this CPU's kernels once, with its one line, and the kernels' sources are checked to be in the package."""

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import importlib.util, sys, tempfile, torch
import rvqspec
from rvqspec.cli.main import build_parser
from rvqspec.core import fused
assert all(path.is_file() for path in (*fused.SOURCES, fused.HEADER, fused.UNIT)), "the fused kernels' sources are not installed"
for extra in ("matplotlib", "soundfile", "tqdm", "scipy", "transformers", "faster_whisper", "fastapi", "uvicorn"):
    assert importlib.util.find_spec(extra) is None, extra + " was installed with the base dependencies"
config = rvqspec.PredictorConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=8, vocab_size=16, talker_hidden_size=32,
                                 talker_vocab_size=20)
folder = tempfile.mkdtemp()
rvqspec.MultiCodeDecoder(config).save_pretrained(folder)
model = rvqspec.MultiCodeDecoder.from_pretrained(folder)
greedy = rvqspec.Sampler(do_sample=False)
ar = rvqspec.decode_frame(model, torch.randn(32), 3, greedy)
spec = rvqspec.decode_frame(model, torch.randn(32), 3, greedy, drafter=rvqspec.ReusedHeads(), tree=rvqspec.default_tree(8))
assert ar.codes.shape == (15,) and ar.calls == 15 and 1 <= spec.calls <= 15
build_parser()  # every subcommand registers without the extras
from rvqspec.cli.main import main
assert main(["serve", "--port", "0"]) == 2  # refused in one line naming the extra, before any work
print("decoded", ar.codes.tolist(), "from", rvqspec.__file__)
"""


def users_torch(venv: Path, folder: Path) -> None:
    """The user's torch (this suite's: the Makefile's build) and what it needs, and nothing else of this environment,
    made visible to `venv` through a .pth file of links: pip then finds torch installed, as beside a user's torch, and
    resolves rvqspec's other base dependencies into the venv. (Unpacking and byte-compiling torch's wheel again took
    minutes of the suite's 2 cores.)"""
    folder.mkdir()
    seen, todo = set(), ["torch"]
    while todo:
        dist = importlib.metadata.distribution(todo.pop())
        if dist.name.lower() in seen:
            continue
        seen.add(dist.name.lower())
        needs = [Requirement(line) for line in dist.requires or []]
        todo += [need.name for need in needs if need.marker is None or need.marker.evaluate({"extra": ""})]
        site = Path(dist.locate_file(""))
        for top in {Path(str(file)).parts[0] for file in dist.files} - {".."}:
            if (site / top).exists() and not (folder / top).exists():
                (folder / top).symlink_to(site / top)
    (next(venv.glob("lib/python*/site-packages")) / "users_torch.pth").write_text(f"{folder}\n")


@pytest.mark.long
def test_base_install_decodes_a_frame(tmp_path):
    base = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    torch_build = re.search(r"^TORCH := (\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)  # the tested build
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    users_torch(venv, tmp_path / "users-torch")
    pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run(pip + [*base, torch_build, "setuptools>=68"], check=True)
    source = tmp_path / "source"  # a copy: setuptools' build/ left in the checkout would ship files deleted since
    shutil.copytree(ROOT / "rvqspec", source / "rvqspec", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    subprocess.run(pip + ["--no-deps", "--no-build-isolation", str(source)], check=True, cwd=tmp_path)
    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # a checkout on PYTHONPATH would win
    env.update(RVQSPEC_CACHE=str(cache), RVQSPEC_FUSED="0", OMP_NUM_THREADS="1")  # one thread, as the suite's
    done = subprocess.run([python, "-c", SCRIPT], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 2, done.stderr  # these two lines and nothing else
    measuring, refused = lines
    assert re.fullmatch(rf"rvqspec: measuring this CPU's kernels for \S+ \(float32, \d+ thread\(s\); once: kept in "
                        rf"{re.escape(str(cache / 'kernels.json'))}\)", measuring), measuring
    assert refused == "rvqspec serve: error: rvqspec serve needs fastapi, uvicorn, soundfile, scipy, " \
                      "prometheus_client: pip install 'rvqspec[serve]'"
    assert (cache / "kernels.json").is_file()
    assert "decoded" in done.stdout and str(venv) in done.stdout  # the installed copy, not the checkout
