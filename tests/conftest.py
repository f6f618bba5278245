"""Suite-wide settings."""

import pytest
import torch

pytest_plugins = ["helpers.checkpoints"]  # the fixtures `model` and `folder`


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """Test models are tiny: per-op overhead dominates, and on a shared 2-core machine (or under `-n 2`)
    a second OpenMP thread only adds synchronisation (20x slower under load)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
