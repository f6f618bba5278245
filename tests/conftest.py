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
CAPPED_TESTS = ("under_an_isa_cap", "under_the_avx2_caps", "[avx2-caps]")  # node ids of tests run under AVX2_CAP


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests marked `long` (each a half minute or more of a loaded `-n 2` run) start first: under `-n 2` a worker
    takes the next test when it is done, so a long one started last would leave the other worker idle to the end."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)  # stable: otherwise in collection order


@pytest.fixture(autouse=True, scope="session")
def one_thread(request):
    """Test models are tiny: per-op overhead dominates, and on a shared 2-core machine (or under `-n 2`)
    a second OpenMP thread only adds synchronisation (20x slower under load)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    # The preparation step a model load or an Engine makes, one worker at a time: with an empty cache both `-n 2`
    # workers measured at once and kept different choices (the file had the last one's), so a server started by one
    # read the other's and its audio differed from the worker's own by a last bit (seen once in a whole-suite run).
    device_path.cache_dir().mkdir(parents=True, exist_ok=True)
    with open(device_path.cache_dir() / "suite-measures.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # the other worker measures (and builds the native kernels first, ~25 s of a core)
            build_the_capped_kernels(request.session.items)
            fcntl.flock(lock, fcntl.LOCK_EX)
        for dtype in device_path.MEASURED_DTYPES:
            device_path.decided(dtype, "the test suite")
    yield
    torch.set_num_threads(threads)


def build_the_capped_kernels(items: list[pytest.Item]) -> None:
    """The fused kernels as the AVX2 class builds them, which the capped tests' processes load: built while the
    other worker builds the native ones and measures, rather than later by one capped process while another waits."""
    if os.environ.get("ONEDNN_MAX_CPU_ISA") or not cpu_class.has_avx2() or \
            not any(name in item.nodeid for item in items for name in CAPPED_TESTS):
        return
    subprocess.run([sys.executable, "-c", "from rvqspec.core import fused; fused.kernels()"], cwd=ROOT,
                   env=os.environ | AVX2_CAP, capture_output=True)
