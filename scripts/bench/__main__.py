"""``python -m scripts.bench``: see :mod:`scripts.bench`."""

from scripts.bench.cli import main

main()
