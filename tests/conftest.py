"""Suite-wide settings."""

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rvqspec.core import cpu_class, device_path

from test_cpu_classes import AVX2_CAP

pytest_plugins = ["helpers.checkpoints"]  # the fixtures `model` and `folder`

ROOT = Path(__file__).resolve().parents[1]
CAPPED_FILES = ("test_cpu_classes.py", "test_int8.py", "test_reliability_files.py")  # tests run under AVX2_CAP
CAPPED_BUILD = pytest.StashKey[subprocess.Popen]()  # the second worker's build of the AVX2 class's kernels


def pytest_configure(config: pytest.Config) -> None:
    """Under `-n 2` with an empty cache, the first worker builds the native fused kernels while it collects (a module
    skips without them) and the second waits for that build: the second builds the AVX2 class's kernels meanwhile,
    which the capped tests' processes load (rather than one capped process building them while another waits)."""
    if getattr(config, "workerinput", {}).get("workerid") != "gw1" or os.environ.get("ONEDNN_MAX_CPU_ISA") \
            or not cpu_class.has_avx2() or not any(runs_capped(arg) for arg in config.args):
        return
    code = "from rvqspec.core import fused; fused.kernels()"
    config.stash[CAPPED_BUILD] = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=os.environ | AVX2_CAP,
                                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def runs_capped(arg: str) -> bool:
    """Whether the tests named by `arg` (a folder, a file, a test's node id) include tests run under AVX2_CAP."""
    path = Path(arg.split("::")[0]).resolve()
    return path in (ROOT, ROOT / "tests") or path.name in CAPPED_FILES


def pytest_unconfigure(config: pytest.Config) -> None:
    if (build := config.stash.get(CAPPED_BUILD, None)) is not None:
        build.wait()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests marked `long` (each a half minute or more of a loaded `-n 2` run) start first: under `-n 2` a worker
    takes the next test when it is done, so a long one started last would leave the other worker idle to the end."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)  # stable: otherwise in collection order


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """Test models are tiny: per-op overhead dominates, and on a shared 2-core machine (or under `-n 2`)
    a second OpenMP thread only adds synchronisation (20x slower under load)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    # The preparation step a model load or an Engine makes, one worker at a time: with an empty cache both `-n 2`
    # workers measured at once and kept different choices (the file had the last one's), so a server started by one
    # read the other's and its audio differed from the worker's own by a last bit (seen once in a whole-suite run).
    device_path.cache_dir().mkdir(parents=True, exist_ok=True)
    with open(device_path.cache_dir() / "suite-measures.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for dtype in device_path.MEASURED_DTYPES:
            device_path.decided(dtype, "the test suite")
    yield
    torch.set_num_threads(threads)
