"""Suite-wide settings."""

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
    for dtype in device_path.MEASURED_DTYPES:  # the preparation step a model load or an Engine makes
        device_path.decided(dtype, "the test suite")
    yield
    torch.set_num_threads(threads)
