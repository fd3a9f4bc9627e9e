"""pytest plugin: every scenario file x seed is a test item, with markers from its faults and tags.

    pytest scenarios/                                   # the built-in suite
    pytest my_scenarios/ -m "fault_refcount_leak and not soak"
    pytest scenarios/ --kvchaos-seeds 20 --kvchaos-block-manager mypkg.bm:MyBlockManager

Fixtures for hand-written tests: `kvchaos_run` (run a scenario, a file or a dict, with the command
line's options) and `kvchaos_engine` (an Engine built on the configured block manager).

Where runs go: scenario items keep their run folders under --kvchaos-report-dir, else reports/ in
pytest's rootdir (beside .pytest_cache: the project, or the invocation folder when there is no
config file), as `kvchaos run` does; the session ends by rebuilding its index.html and latest.
kvchaos_run, called by a hand-written test, writes into that test's tmp_path unless
--kvchaos-report-dir is given: such tests run on every `pytest`, as unit tests do, and should not
fill the project's reports/.

Scenario items run each in a fresh worker process (kvchaos.harness.run.isolate, as `kvchaos
run` does), stopped at --kvchaos-timeout; a worker that hangs or dies fails its item with a verdict
and the session goes on (pytest-xdist too). --kvchaos-in-process runs them in the pytest process;
kvchaos_run always runs in the test's own process (the test may patch what it runs).

pytest loads this plugin in every session of an environment where kvchaos is installed: it
imports nothing heavy (no torch, no pydantic) until a scenario file is collected or a kvchaos
option is used."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

from kvchaos.harness.scenario import options

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

# Fault markers (fault_<name>) and a scenario's tags are declared as its file is collected.
MARKERS = {
    "scenario": "a kvchaos scenario run",
    "soak": "a long randomised run",
    "gpu": "needs a CUDA GPU (skips on the CPU)",
    "distributed": "starts real torch.distributed ranks",
    "smoke": "a quick scenario",
    "conformance": "a block-manager conformance property (--kvchaos-block-manager)",
    "timing": "its verdict depends on measured time (a latency-judged scenario): -m 'not timing' "
    "leaves it out on a busy machine",
}


def pytest_addoption(parser) -> None:
    g = parser.getgroup("kvchaos")
    options.add_pytest(g)
    g.addoption(
        "--kvchaos-in-process",
        action="store_true",
        help="run scenario items in the pytest process (for a debugger) instead of a fresh "
        "worker process per run, which can be killed at the time limit and whose death is a "
        "verdict, not a lost session",
    )


def pytest_configure(config) -> None:
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    _check_flags(config)
    spec = config.getoption("--kvchaos-block-manager", None)
    if spec:  # what is not a manager is one usage error, not an ERROR on every item
        from kvchaos.engine.protocols import declared_block_sizes
        from kvchaos.harness.run.door import validate_isolated
        from kvchaos.harness.run.isolate import in_process_reason
        from kvchaos.harness.run.user_code import SmokeFailure, validate_manager

        isolated = not config.getoption("--kvchaos-in-process") and in_process_reason() is None
        limit = config.getoption("--kvchaos-check-timeout", None)
        limit = options.DEFAULT_CHECK_TIMEOUT_S if limit is None else limit
        try:
            config._kvchaos_block_sizes = (
                validate_isolated(spec, limit)
                if isolated
                else declared_block_sizes(validate_manager(spec))
            )
        except SmokeFailure as e:  # a manager with a bug: one FAIL item, its run (DoorItem)
            config._kvchaos_door = e
        except ValueError as e:
            raise pytest.UsageError(f"--kvchaos-block-manager: {e}") from None


def _check_flags(config) -> None:
    """A bad --kvchaos-* value is one usage error before anything is collected (the checks are
    imported only when such a flag is given: a session without them imports nothing heavy)."""
    given = {
        name: value
        for name in (
            "--kvchaos-seeds",
            "--kvchaos-device",
            "--kvchaos-timeout",
            "--kvchaos-check-timeout",
            "--kvchaos-report-dir",
        )
        if (value := config.getoption(name, None)) not in (None, "cpu")
    }
    if not given:
        return
    from kvchaos.engine.errors import KVChaosError
    from kvchaos.harness.scenario import inputs

    checks = {
        "--kvchaos-seeds": lambda v: inputs.parse_seeds(None, v),
        "--kvchaos-device": inputs.device,
        "--kvchaos-timeout": lambda v: inputs.seconds(str(v)),
        "--kvchaos-check-timeout": lambda v: inputs.seconds(str(v)),
        "--kvchaos-report-dir": _check_report_dir,
    }
    for name, value in given.items():
        try:
            checks[name](value)
        except (ValueError, KVChaosError) as e:
            raise pytest.UsageError(f"{name}: {e}") from None


def _check_report_dir(d: str) -> None:
    """As kvchaos run checks --report-dir: not blank, and a folder runs can be written under."""
    from kvchaos.harness.report.paths import report_dir_problem
    from kvchaos.harness.scenario.inputs import path

    if problem := report_dir_problem(path(d)):
        raise ValueError(f"{d}: {problem}")


def _batch(config) -> str:
    """One batch id a session: the report index groups the session's runs by it (under
    pytest-xdist, the workers share the session's id)."""
    if not hasattr(config, "_kvchaos_batch"):
        xdist = getattr(config, "workerinput", {}).get("testrunuid")
        config._kvchaos_batch = (
            f"pytest-{xdist[:12]}"
            if xdist
            else f"pytest-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        )
    return config._kvchaos_batch


def _report_dir(config) -> Path:
    """Where scenario items keep their runs: never pytest's temporary folders, which it deletes."""
    d = config.getoption("--kvchaos-report-dir")
    if d:  # relative to where pytest was started, like any path on its command line
        return Path(os.path.abspath(config.invocation_params.dir / d))
    return config.rootpath / "reports"


def pytest_ignore_collect(collection_path: Path, config):
    """Run folders hold each run's resolved scenario.toml: never collect them as new scenarios."""
    run_folder = all((collection_path / f).is_file() for f in ("history.jsonl", "results.json"))
    if run_folder or collection_path == _report_dir(config):
        return True
    return None  # not False: leave --ignore, collect_ignore and the rest to decide


def pytest_sessionfinish(session) -> None:
    cfg = session.config
    runs = getattr(cfg, "_kvchaos_runs", [])
    if runs:  # the report index, once for the session's scenario runs
        from kvchaos.harness.report.index import update_index

        try:
            update_index(runs[-1].parent, newest=runs[-1])
            cfg._kvchaos_indexed = True
        except Exception as e:  # the runs and reports are written: a stale listing fails no test
            cfg.get_terminal_writer().line(
                f"kvchaos: could not update {runs[-1].parent / 'index.html'}: "
                f"{type(e).__name__}: {e}",
                yellow=True,
            )


def pytest_terminal_summary(terminalreporter, config) -> None:
    runs = getattr(config, "_kvchaos_runs", [])
    if runs:  # where the session's run folders are (called after pytest_sessionfinish)
        d, n = runs[-1].parent, len(runs)
        index = d / "index.html" if getattr(config, "_kvchaos_indexed", False) else "not updated"
        terminalreporter.write_line(
            f"kvchaos: {n} run{'s' * (n != 1)} in {d}  index: {index}  latest: {d / 'latest'} -> "
            f"{runs[-1].name}"
        )


def is_scenario_file(path: Path) -> bool:
    """A .toml file with a [scenario] table (or any .toml in a folder named scenarios)."""
    if path.suffix != ".toml":
        return False
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return path.parent.name == "scenarios"
    try:
        return "scenario" in tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        # a broken file where scenarios live, or with a [scenario] table: report it, never skip it
        return (
            path.parent.name == "scenarios"
            or re.search(r"(?m)^\s*\[\s*scenario\s*\]", text) is not None
        )


def pytest_collect_file(file_path: Path, parent):
    if is_scenario_file(file_path):
        return ScenarioFile.from_parent(parent, path=file_path)
    return None


@pytest.hookimpl(tryfirst=True)  # before -k and -m deselect: they apply to these items too
def pytest_collection_modifyitems(session, config, items) -> None:
    spec = config.getoption("--kvchaos-block-manager")
    door = getattr(config, "_kvchaos_door", None)
    if door is not None:  # its check before any run failed: that run, in place of conformance
        items.append(DoorItem.from_parent(session, name="check", nodeid="kvchaos-door::check"))
    elif spec:  # the conformance suite for that manager: one item a property
        from kvchaos.harness.conformance.suite import conformance_items

        items.extend(conformance_items(session, spec))


class ScenarioFile(pytest.File):
    def collect(self):
        from kvchaos.harness.cli import parse_seeds
        from kvchaos.harness.scenario.spec import ScenarioError, load_scenario

        try:
            sc = load_scenario(self.path)
        except ScenarioError as e:
            raise self.CollectError(str(e)) from None
        seeds = parse_seeds(None, self.config.getoption("--kvchaos-seeds")) or sc.scenario.seeds
        known = {line.split(":")[0].split("(")[0].strip() for line in self.config.getini("markers")}
        for (
            m
        ) in sc.markers:  # a scenario's own tags are declared markers (so --strict-markers holds)
            if m not in known:
                self.config.addinivalue_line("markers", f"{m}: tag of kvchaos scenario {sc.name}")
        for seed in seeds:
            item = ScenarioItem.from_parent(
                self, name=f"{sc.name}[seed={seed}]", scenario=sc, seed=seed
            )
            for m in sc.markers:
                item.add_marker(m)
            yield item

    class CollectError(Exception):
        pass

    def repr_failure(self, excinfo):
        if isinstance(excinfo.value, self.CollectError):
            return str(excinfo.value)
        return super().repr_failure(excinfo)


class ScenarioFailure(Exception):
    pass


class ScenarioItem(pytest.Item):
    def __init__(self, *, scenario, seed: int, **kw) -> None:
        super().__init__(**kw)
        self.scenario, self.seed = scenario, seed
        self.user_properties += [("scenario", scenario.name), ("seed", seed)]

    def runtest(self) -> None:
        from kvchaos.harness.run import isolate

        cfg = self.config
        if getattr(cfg, "_kvchaos_door", None) is not None:
            pytest.skip("the block manager failed the check before any run: kvchaos-door::check")
        sizes = getattr(cfg, "_kvchaos_block_sizes", None)
        bs = self.scenario.engine_config().cache.block_size
        if sizes is not None and bs not in sizes:
            pytest.skip(f"not applicable: block_size {bs}; the block manager supports {sizes}")
        isolated = not cfg.getoption("--kvchaos-in-process")
        if isolated:
            isolate.start_server()  # imports in the background: once a session (and xdist worker)
        import torch

        device = cfg.getoption("--kvchaos-device")
        if self.get_closest_marker("gpu") or device.startswith("cuda"):
            if not torch.cuda.is_available():
                pytest.skip("needs a CUDA GPU")
        timeout = cfg.getoption("--kvchaos-timeout")
        r = isolate.run(
            self.scenario,
            self.seed,
            isolated=isolated,
            batch=_batch(cfg),
            device=device,
            report_dir=_report_dir(cfg),
            block_manager_spec=cfg.getoption("--kvchaos-block-manager"),
            timeout_s=options.DEFAULT_TIMEOUT_S if timeout is None else timeout,
        )
        _kept(self, r)
        if r.results.get("reason") == "interrupted":  # Ctrl-C stops the session, not just this run
            raise KeyboardInterrupt
        if r.verdict != "PASS":
            raise ScenarioFailure(r)

    def repr_failure(self, excinfo, style=None):
        if not isinstance(excinfo.value, ScenarioFailure):
            return super().repr_failure(excinfo)
        from kvchaos.harness.report.batch import replay_of

        r = excinfo.value.args[0]
        evidence = (
            "; ".join(f"[{f.checker} @ step {f.step}] {f.message}" for f in r.findings[:3])
            or "no findings"
        )
        return (
            f"{r.verdict}: {r.summary}\nevidence: {evidence}\n"
            f"replay: {replay_of(r)}\nrun folder: {r.run_dir}"
        )

    def reportinfo(self):
        return self.path, None, f"kvchaos {self.scenario.name} seed={self.seed}"


def _kept(item, r) -> None:
    """A run an item made: in the session's list (the index) and the item's properties."""
    if not hasattr(item.config, "_kvchaos_runs"):
        item.config._kvchaos_runs = []
    item.config._kvchaos_runs.append(r.run_dir)
    item.user_properties += [("verdict", r.verdict), ("run_dir", str(r.run_dir))]


class DoorItem(pytest.Item):
    """The FAIL run of a --kvchaos-block-manager that failed the check before any run (a smoke
    call raised or answered what the protocol does not allow): recorded as any run is."""

    def runtest(self) -> None:
        from kvchaos.harness.run.door import door_run

        cfg = self.config
        r = door_run(cfg._kvchaos_door, _report_dir(cfg), index=False, batch=_batch(cfg))
        _kept(self, r)
        raise ScenarioFailure(r)

    repr_failure = ScenarioItem.repr_failure

    def reportinfo(self):
        spec = self.config.getoption("--kvchaos-block-manager")
        return self.path, None, f"kvchaos check before any run of {spec}"


@pytest.fixture
def kvchaos_run(request, tmp_path):
    """Run a scenario (a Scenario, a file path, a built-in name, or a dict in the file's shape)
    with the command line's device and block manager; returns
    kvchaos.harness.run.runner.RunResult. The run folder goes into --kvchaos-report-dir when
    given, else into the test's tmp_path (report_dir=... to choose)."""
    from kvchaos.harness.report.render import publish
    from kvchaos.harness.run.runner import run_scenario
    from kvchaos.harness.scenario.spec import Scenario, load_scenario, parse_scenario

    cfg = request.config

    def run(scenario, seed: int = 0, **kw):
        if isinstance(scenario, dict):
            scenario = parse_scenario(scenario, f"<{request.node.name}>")
        elif not isinstance(scenario, Scenario):
            scenario = load_scenario(scenario)
        kw.setdefault("device", cfg.getoption("--kvchaos-device"))
        given = cfg.getoption("--kvchaos-report-dir")
        kw.setdefault("report_dir", _report_dir(cfg) if given else tmp_path)
        kw.setdefault("block_manager_spec", cfg.getoption("--kvchaos-block-manager"))
        return publish(run_scenario(scenario, seed, **kw))

    return run


@pytest.fixture
def kvchaos_engine(request):
    """Build an Engine (engine.Engine) from an EngineConfig on the configured block manager."""
    from kvchaos.engine.engine import Engine
    from kvchaos.harness.run.user_code import load_object

    spec = request.config.getoption("--kvchaos-block-manager")

    def make(config):
        if not spec:
            return Engine(config)
        cc = config.cache
        return Engine(
            config,
            load_object(spec)(cc.num_blocks, cc.block_size, cc.max_num_seqs, cc.max_blocks_per_seq),
        )

    return make
