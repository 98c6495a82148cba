"""``python -m datc.report``: the same command as ``datc-compare``."""

from datc.report import main

main()
