"""The shared provenance of results files (datc.run.provenance): the commit of a checkout, with
``+dirty`` when a tracked file changed, the machine and the load, and the keys every results
file gets."""

from __future__ import annotations

import datetime
import subprocess
import sys
from pathlib import Path

import pytest

from datc.run.provenance import git_commit, load_average, machine, package_version, provenance

ROOT = Path(__file__).resolve().parents[2]


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args], cwd=cwd,
                          capture_output=True, text=True, check=True).stdout.strip()


def test_the_commit_of_this_checkout_is_its_head():
    # the suite runs from a clone (make test, CI): git and the checkout are part of its environment
    head = _git(ROOT, "rev-parse", "HEAD")
    dirty = bool(_git(ROOT, "status", "--porcelain", "--untracked-files=no"))
    assert git_commit() == head + ("+dirty" if dirty else "")
    assert git_commit(short=True) == _git(ROOT, "rev-parse", "--short", "HEAD") + ("+dirty" if dirty else "")


def test_the_run_summary_reports_the_full_commit():
    from datc.training.lifecycle import GIT_COMMIT

    assert GIT_COMMIT == git_commit()


def test_a_changed_tracked_file_makes_the_commit_dirty(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    _git(tmp_path, "init", "-q")
    (tmp_path / "a.txt").write_text("one\n")
    _git(tmp_path, "add", "a.txt")
    _git(tmp_path, "commit", "-q", "-m", "first")
    head = _git(tmp_path, "rev-parse", "HEAD")
    assert git_commit(cwd=tmp_path) == head
    assert git_commit(short=True, cwd=tmp_path) == _git(tmp_path, "rev-parse", "--short", "HEAD")
    (tmp_path / "new.txt").write_text("untracked\n")  # an untracked file is not a change of the code
    assert git_commit(cwd=tmp_path) == head
    (tmp_path / "a.txt").write_text("two\n")
    assert git_commit(cwd=tmp_path) == head + "+dirty"


def test_outside_a_checkout_there_is_no_commit(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert git_commit(cwd=tmp_path) is None


def test_without_git_there_is_no_commit(monkeypatch):
    monkeypatch.setenv("PATH", "")
    assert git_commit() is None


def test_provenance_has_the_shared_keys():
    p = provenance("python scripts/x.py --steps 2", "pytest", "no-such-package-datc", threads=1)
    assert list(p) == ["command", "commit", "date", "machine", "load_average"]
    assert p["command"] == "python scripts/x.py --steps 2"
    assert p["commit"] == git_commit(short=True)
    assert datetime.date.fromisoformat(p["date"]) == datetime.date.today()
    m = p["machine"]
    assert {"python", "torch", "cpus", "cpu"} <= set(m)
    assert m["python"] == ".".join(map(str, sys.version_info[:3])) and m["cpus"] >= 1
    assert m["pytest"] == pytest.__version__ and m["no-such-package-datc"] is None and m["threads"] == 1
    assert all(isinstance(x, float) and round(x, 2) == x for x in p["load_average"])


def test_machine_and_load_average_alone():
    import torch

    assert machine()["torch"] == torch.__version__
    assert machine(platform="x") == {**machine(), "platform": "x"}
    assert package_version("no-such-package-datc") is None
    assert len(load_average()) in (0, 3)


def test_importing_the_module_imports_no_torch():
    code = "import sys, datc.run.provenance; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
