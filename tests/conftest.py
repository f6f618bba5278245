"""Suite-wide settings."""

import pytest
import torch

from rvqspec.core import device_path

pytest_plugins = ["helpers.checkpoints"]  # the fixtures `model` and `folder`


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
