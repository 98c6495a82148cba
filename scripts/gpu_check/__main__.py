"""``python -m scripts.gpu_check``: see :mod:`scripts.gpu_check.check`."""

import sys

from scripts.gpu_check.check import main

sys.exit(main())
