"""Shared test set-up."""

import os

import matplotlib
import pytest
import torch

# Loaded before any pytester inline run: such a run drops the modules first imported inside it,
# and the package attribute left behind would name a dropped module (its worker unpicklable).
import kvchaos.harness.run.isolate  # noqa: F401

# pytester runs pytest with HOME in a fresh folder: matplotlib would build its font cache there
# (seconds; past 5 s, on a busy machine, a line on stderr that tests reading stderr then see)
os.environ.setdefault("MPLCONFIGDIR", matplotlib.get_cachedir())


@pytest.fixture(autouse=True)
def _one_thread():
    """The reference model is tiny: intra-op threads only contend (10x slower on a loaded 2-core
    box)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
