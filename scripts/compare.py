"""Compare runs across settings and credit schemes; see :mod:`datc.report`.

Usage: python scripts/compare.py ROOT [ROOT ...] --out results/four_settings
       [--wandb-project ENTITY/PROJECT] [--baseline grpo]
"""

from datc.report import main

if __name__ == "__main__":
    main()
