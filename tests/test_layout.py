"""The house's rules, checked on the source: imports run one way, along the pipeline (doors ->
tools -> run -> report -> check -> history -> scenario -> faults -> engine), and no module grows
past one idea's size."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# room -> the rooms it may import from (besides itself). The pipeline's stages, each reading only
# the ones below it: a scenario is run into a history, the history is checked, the checks are
# reported. check never imports run (it judges a history, however made); report never imports
# run (analyze is history -> check -> report).
_BELOW = ["engine", "faults", "harness.scenario", "harness.history", "harness.check"]
ALLOWED = {
    "engine": set(),
    "faults": {"engine"},
    "harness.scenario": {"faults", "engine"},
    "harness.history": {"engine"},
    "harness.check": set(_BELOW) - {"harness.check"},
    "harness.report": set(_BELOW),
    "harness.run": {*_BELOW, "harness.report"},  # the worker renders its run's reports
    "harness.conformance": {*_BELOW, "harness.run"},
    "harness.tools": {*_BELOW, "harness.report", "harness.run", "harness.conformance"},
    "harness.bench": {*_BELOW, "harness.report", "harness.run"},
    "harness.adapters": {"engine"},  # a real engine's manager as a block manager
    "harness.doors": {
        *_BELOW,
        "harness.report",
        "harness.run",
        "harness.conformance",
        "harness.tools",
        "harness.bench",
    },
}
DOORS = {"cli.py", "commands.py", "pytest_plugin.py", "__init__.py"}
MAX_LINES = 550  # "about 500": one idea per file


def _room(path: Path) -> str:
    rel = path.relative_to(REPO)
    if rel.parts[0] != "harness":
        return rel.parts[0]
    return "harness.doors" if rel.parts[1] in DOORS else f"harness.{rel.parts[1]}"


def _imports(path: Path) -> set[str]:
    """kvchaos modules imported anywhere in the file (function-level imports included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m.removeprefix("kvchaos.") for m in out if m.startswith("kvchaos.")}


def _target_room(module: str) -> str:
    parts = module.split(".")
    if parts[0] != "harness":
        return parts[0]
    if len(parts) == 1 or parts[1] in ("cli", "commands", "pytest_plugin"):
        return "harness.doors"
    return f"harness.{parts[1]}"


SOURCES = sorted(
    p for folder in ("engine", "faults", "harness") for p in (REPO / folder).rglob("*.py")
)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(REPO)))
def test_imports_run_one_way(path):
    room = _room(path)
    rooms = {m: _target_room(m) for m in _imports(path)}
    wrong = {m for m, r in rooms.items() if r != room and r not in ALLOWED[room]}
    assert not wrong, f"{room} must not import {sorted(wrong)}"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(REPO)))
def test_no_module_outgrows_one_idea(path):
    n = len(path.read_text(encoding="utf-8").splitlines())
    assert n <= MAX_LINES, f"{n} lines: split it by idea"


def test_the_rule_itself_can_fire(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from kvchaos.harness.report.render import publish\n")
    assert _imports(bad) == {"harness.report.render"}
    assert _target_room("harness.report.render") not in ALLOWED["harness.check"]


def _module_of(path: Path) -> str:
    if not path.is_relative_to(REPO):
        return ""
    rel = path.relative_to(REPO).with_suffix("")
    return ".".join(p for p in rel.parts if p != "__init__")


def private_uses(path: Path) -> set[str]:
    """Another kvchaos module's _private names this file uses: imported by name, or read as an
    attribute of a kvchaos module it imported."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    own, out, modules = _module_of(path), set(), {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvchaos."):
            src = node.module.removeprefix("kvchaos.")
            for a in node.names:
                if a.name.startswith("_") and not a.name.startswith("__") and src != own:
                    out.add(f"{src}.{a.name}")
                modules[a.asname or a.name] = f"{src}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("kvchaos.") and a.asname:
                    modules[a.asname] = a.name.removeprefix("kvchaos.")
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and modules[node.value.id] != own
        ):
            out.add(f"{modules[node.value.id]}.{node.attr}")
    return out


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(REPO)))
def test_no_module_uses_another_modules_private_names(path):
    used = private_uses(path)
    assert not used, f"uses another module's private names: {sorted(used)}; make them public"


def test_the_private_rule_can_fire(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from kvchaos.harness.run import runner as r\n"
        "from kvchaos.harness.check.findings import _of\n"
        "x = r._secret\n"
    )
    assert private_uses(bad) == {"harness.check.findings._of", "harness.run.runner._secret"}
