"""The shipped adapters of real engines, for their tests: each loaded, or the test skipped where
the engine is not installed (its CI lane, `.ci/adapter-lane NAME`, sets KVCHAOS_NAME_LANE: there
it must load)."""

from __future__ import annotations

import importlib
import os

import pytest


def load_adapter(name: str):
    try:
        return importlib.import_module(f"kvchaos.harness.adapters.{name}")
    except ImportError as e:
        if os.environ.get(f"KVCHAOS_{name.upper()}_LANE"):
            raise
        pytest.skip(f"the {name} adapter cannot load here: {e}")
