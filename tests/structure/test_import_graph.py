"""The package's modules import each other without cycles, and each imports alone.

The graph is read with ``ast`` from every ``import`` statement in ``datc/``, those inside
functions included (a deferred import that closes a cycle still couples the two modules)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "datc"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _imports(name: str, path: Path) -> set[str]:
    """The ``datc`` modules that module ``name`` imports (``from pkg import mod`` counts as mod)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}
    return {m for m in out if m in MODULES and m != name}


def _room(name: str) -> str:
    """A module's room: its folder under ``datc/``, or the module itself at the top level."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


def import_graph() -> dict[str, set[str]]:
    return {name: _imports(name, path) for name, path in MODULES.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a list of nodes (first == last), or None if it is acyclic."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(u: str) -> list[str] | None:
        state[u] = 1
        path.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == 1:
                return path[path.index(v):] + [v]
            if v not in state and (cycle := visit(v)):
                return cycle
        path.pop()
        state[u] = 2
        return None

    for u in sorted(graph):
        if u not in state and (cycle := visit(u)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_the_graph_sees_deferred_and_package_imports():
    graph = import_graph()
    assert "datc.training.trainer" in graph["datc.training.job"]  # imported inside a function
    assert "datc.credit.base" in graph["datc.analysis.inputs"]


def test_the_credit_package_imports_no_model_session_or_trainer_code():
    # datc.credit is pure: schemes, their math and the credit config group, tested with hand-made tensors
    allowed = {"datc.registry", "datc.paths", "datc.errors"}  # and the pure math below it (errors: the bottom, no imports)
    for name, deps in import_graph().items():
        if name == "datc.credit" or name.startswith("datc.credit."):
            outside = {d for d in deps if not d.startswith(("datc.credit", "datc.math")) and d not in allowed}
            assert not outside, f"{name} imports {sorted(outside)}"


def test_the_analysis_sits_above_the_trainer():
    graph = import_graph()
    below = {n: deps for n, deps in graph.items() if n != "datc.analysis" and not n.startswith("datc.analysis.")}
    users = sorted(n for n, deps in below.items() if any(d == "datc.analysis" or d.startswith("datc.analysis.") for d in deps))
    assert not users, f"{users} import datc.analysis, which is above them"
    # the calls into the trainer and the session are all in one module
    callers = sorted(n for n, deps in graph.items() if n.startswith("datc.analysis.") and deps & {"datc.training.trainer", "datc.training.session"})
    assert callers == ["datc.analysis.inputs"], callers


def test_the_package_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.slow
def test_every_module_imports_alone_in_a_fresh_interpreter():
    # One interpreter per module would take minutes (torch loads in each); a fresh module table
    # per module inside one interpreter checks the same thing: no module needs another to have
    # been imported first. ``__main__`` modules run their command when imported: not imported.
    names = sorted(n for n in MODULES if not n.endswith("__main__"))
    code = (
        "import importlib, sys\n"
        f"names = {names!r}\n"
        "for n in names:\n"
        "    for k in [k for k in sys.modules if k == 'datc' or k.startswith('datc.')]:\n"
        "        del sys.modules[k]\n"
        "    importlib.import_module(n)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=PKG.parent, timeout=600)


# The package's floors (docs/architecture.md), bottom to top: each a set of rooms (a folder of
# ``datc/``, or a module at its top). Every import, deferred ones included, stays in its room or
# goes down to a lower floor; rooms on one floor never import each other. The one exception is the
# package's face, ``datc/__init__.py``, which registers the run-name resolver before any config
# is composed.
FLOORS: list[set[str]] = [
    {"errors", "paths", "registry", "atomic", "hashing", "utils", "math", "batch"},  # ground: no other datc import
    {"config", "credit", "tasks"},  # the schema and its field checks; the pure credit schemes; the tasks
    {"data", "models", "run"},  # prompts; models, tokenizers, chat and RM inputs; a run's files
    {"backends", "report"},  # processes and the optimizer step; datc-compare's tables
    {"engines"},  # what samples a rollout
    {"rewards"},  # the frozen reward model's scores, and rules
    {"forward", "checks", "prepare"},  # passes over a batch; the whole config check; the prepare step
    {"step", "commands"},  # the step's phases and plan; datc-prepare, datc-export, datc-launch
    {"memory"},  # the memory plan (reading the step plan) and the micro-batch by memory
    {"training"},  # the session and the loop around the step
    {"train", "analysis"},  # datc-train; the analysis commands
    {"study"},  # datc-study: METHOD §6's tuned comparison, run through Hydra's launchers and read back
    {"compare", "__main__"},  # datc-compare (the report's command, and the study's tables with --tuned)
]
FACE = "datc"  # datc/__init__.py
PURE_MATH = tuple(n for n in MODULES if _room(n) == "math")
# Entry points: the commands' own modules (``python -m datc`` runs the first). Nothing else imports them.
ENTRY_POINTS = {"datc.train"}


def test_every_room_is_on_exactly_one_floor():
    rooms = {_room(n) for n in MODULES if n != FACE}
    named = [room for floor in FLOORS for room in floor]
    assert len(named) == len(set(named)), "a room named on two floors"
    assert rooms == set(named), f"rooms on no floor: {sorted(rooms - set(named))}; floors naming no room: {sorted(set(named) - rooms)}"


def not_going_down(graph: dict[str, set[str]], floors: list[set[str]]) -> list[str]:
    """The imports of ``graph`` that leave their room for one on the same floor or higher."""
    floor = {room: i for i, rooms in enumerate(floors) for room in rooms}
    return sorted(f"{m} -> {d} (floor {floor[_room(m)]} -> {floor[_room(d)]})"
                  for m, deps in graph.items() if m != FACE
                  for d in deps if _room(d) != _room(m) and floor[_room(d)] >= floor[_room(m)])


def test_every_import_stays_in_its_room_or_goes_down():
    bad = not_going_down(import_graph(), FLOORS)
    assert not bad, "imports that do not go down:\n" + "\n".join(bad)


def test_the_floor_rule_refuses_an_import_that_goes_up_or_sideways():
    floors = [{"a"}, {"b", "c"}, {"d"}]
    fine = {"datc.d.x": {"datc.b.y", "datc.a.z", "datc.d.w"}, "datc.b.y": {"datc.a.z"}, "datc": {"datc.d.x"}}
    assert not_going_down(fine, floors) == []
    assert not_going_down({"datc.a.z": {"datc.b.y"}}, floors) == ["datc.a.z -> datc.b.y (floor 0 -> 1)"]  # up
    assert not_going_down({"datc.b.y": {"datc.c.q"}}, floors) == ["datc.b.y -> datc.c.q (floor 1 -> 1)"]  # sideways


def test_the_rooms_import_each_other_without_a_cycle():
    rooms: dict[str, set[str]] = {}
    for m, deps in import_graph().items():
        if m != FACE:
            rooms.setdefault(_room(m), set()).update(_room(d) for d in deps if _room(d) != _room(m))
    cycle = find_cycle(rooms)
    assert cycle is None, "room cycle: " + " -> ".join(cycle)


def test_no_module_is_over_about_400_lines():
    long = {n: len(p.read_text().splitlines()) for n, p in MODULES.items()}
    assert not {n: k for n, k in long.items() if k > 410}, {n: k for n, k in long.items() if k > 410}


def test_the_pure_math_imports_no_other_datc_module_but_the_pure_ones():
    graph = import_graph()
    for name in PURE_MATH:
        outside = {d for d in graph[name] if d not in PURE_MATH}
        assert not outside, f"{name} imports {sorted(outside)}"


def test_nothing_imports_an_entry_point():
    graph = import_graph()
    bad = sorted(f"{m} -> {d}" for m, deps in graph.items() if m != "datc.__main__" for d in deps & ENTRY_POINTS)
    assert not bad, "entry points imported: " + ", ".join(bad)
