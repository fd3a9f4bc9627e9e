"""The history: an append-only JSONL event log, flushed as the run goes and written before any
checking, so a stored run can be re-checked without re-running it.

Its events, kind by kind, are typed in harness/history/events.py: the contract between the
run that writes them and the checkers and reports that read them.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterator

import orjson

from kvchaos.engine.errors import KVChaosError


class HistoryError(KVChaosError, ValueError):
    """A stored history that is not one: names the file and the line."""


class History:
    """Writes events to a JSONL file as they happen. Also keeps them in memory unless
    keep=False (long soaks stream to disk only)."""

    def __init__(self, path: str | Path | None, keep: bool = True) -> None:
        self.path = Path(path) if path else None
        self._f = open(self.path, "w", encoding="utf-8") if self.path else None
        self.events: list[dict] = [] if keep else None
        self._hash = hashlib.sha256()

    def append(self, event: dict) -> None:
        if event["e"] not in DIGEST_SKIP:
            self._hash.update(stable_line(event))
        if self._f:
            self._f.write(_encode(event) + "\n")
        if self.events is not None:
            self.events.append(event)

    def flush(self) -> None:
        if self._f:
            self._f.flush()

    def close(self) -> None:
        if self._f:
            self._f.close()
            self._f = None

    def digest(self) -> str:
        """Hash of everything deterministic in the history (UNSTABLE_KEYS and RESTATED_KEYS left
        out)."""
        return self._hash.hexdigest()


def read_history(path: str | Path) -> list[dict]:
    return list(iter_history(path))


def iter_history(path: str | Path) -> Iterator[dict]:
    """The events of a stored history. A run killed mid-write leaves a torn last line: skipped,
    everything before it stands. A bad line with events after it is damage: HistoryError."""
    torn = None
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            if torn is not None:
                raise HistoryError(
                    f"{path}:{torn}: not a JSON event, and events follow it: the history is damaged"
                )
            try:
                event = json.loads(line)
            except ValueError:  # not JSON, or not UTF-8
                event = None
            if isinstance(event, dict):
                yield event
            else:
                torn = n


# a run begins with run_start, or with the failure that kept it from starting
FIRST_EVENTS = ("run_start", "error", "sut_error")


def check_history(path: str | Path) -> None:
    """HistoryError unless path reads as a kvchaos history: a file starting as a run does."""
    p = Path(path)
    if not p.is_file():
        raise HistoryError(f"{p}: {'not a file' if p.exists() else 'missing'}")
    try:
        first = next(iter_history(p), None)
    except OSError as e:
        raise HistoryError(f"{p}: cannot read it: {e.strerror}") from None
    if first is None:
        raise HistoryError(
            f"{p}: no events in it (empty, or not JSON lines): not a kvchaos history"
        )
    if first.get("e") not in FIRST_EVENTS:
        raise HistoryError(
            f"{p}: starts with {str(first.get('e'))[:40]!r}, not a run_start event: "
            "not a kvchaos history"
        )


# Fields that measure time or the machine: they vary run to run; everything else must not.
# Left out at any depth of an event's dicts (an engine event's data may carry the process id).
UNSTABLE_KEYS = frozenset(
    {
        "latency_s",
        "host_s",
        "upload_s",
        "stage_s",
        "probe_s",
        "host_cpu_s",
        "wait_s",
        "cpu_s",
        "harness_s",
        "minflt",  # the kernel's page-fault counts (the staging stall's ground truth)
        "time",
        "wall_s",
        "telemetry",
        "commit",
        "device_name",
        "pid",
    }
)


# Events left out of the digest whole: the call log and the unslotted writes (records added after
# runs were recorded without them: a run folder recorded before them replays IDENTICAL; what they
# record shows in the rest of the history too)
DIGEST_SKIP = frozenset({"calls", "unslotted_write"})


# Fields recorded for what reads the history that restate what the digest covers already, left
# out of it so that digests of runs recorded before them still compare: a submit's prompt ids (the
# plan's, for the scenario and the seed; the performance check replays them).
RESTATED_KEYS = frozenset({"prompt_ids"})
_SKIPPED = UNSTABLE_KEYS | RESTATED_KEYS  # what the digest leaves out


# Events whose nested dicts are keyed by request ids and the harness's own field names, never by
# an unstable key (a step's are top-level): the biggest and most frequent events of a run (a step
# and a snapshot each step) skip the nested scan.
FLAT_STABLE = frozenset({"snapshot", "step"})


def _stable(d: dict) -> dict:
    return {k: _stable(v) if isinstance(v, dict) else v for k, v in d.items() if k not in _SKIPPED}


def _has_unstable(d: dict) -> bool:
    return not _SKIPPED.isdisjoint(d) or any(
        _has_unstable(v) for v in d.values() if isinstance(v, dict)
    )


_encode = json.JSONEncoder(
    separators=(",", ":")
).encode  # one encoder: json.dumps with options builds one per call


def _stable_part(event: dict) -> dict:
    """The event without what the digest leaves out; the event itself when it has none (most
    events; a step's unstable fields are top-level)."""
    flat = event.get("e") in FLAT_STABLE
    if _SKIPPED.isdisjoint(event):
        if flat or not any(isinstance(v, dict) and _has_unstable(v) for v in event.values()):
            return event
    elif flat:
        return {k: v for k, v in event.items() if k not in _SKIPPED}
    elif not any(isinstance(v, dict) for k, v in event.items() if k in _SKIPPED):
        rest = {k: v for k, v in event.items() if k not in _SKIPPED}
        if not _has_unstable(rest):
            return rest
    return _stable(event)


def stable_line(event: dict) -> bytes:
    """What the digest hashes of an event: its stable part, canonically encoded. orjson, ten times
    the standard encoder's speed on a run's events, so the digest costs little; the same bytes for
    an event in memory and for it read back from its history line (NaN reads back as NaN and
    encodes as null either way). What orjson refuses (an int past 64 bits, a lone surrogate) takes
    the standard encoder, as deterministically."""
    stable = _stable_part(event)
    try:
        return orjson.dumps(stable, option=orjson.OPT_NON_STR_KEYS)
    except TypeError:
        return _encode(stable).encode()


def deterministic_digest(events: list[dict]) -> str:
    h = hashlib.sha256()
    for ev in events:
        if ev.get("e") not in DIGEST_SKIP:
            h.update(stable_line(ev))
    return h.hexdigest()
