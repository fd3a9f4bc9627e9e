"""Localize a run's findings to calls into the manager: replay the run (same scenario, seed and
manager: deterministic on the CPU) with a snapshot after every call in the steps around each
finding (and before and after every release), then name the call (kvchaos.harness.check.localize).
The replay is checked against the recorded run step by step: a replay that went otherwise names
nothing."""

from __future__ import annotations

from kvchaos.harness.check.localize import Probe, describe, localize
from kvchaos.harness.history.cache import cache_delta
from kvchaos.harness.history.log import History, stable_line
from kvchaos.harness.run.live import LiveRun

DEFAULT_BUDGET_STEPS = 2000  # steps a localization may replay
# Findings against the manager: the ones a call can explain
LOCALIZED = (
    "block_accounting",
    "table_integrity",
    "manager_calls",
    "kv_reads",
    "prefix_cache",
    "oracle_divergence",
)


class _Stop(Exception):
    """The replay reached the last step it needs."""


def targets(findings: list[dict]) -> list[dict]:
    """The first finding of each checker and kind, against the manager, earliest first."""
    seen, out = set(), []
    for f in sorted(findings, key=lambda f: f["step"]):
        key = (f["checker"], f.get("kind"))
        if f["checker"] in LOCALIZED and key not in seen:
            seen.add(key)
            out.append(f)
    return out


class _Prober:
    def __init__(self, run: LiveRun, windows: set[int]) -> None:
        self.run, self.windows = run, windows
        self.probes: list[Probe] = []
        self.in_step = False
        self.index: dict[int, int] = {}
        self.before: dict | None = None

    def step_now(self) -> int:
        e = self.run.engine
        return e.step_count if self.in_step else e.step_count + 1

    def _snap(self, step: int) -> dict | None:
        """The manager's snapshot as an event, whole (None: it gave none to read)."""
        e = self.run.engine
        try:
            d = e.snapshot().to_dict()
            cache = d.pop("cache", None)
            if cache is not None:
                d.update(cache_delta({}, cache, self.run.cfg.cache.num_blocks)[0])
        except Exception:  # the run's own snapshot check tells what is wrong with it
            return None
        return {"e": "snapshot", "step": step, **d, "live": e.scheduler.live()}

    def pre(self, name: str, args: tuple) -> None:
        if name == "release":  # a leak is judged by what the released sequence held
            self.before = self._snap(self.step_now())

    def post(self, name: str, args: tuple) -> None:
        step = self.step_now()
        i = self.index.get(step, 0)
        self.index[step] = i + 1
        if step not in self.windows and name != "release":
            return
        snapshot = self._snap(step)
        if snapshot is None:
            return
        _, shown_args, answer = self.run.engine.bm.log[-1]
        before, self.before = self.before, None
        self.probes.append(
            Probe(
                step=step,
                index=i,
                call=name,
                args=shown_args,
                answer=answer,
                snapshot=snapshot,
                context=len(self.run.h.events),
                before=before,
            )
        )


def probe_run(sc, seed, device, manager, tp, start_event, windows: set[int], until: int):
    """Replay through step `until` with probes; (events, probes). start_event(run) builds the
    run_start event as the runner does."""
    h = History(None, keep=True)
    run = LiveRun(sc, seed, device, h, manager, tp)
    run.engine.bm.start_log(full_tokens=True)
    prober = _Prober(run, windows)
    e = run.engine
    inner = e.step

    def step():
        if e.step_count >= until:
            raise _Stop
        prober.in_step = True
        try:
            return inner()
        finally:
            prober.in_step = False

    e.step = step
    e.bm.on_call(prober.post, prober.pre)
    h.append(start_event(run))
    run.arm()
    try:
        reason = run.run()
        run.finish(reason)
    except _Stop:
        pass
    except Exception:  # the recorded run failed here too: what was probed stands (faithful())
        pass
    finally:
        e.bm.on_call(None)
    return h.events, prober.probes


def faithful(recorded: list[dict], replayed: list[dict], until: int) -> int | None:
    """The first step (<= until) whose step event differs between the two; None: none does."""
    a = {e["step"]: e for e in recorded if e.get("e") == "step" and e["step"] <= until}
    b = {e["step"]: e for e in replayed if e.get("e") == "step" and e["step"] <= until}
    for s in sorted(a.keys() | b.keys()):
        if s not in a or s not in b or stable_line(a[s]) != stable_line(b[s]):
            return s
    return None


def explain(
    sc, seed, device, manager, tp, start_event, recorded: list[dict], findings: list[dict],
    budget_steps: int = DEFAULT_BUDGET_STEPS,
) -> dict:  # fmt: skip
    """{"localized": [(finding, Located | reason)], "replayed_steps", "budget_steps", "note"}
    for the targets among findings; each finding dict gains "call" (Located) when named."""
    want = targets(findings)
    end = max((e["step"] for e in recorded if e.get("e") == "step"), default=0)
    needs_end = any(f.get("kind") == "end_leak" for f in want)
    until = end + 1 if needs_end else max((f["step"] for f in want), default=0)
    out = {"localized": [], "replayed_steps": 0, "budget_steps": budget_steps, "note": None}
    if not want:
        return out
    if until > budget_steps:
        out["note"] = f"not localized: step {until} is past the replay budget of {budget_steps}"
        return out
    windows = {s for f in want for s in (f["step"] - 1, f["step"])}
    events, probes = probe_run(sc, seed, device, manager, tp, start_event, windows, until)
    out["replayed_steps"] = until
    differs = faithful(recorded, events, min(until, end))
    if differs is not None:
        out["note"] = f"not localized: the replay went otherwise than the run at step {differs}"
        return out
    for f in want:
        got = localize(f, events, probes)
        out["localized"].append((f, got))
    firsts = {(f["checker"], f.get("kind")): (f, got) for f, got in out["localized"]}
    for f in findings:  # the first of its kind names the call, and the same finding at its step
        first, got = firsts.get((f["checker"], f.get("kind")), (None, None))
        if isinstance(got, dict) and (f is first or f["step"] == first["step"]):
            f["call"] = got
    return out


def summary(out: dict) -> list[str]:
    lines = [out["note"]] if out["note"] else []
    for f, got in out["localized"]:
        head = f"{f['checker']}/{f.get('kind')} at step {f['step']}"
        lines.append(f"{head}: {describe(got) if isinstance(got, dict) else 'no call: ' + got}")
    return lines
