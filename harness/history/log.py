"""The history: an append-only JSONL event log, flushed as the run goes and written before any
checking, so a stored run can be re-checked without re-running it.

Every event has "e" (its kind) and "step" (the engine step it belongs to; 0 before the first).
Kinds and their fields:
  run_start  scenario, seed, config, config_hash, commit, device, time
  submit     req, prompt_len, max_new, parent (fork source or null), turn_of (a turn only: the
             request whose prompt and output its prompt continues)
  reject     req, error ("InvalidRequest" | "RequestRejected"), message
  cancel     req, phase (waiting | prefill | decode | preempted), shared (held a block also held by
             another sequence), blocks (the blocks it held)
  step       latency_s, host_s (this rank's own host work), upload_s (its table upload part),
             wait_s (on other real ranks before the model), free_blocks, running, waiting,
             prefill_tokens, decode_tokens, preempted, tokens {req: token}, finished,
             table_version, stale_ranks, rank_crcs, table_crc, cpu_s, and telemetry (RSS, CPU, GPU
             fields) on sampled steps; harness_s (the harness's own snapshots inside the step,
             already taken out of latency_s, host_s and upload_s)
  snapshot   the kvchaos.engine.protocols.Snapshot fields, plus live (requests the engine is
             running); taken as each step's table is uploaded (the table the kernels read), after
             a step that ran nothing, and once more at the end of the run (stamped one past the
             last step). A prefix cache (`cache`) is stored as its change since the snapshot
             before: cache_added (entries), cache_removed ([block, key]), cache_n (its size);
             harness.history.cache.apply_cache rebuilds it
  engine     kind (cow | staging_realloc | hit | refusal | table_resync | ...), data; a hit: req,
             known, answered, used, capped, blocks (those its admission found computed)
  kv_record  ranks: the per-block writer record is on (a manager offering a prefix cache); step 0
  kv_read    req (the READER), rank, index (entry of its row), block, slots (offsets in the block
             read wrongly), pos (its positions there), writer (None: never written), writer_pos,
             writer_step, via_hit (the block came with req's last cache hit), origin (set: the
             KV was computed from a wrong read by that request), torn (written in a step that
             raised); step is the step of the read
  cache_mismatch  block, key, problem (partial | tokens | chain | parent), writers, written: a
             cached block whose slots are not KV of its key's tokens (harness/run/cache_state.py)
  hit_mismatch    req, index, block, problem (not_cached | tokens | parent): a hit's block that
             its key does not name
  fault      fault, kind ("armed" | "trigger" | "fired"), detail
  oracle     req, checked, max_abs_err, max_rel_err, first_divergence, abs_err_at_divergence,
             tolerance, divergence_step (engine step of the first divergent token, or null); step is
             the step the request stopped producing tokens. Written when checked: requests are
             checked in batches as they finish or are cancelled, and the rest when the run ends
  error      error, message, traceback
  run_end    reason (done | max_steps | interrupted | error), counters, fault_verify, kv_record
             (with the record on: reads, slots_verified, shared_slots, own_ranks,
             cache_untold: wrong cache entries past the 64 written as cache_mismatch)
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
        """Hash of everything deterministic in the history (UNSTABLE_KEYS left out)."""
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
        "wait_s",
        "cpu_s",
        "harness_s",
        "time",
        "wall_s",
        "telemetry",
        "commit",
        "device_name",
        "pid",
    }
)


# Events whose nested dicts are keyed by request ids and the harness's own field names, never by
# an unstable key (a step's are top-level): the biggest and most frequent events of a run (a step
# and a snapshot each step) skip the nested scan.
FLAT_STABLE = frozenset({"snapshot", "step"})


def _stable(d: dict) -> dict:
    return {
        k: _stable(v) if isinstance(v, dict) else v for k, v in d.items() if k not in UNSTABLE_KEYS
    }


def _has_unstable(d: dict) -> bool:
    return not UNSTABLE_KEYS.isdisjoint(d) or any(
        _has_unstable(v) for v in d.values() if isinstance(v, dict)
    )


_encode = json.JSONEncoder(
    separators=(",", ":")
).encode  # one encoder: json.dumps with options builds one per call


def _stable_part(event: dict) -> dict:
    """The event without what measures time or the machine; the event itself when it has none
    (most events; a step's unstable fields are top-level)."""
    flat = event.get("e") in FLAT_STABLE
    if UNSTABLE_KEYS.isdisjoint(event):
        if flat or not any(isinstance(v, dict) and _has_unstable(v) for v in event.values()):
            return event
    elif flat:
        return {k: v for k, v in event.items() if k not in UNSTABLE_KEYS}
    elif not any(isinstance(v, dict) for k, v in event.items() if k in UNSTABLE_KEYS):
        rest = {k: v for k, v in event.items() if k not in UNSTABLE_KEYS}
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
        h.update(stable_line(ev))
    return h.hexdigest()
