"""A run folder's results.json: the judge's record of the run (verdict, findings, metrics,
replay command), written in this one place, whole or not at all, and read back."""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvchaos.engine.errors import KVChaosError


def write_atomic(path: Path, text: str) -> None:
    """Write through a temporary file so a reader (or a crash) never sees half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:  # a full disk: no half-written temporary file left behind
        tmp.unlink(missing_ok=True)
        raise


def write_results(run_dir: Path | str, results: dict) -> Path:
    """RUN_DIR/results.json, atomically: a reader, or a full disk, never sees half of it."""
    path = Path(run_dir) / "results.json"
    write_atomic(path, json.dumps(results, indent=1, default=str))
    return path


def read_results(run_dir: Path) -> dict:
    """A run folder's results.json ({} when missing: analyze rebuilds it); one line if damaged."""
    path = run_dir / "results.json"
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except OSError as e:
        raise KVChaosError(f"{path}: cannot read it: {e.strerror}") from None
    except ValueError as e:  # not JSON, or not UTF-8
        raise KVChaosError(f"{path}: not valid JSON ({e}); move it aside to rebuild it") from None
    if not isinstance(stored, dict):
        raise KVChaosError(f"{path}: not a JSON object; move it aside to rebuild it")
    return stored
