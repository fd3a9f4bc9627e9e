"""Shared test set-up."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """The reference model is tiny: intra-op threads only contend (10x slower on a loaded 2-core
    box)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
