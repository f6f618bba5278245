"""Suite-wide settings."""

import fcntl

import pytest
import torch

from rvqspec.core import device_path

pytest_plugins = ["helpers.checkpoints"]  # the fixtures `model` and `folder`


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
