"""The latency checker: a host-side stall (the staging stall's failure mode) seen in the per-step
timings the engine records, judged so that a shared, noisy CPU neither hides it nor fakes it.

Two comparisons, each a ratio against time measured in the same run: the upload's staging copy
against the same copy through a freshly allocated buffer (the calibration probe, measured after
every step), which sees a stall present from the first step, small or in bursts; and the host
work of the decode steps against the run's own early quiet steps, which sees anything else on the
host side that keeps growing."""

from __future__ import annotations

import statistics

from kvchaos.harness.check.findings import CheckResult, Finding, judged_result, of_kind

CALM = 16  # probes whose median is the calibration's own level (it follows a table resize)


def _rolling_min(xs: list[float], w: int) -> list[float]:
    return [min(xs[max(0, i - w + 1) : i + 1]) for i in range(len(xs))]


def _quiet(xs: list[float]) -> float:
    """The lower quartile: what a step costs when nothing else wants the CPU."""
    return statistics.quantiles(xs, n=4)[0] if len(xs) > 1 else xs[0]


def check_latency(
    events: list[dict],
    slo_ratio: float = 2.0,
    window: int = 8,
    baseline_steps: int = 12,
    sustain: int = 4,
    floor_s: float = 5e-4,
    signal: str = "host_s",
) -> CheckResult:
    """Two judgements, each a finding at most (floor_s: the scenario's [run] latency_floor_ms).
    The staging copy of every upload vs its calibration probe (_staging). And per-step latency of
    the decode-only steps vs the run's own early baseline: a finding when even the fastest of the
    last `window` steps stays above slo_ratio x baseline (and above it by floor_s) for `sustain`
    steps.

    Built for a shared, noisy CPU. A neighbour only ever adds time to a step (the engine waits for
    a core), to some steps and not others; a regression adds time to every step. So both ends are
    read from the quiet steps: the baseline is the lower quartile of the first `baseline_steps`
    (their median rises when most of them were disturbed, and a real stall then hides under the
    limit), the level now the floor of the window (a burst slows most of a window, not all of it).
    signal is the step field judged: host_s (the default: this rank's own host work, i.e.
    scheduling, bookkeeping, the table upload and metadata, which does not grow with the batch's
    compute; the waits on other real ranks, processes that share the CPU, are wait_s and not
    judged), latency_s (the whole step, wall clock) or cpu_s (the engine thread's CPU time)."""
    every = of_kind(events, "step")
    staged = [e for e in every if e.get("probe_s")]  # steps with a calibration (a table uploaded)
    found = _staging(staged, slo_ratio, floor_s, sustain)
    steps = [e for e in every if e.get("prefill_tokens", 0) == 0 and e.get("decode_tokens", 0) > 0]
    if len(steps) >= baseline_steps + sustain:  # else too short to judge a trend
        found += _trend(steps, slo_ratio, window, baseline_steps, sustain, floor_s, signal)
    elif not staged:
        return CheckResult(
            checker="latency", valid=None, findings=[], error=None, checked=len(steps)
        )
    return judged_result("latency", found, max(len(steps), len(staged)))


def _trend(steps, slo_ratio, window, baseline_steps, sustain, floor_s, signal) -> list[Finding]:
    """The decode steps' `signal` against the lower quartile of their first `baseline_steps`.
    host_s climbs on a machine so loaded that every step waits for a core; its CPU time
    (host_cpu_s, where recorded) does not: a climb counts where that climbed as well."""
    lat = [e[signal] for e in steps]
    base = _quiet(lat[:baseline_steps])
    low = _rolling_min(lat, window)
    limit = max(base * slo_ratio, base + floor_s)
    cpu = [e.get("host_cpu_s") for e in steps] if signal == "host_s" else [None]
    if None in cpu:
        busy = [True] * len(steps)  # histories from before host_cpu_s: the wall clock alone
    else:
        cpu_base = _quiet(cpu[:baseline_steps])
        cpu_limit = max(cpu_base * slo_ratio, cpu_base + floor_s)
        busy = [x > cpu_limit for x in _rolling_min(cpu, window)]
    run = 0
    for i in range(baseline_steps, len(steps)):
        run = run + 1 if low[i] > limit and busy[i] else 0
        if run >= sustain:
            return [
                _climb(
                    steps, signal, i, (base, limit, slo_ratio), (window, sustain, baseline_steps)
                )
            ]
    return []


