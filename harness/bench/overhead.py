"""The harness's cost: the built-in suite driven by the engine alone, with the harness's checking,
and as `kvchaos run` does it."""

from __future__ import annotations

from kvchaos.harness.bench.timing import perf, round_robin


def bench_harness_overhead(
    repeats: int, names: list[str] | None = None, device: str = "cpu"
) -> dict[str, float]:
    """The built-in suite (seed 0) driven three ways: the engine alone (workload and faults, no
    harness); with the harness's checking (history, snapshots, oracle, checkers and verdict, the
    history kept in memory); and as `kvchaos run` does it, with each run's folder written (history,
    results, incidents, report.html) and the report index rebuilt once at the end; and checking
    with the call log off (its cost)."""
    import tempfile

    from kvchaos.harness.history.log import History
    from kvchaos.harness.report.index import update_index
    from kvchaos.harness.report.render import publish
    from kvchaos.harness.run.live import LiveRun
    from kvchaos.harness.run.runner import run_scenario
    from kvchaos.harness.scenario.spec import builtin_scenarios

    scs = [s for s in builtin_scenarios() if names is None or s.name in names]
    with tempfile.TemporaryDirectory() as tmp:

        def harness() -> float:
            t = perf()
            for sc in scs:
                publish(run_scenario(sc, 0, device=device, report_dir=tmp), index=False)
            update_index(tmp)
            return perf() - t

        def checking() -> float:
            t = perf()
            for sc in scs:
                run_scenario(sc, 0, device=device, report_dir=None)
            return perf() - t

        def unlogged() -> float:  # checking with the call log off: what the log costs
            from kvchaos.engine.boundary import Boundary

            start, Boundary.start_log = Boundary.start_log, lambda self, full_tokens=False: None
            try:
                return checking()
            finally:
                Boundary.start_log = start

        def alone() -> float:
            t = perf()
            for sc in scs:
                run = LiveRun(sc, 0, device, History(None, keep=False), observe=False)
                run.arm()
                run.run()
            return perf() - t

        return round_robin(
            {"harness": harness, "checking": checking, "unlogged": unlogged, "alone": alone},
            repeats,
        )
