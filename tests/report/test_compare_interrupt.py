"""A Ctrl-C in ``datc-compare``'s first second (while its report's modules import) is its one
line and exit status 130, as later (issue 57)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# the console script's own steps (import the entry point, call it), with a Ctrl-C arriving while
# the report's modules import
SCRIPT = """
import builtins, sys
real = builtins.__import__
def interrupted(name, *args, **kwargs):
    if name.startswith("datc.report"):
        raise KeyboardInterrupt
    return real(name, *args, **kwargs)
builtins.__import__ = interrupted
from datc.compare import main
sys.argv = ["datc-compare", "runs", "--out", "out"]
main()
"""


def test_a_ctrl_c_while_datc_compare_imports_is_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, cwd=tmp_path, timeout=120,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 130, r.stderr[-3000:]
    assert r.stderr.strip().splitlines() == ["datc-compare: interrupted (SIGINT); nothing was written (what --out held is as "
                                             "it was)"], r.stderr[-3000:]
    assert not (tmp_path / "out").exists()


def test_the_put_in_place_words_are_the_reports():
    from datc.compare import PUT_IN_PLACE
    from datc.report.cli import PUT_IN_PLACE as REPORTS

    assert PUT_IN_PLACE == REPORTS
