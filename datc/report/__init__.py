"""Compare finished runs across settings and credit schemes: tables, a summary, plots.

Runs come from the ``summary.json`` files the trainer writes (found by ``**/summary.json`` under
one or more root directories) and, optionally, from a W&B project. A *setting* is the pair
``(data, policy)``, a *scheme* is ``credit``; runs of one scheme in one setting with different
seeds are replicates. Written under ``--out``:

- ``table.md``, ``table.tex``: one row per (setting, scheme) with final held-out gold, gold
  AUC, final RM score, final KL, credit accuracy, step time and the number of seeds, plus the
  paired difference to the baseline for final gold and gold AUC (bold where significant).
- ``summary.md``: one sentence per setting on whether DATC beat the baseline on final gold.
- ``gold_curves.png``, ``credit_accuracy.png``, ``rm_vs_gold.png``.
- ``runs.csv``: one row per run with the fields used; ``report.json``: every number computed.

Statistics: a cell is the mean over seeds ± the half-width of the 95% Student-t interval,
``t.ppf(0.975, n-1) * sd(ddof=1) / sqrt(n)``, undefined for n = 1. The comparison with the
baseline pairs runs by seed (seeds where both runs have the value) and gives the mean of the
per-seed differences (scheme minus baseline) with its own t interval; it is *significant*
when that interval excludes zero.

Layout: :mod:`datc.report.loading` (runs from summaries and W&B), :mod:`datc.report.statistics`
(intervals, paired differences, the :class:`Report`), :mod:`datc.report.tables` (text outputs),
:mod:`datc.report.plots` (PNGs) and :mod:`datc.report.cli` (write them all; the command ``datc-compare`` is :mod:`datc.compare`).
"""

from __future__ import annotations

from datc.report.cli import write_atomic, write_outputs
from datc.report.loading import (
    CSV_FIELDS,
    METRICS,
    UNIFORM_CREDIT,
    UNKNOWN,
    CurvePoint,
    LoadResult,
    Metric,
    Run,
    deduplicate,
    gold_auc,
    load_run_dirs,
    load_wandb,
    run_from_summary,
    summary_from_wandb,
)
from datc.report.plots import MARKERS, plot_credit_accuracy, plot_gold_curves, plot_rm_vs_gold
from datc.report.statistics import (
    CONFIDENCE,
    PAIRED_METRICS,
    TREATMENT,
    CurveBand,
    Interval,
    PairedDifference,
    Report,
    Row,
    Verdict,
    build_report,
    curve_band,
    paired_difference,
    t_interval,
)
from datc.report.tables import (
    LEGEND,
    PLOTS,
    TEX_ESCAPES,
    Cell,
    latex_table,
    markdown_table,
    report_json,
    runs_csv,
    summary_markdown,
    table_cells,
)

__all__ = [
    "CONFIDENCE", "CSV_FIELDS", "LEGEND", "MARKERS", "METRICS", "PAIRED_METRICS", "PLOTS", "TEX_ESCAPES", "TREATMENT",
    "UNIFORM_CREDIT", "UNKNOWN", "Cell", "CurveBand", "CurvePoint", "Interval", "LoadResult", "Metric",
    "PairedDifference", "Report", "Row", "Run", "Verdict", "build_report", "curve_band", "deduplicate", "gold_auc",
    "latex_table", "load_run_dirs", "load_wandb", "markdown_table", "paired_difference", "plot_credit_accuracy",
    "plot_gold_curves", "plot_rm_vs_gold", "report_json", "run_from_summary", "runs_csv", "summary_from_wandb",
    "summary_markdown", "t_interval", "table_cells", "write_atomic", "write_outputs",
]
