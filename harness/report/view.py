"""One pass over a run's events: the indexes every report section reads."""

from __future__ import annotations

import bisect

from kvchaos.harness.scenario.managers import REFERENCE, canonical_spec


class RunView:
    """One pass over a run's events: the indexes every section reads."""

    def __init__(self, events: list[dict]) -> None:
        self.events = events
        by: dict[str, list[dict]] = {}
        for e in events:
            by.setdefault(e.get("e"), []).append(e)
        self.by = by
        self.start = (by.get("run_start") or [{}])[0]
        # the block manager in today's names (runs recorded before one import name say engine.*)
        self.block_manager = canonical_spec(self.start.get("block_manager")) or REFERENCE
        self.end = (by.get("run_end") or [None])[-1]
        self.steps = by.get("step", [])
        self.snaps = by.get("snapshot", [])
        self.snap_steps = [s["step"] for s in self.snaps]
        self.armed = {e["fault"]: e["detail"] for e in by.get("fault", []) if e["kind"] == "armed"}
        self.oracle = by.get("oracle", [])
        self.diverged = [o for o in self.oracle if o.get("first_divergence") is not None]
        self.t_ms, t = {0: 0.0}, 0.0
        self.token_steps: dict[str, list[int]] = {}
        self.finished: dict[str, int] = {}  # request -> the step it finished at
        for s in self.steps:
            t += s["latency_s"] * 1e3
            self.t_ms[s["step"]] = t
            for r in s.get("tokens", {}):
                self.token_steps.setdefault(r, []).append(s["step"])
            for r in s.get("finished", []):
                self.finished.setdefault(r, s["step"])
        self.last_step = self.steps[-1]["step"] if self.steps else 0
        self.num_blocks = self.start.get("config", {}).get("cache", {}).get("num_blocks")

    def at(self, step: int) -> float:
        """Engine time (ms, summed step latencies) at the end of `step`."""
        if step in self.t_ms:
            return self.t_ms[step]
        earlier = [s for s in self.t_ms if s <= step]
        return self.t_ms[max(earlier)] if earlier else 0.0

    def snapshot_before(self, step: int) -> dict | None:
        i = bisect.bisect_left(self.snap_steps, step)
        return self.snaps[i - 1] if i > 0 else None

    def snapshot_at(self, step: int) -> dict | None:
        i = bisect.bisect_left(self.snap_steps, step)
        return self.snaps[i] if i < len(self.snaps) and self.snap_steps[i] == step else None

    def requests_at(self, steps) -> set[str]:
        want = set(steps)
        return {r for r, ss in self.token_steps.items() if want.intersection(ss)}