def _staging(steps: list[dict], slo_ratio: float, floor_s: float, sustain: int) -> list[Finding]:
    """A finding when the staging copy took over slo_ratio x its calibration, and over it by
    floor_s, in `sustain` judged uploads in a row. An upload whose calibration was disturbed
    itself (over slo_ratio x the median of the last CALM probes) is not judged: a neighbour's load
    comes in spells that slow both copies of an upload, and lands on one copy alone seldom, on
    the same tiny copy steps in a row next to never; a stall slows every upload it is in."""
    probes = [e["probe_s"] for e in steps]
    calm = [p <= slo_ratio * statistics.median(probes[max(0, i - CALM + 1) : i + 1])
            for i, p in enumerate(probes)]  # fmt: skip
    over = [e["stage_s"] > max(e["probe_s"] * slo_ratio, e["probe_s"] + floor_s) for e in steps]
    judged = [i for i in range(len(steps)) if calm[i]]
    run = 0
    for k, i in enumerate(judged):
        run = run + 1 if over[i] else 0
        if run < sustain:
            continue
        span = judged[k - sustain + 1 : k + 1]
        streak = [steps[j] for j in span]
        hits = [over[j] for j in judged]
        stage = statistics.median(e["stage_s"] for e in streak)
        probe = statistics.median(e["probe_s"] for e in streak)
        bursts = sum(1 for j, h in enumerate(hits) if h and (j == 0 or not hits[j - 1]))
        first, last = streak[0]["step"], streak[-1]["step"]
        ev = {
            "compared": "stage_s (the upload's staging copy) vs probe_s (the same copy, in the "
            "same upload, through a buffer this process allocated after the last one)",
            "stage_ms": stage * 1e3,
            "probe_ms": probe * 1e3,
            "ratio": stage / probe,
            "slo_ratio": slo_ratio,
            "floor_ms": floor_s * 1e3,
            "steps": [e["step"] for e in streak],
            "stalled_steps": sum(hits),
            "judged_steps": len(judged),
            "disturbed_calibrations": len(steps) - len(judged),
            "bursts": bursts,
        }
        return [
            Finding(
                checker="latency",
                step=streak[-1]["step"],
                message=f"the table upload's staging copy took {stage * 1e3:.3f} ms against "
                f"{probe * 1e3:.3f} ms for the same copy through a freshly allocated buffer "
                f"(x{stage / probe:.1f}; limit x{slo_ratio:g} and +{floor_s * 1e3:g} ms) in "
                f"each judged upload of steps {first}..{last}; stalled in "
                f"{sum(hits)} of {len(judged)} judged "
                f"uploads, in {bursts} burst{'s' if bursts != 1 else ''}",
                evidence=ev,
                manifest=None,
                kind="staging_slow",
            )
        ]
    return []


def _climb(steps: list[dict], signal: str, i: int, limits: tuple, spans: tuple) -> Finding:
    """The finding at steps[i], with what was measured: the window, its floor and median, the
    plateau, and the table upload's part (what the staging path took of the host side)."""
    (base, limit, slo_ratio), (window, sustain, baseline_steps) = limits, spans
    lat = [e[signal] for e in steps]
    span = range(max(0, i - window + 1), i + 1)
    low, start = min(lat[j] for j in span), i - sustain + 1
    # where the climb began: the first step after the baseline above the midpoint
    climb = next(
        (steps[j]["step"] for j in range(baseline_steps, i + 1) if lat[j] > (base + limit) / 2),
        steps[start]["step"],
    )
    plateau = statistics.median(lat[i:])
    ev = {
        "signal": signal,
        "baseline_ms": base * 1e3,
        "limit_ms": limit * 1e3,
        "rolling_min_ms": low * 1e3,
        "rolling_median_ms": statistics.median(lat[j] for j in span) * 1e3,
        "plateau_ms": plateau * 1e3,
        "ratio": low / base,
        "climb_started_step": climb,
        "slo_ratio": slo_ratio,
        "window": [steps[j]["step"] for j in span],
    }
    where = ""
    cpu = [e.get("host_cpu_s") for e in steps]
    if signal == "host_s" and None not in cpu:
        ev["cpu_baseline_ms"] = _quiet(cpu[:baseline_steps]) * 1e3
        ev["cpu_min_ms"] = min(cpu[j] for j in span) * 1e3
        where = f"; its CPU time {ev['cpu_baseline_ms']:.2f} -> {ev['cpu_min_ms']:.2f} ms"
    upload = [e.get("upload_s") for e in steps]
    if signal == "host_s" and None not in upload:
        ev["upload_baseline_ms"] = _quiet(upload[:baseline_steps]) * 1e3
        ev["upload_min_ms"] = min(upload[j] for j in span) * 1e3
        where += (
            f"; its table upload {ev['upload_baseline_ms']:.2f} -> {ev['upload_min_ms']:.2f} ms"
        )
    return Finding(
        checker="latency",
        step=steps[i]["step"],
        message=f"per-step {signal} climbed from a {base * 1e3:.2f} ms baseline to "
        f"{low * 1e3:.2f} ms "
        f"even in the fastest of the last {window} steps (x{low / base:.1f}, limit "
        f"{limit * 1e3:.2f} ms), plateau {plateau * 1e3:.2f} ms, sustained from step "
        f"{steps[start]['step']}{where}",
        evidence=ev,
        manifest=None,
        kind="latency_climb",
    )
