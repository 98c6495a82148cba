"""``python -m datc.study``: the same command as ``datc-study``."""

from datc.study.cli import main

main()
