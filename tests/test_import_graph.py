"""The package's modules import each other without cycles, and each imports alone.

The graph is read with ``ast`` from every ``import`` statement in ``datc/``, those inside
functions included (a deferred import that closes a cycle still couples the two modules)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "datc"


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
    assert "datc.training.trainer" in graph["datc.train"]  # imported inside a function
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


# The package's rooms (docs/architecture.md), bottom to top. The math at the bottom imports no other
# ``datc`` module; the rooms in the middle (models, forwards, engines, data, rewards, tasks, the
# run's files, backends) never reach up into the step, the session and loop, or the tools above
# them; the step never reaches into the session and loop.
def _room(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


PURE_MATH = tuple(n for n in MODULES if _room(n) == "math")
ABOVE_THE_MIDDLE = {"step", "training", "train", "analysis", "report", "__main__"}
# Entry points: the commands' own modules (``python -m datc`` runs the first). Nothing else imports them.
ENTRY_POINTS = {"datc.train"}


def test_the_rooms_exist_and_the_top_level_holds_only_the_shared_leaves():
    rooms = {_room(n) for n in MODULES}
    assert {"math", "run", "models", "forward", "engines", "data", "backends", "training", "step", "credit"} <= rooms
    top = sorted(n for n in MODULES if n.count(".") == 1 and not (PKG / _room(n)).is_dir())
    assert top == ["datc.__main__", "datc.config", "datc.errors", "datc.paths", "datc.registry", "datc.train",
                   "datc.utils"], top


def test_the_middle_rooms_never_reach_up_into_the_step_the_loop_or_the_tools():
    bad = sorted(f"{m} -> {d}" for m, deps in import_graph().items() if _room(m) not in ABOVE_THE_MIDDLE
                 for d in deps if _room(d) in ABOVE_THE_MIDDLE)
    assert not bad, bad


def test_the_step_never_reaches_into_the_session_and_loop():
    bad = sorted(f"{m} -> {d}" for m, deps in import_graph().items() if _room(m) == "step"
                 for d in deps if _room(d) in {"training", "train", "analysis", "report"})
    assert not bad, bad


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
