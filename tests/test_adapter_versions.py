"""Each shipped adapter of a real engine checks the installed engine's version on import: none,
or one outside its series, is one line, and `--block-manager NAME` exits 2 with it."""

from __future__ import annotations

import importlib
import sys
from importlib import metadata

import pytest

from kvchaos.harness.cli import main
from kvchaos.harness.run.user_code import validate_manager

MISSING = metadata.PackageNotFoundError
CASES = [  # (engine, installed version or MISSING, what the adapter says)
    ("vllm", MISSING, "vllm is not installed: the vLLM adapter needs vllm 0.33.x"),
    ("vllm", "0.34.1", "vllm 0.34.1 is installed; the vLLM adapter supports vllm 0.33.x"),
    ("vllm", "0.330.1", "vllm 0.330.1 is installed; the vLLM adapter supports vllm 0.33.x"),
    ("sglang", MISSING, "sglang is not installed: the SGLang adapter needs sglang 0.5.5.x"),
    ("sglang", "0.5.23", "sglang 0.5.23 is installed; the SGLang adapter supports sglang 0.5.5.x"),
    ("sglang", "0.5.50", "sglang 0.5.50 is installed; the SGLang adapter supports sglang 0.5.5.x"),
]


def _installed(monkeypatch, engine: str, version) -> str:
    """metadata.version(engine) answers `version` (MISSING: raised); the adapter is imported
    afresh. Returns the adapter's module name."""
    real = metadata.version

    def fake(name):
        if name != engine:
            return real(name)
        if version is MISSING:
            raise MISSING(name)
        return version

    monkeypatch.setattr(metadata, "version", fake)
    adapter = f"kvchaos.harness.adapters.{engine}"
    monkeypatch.delitem(sys.modules, adapter, raising=False)
    return adapter


@pytest.mark.parametrize("engine, version, said", CASES)
def test_without_a_supported_engine_the_adapter_says_so_in_one_line(
    monkeypatch, engine, version, said
):
    adapter = _installed(monkeypatch, engine, version)
    with pytest.raises(ImportError, match=said):
        importlib.import_module(adapter)
    with pytest.raises(ValueError) as e:
        validate_manager(engine)
    assert str(e.value).startswith(f"'{engine}': importing {adapter} raised ImportError: {said}")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_command_without_the_engine_is_exit_2(monkeypatch, tmp_path, capsys, engine):
    _installed(monkeypatch, engine, MISSING)
    rc = main(
        ["run", "baseline-clean", "--block-manager", engine, "--in-process"]
        + ["--report-dir", str(tmp_path / "r")]
    )
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and f"{engine} is not installed" in err, err
