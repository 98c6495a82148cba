"""The tests share their helpers through tests/helpers/ alone: no test module imports another test
module or a conftest.py (pytest loads those itself, and a test module imported by another runs
its tests' module code twice and ties the two together), and what helpers and conftests import
of the tests is helpers too. Read with ``ast`` from every ``import`` statement, those inside
functions included."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ALLOWED = "tests.helpers"


def _imported(node: ast.Import | ast.ImportFrom, module: str) -> list[str]:
    """The modules an import statement of ``module`` names (``from a import b``: ``a.b``, which
    may be a module or a name of ``a``)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        package = module.split(".")[: len(module.split(".")) - node.level]
        base = ".".join(package + ([base] if base else []))
    return [f"{base}.{a.name}" for a in node.names]


def _allowed(name: str) -> bool:
    return name == ALLOWED or name.startswith(ALLOWED + ".")


def bad_imports(path: Path, root: Path = TESTS) -> list[str]:
    """The imports of test modules (or conftests) that ``path`` makes: ``tests.*`` outside
    ``tests.helpers``, with their line numbers."""
    module = ".".join(path.relative_to(root.parent).with_suffix("").parts)
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for name in _imported(node, module):
                if (name == "tests" or name.startswith("tests.")) and not _allowed(name):
                    out.append(f"{path.relative_to(root.parent)}:{node.lineno}: {name}")
    return out


def test_the_check_refuses_a_test_module_and_a_conftest_and_takes_helpers(tmp_path):
    pkg = tmp_path / "tests"
    (pkg / "room").mkdir(parents=True)
    bad = pkg / "room" / "test_bad.py"
    bad.write_text("import os\nfrom tests.helpers.runs import metric_rows\nfrom tests.helpers import cli\n"
                   "import tests.helpers.testbed\nfrom tests.conftest import cfg_for\n"
                   "def f():\n    from tests.room.test_other import X\n    from . import test_other\n"
                   "    from ..helpers import shared\n    from tests import cli\n")
    assert bad_imports(bad, pkg) == ["tests/room/test_bad.py:5: tests.conftest.cfg_for",
                                     "tests/room/test_bad.py:7: tests.room.test_other.X",
                                     "tests/room/test_bad.py:8: tests.room.test_other",
                                     "tests/room/test_bad.py:10: tests.cli"]


def test_no_test_module_imports_another_or_a_conftest():
    files = sorted(TESTS.rglob("test_*.py"))
    assert len(files) > 50 and all("helpers" not in f.relative_to(TESTS).parts for f in files)
    bad = [b for f in files for b in bad_imports(f)]
    assert not bad, "import these from tests/helpers/ instead:\n" + "\n".join(bad)


def test_helpers_and_conftests_import_only_helpers_of_the_tests():
    files = sorted(TESTS.rglob("conftest.py")) + sorted((TESTS / "helpers").rglob("*.py"))
    bad = [b for f in files for b in bad_imports(f)]
    assert not bad, "\n".join(bad)


def test_every_test_folder_is_a_package():
    # pytest imports test modules by their package path: without __init__.py two test modules
    # of one basename in two folders would clash
    folders = {f.parent for f in TESTS.rglob("*.py")} | {TESTS}
    assert not [str(d) for d in folders if not (d / "__init__.py").exists()]
