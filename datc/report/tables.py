"""The comparison as text: the Markdown and LaTeX tables, the summary, the runs' CSV and the
JSON of every number computed."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from datc.report.loading import CSV_FIELDS, METRICS, Run
from datc.report.statistics import (
    CONFIDENCE,
    PAIRED_METRICS,
    TREATMENT,
    Interval,
    Report,
    Row,
    Verdict,
)

MIN_INTERVAL_N = 3  # fewer values: no interval is shown (two give a t-interval 12.7 SDs wide)


@dataclass(frozen=True)
class Cell:
    """Table cell text (``±`` and ``Δ`` are turned into LaTeX math by the LaTeX writer)."""

    text: str
    bold: bool = False


def _interval_text(iv: Interval, n_runs: int, signed: bool = False) -> str:
    if iv.mean is None:
        return "n/a"
    mean = f"{iv.mean:+.3f}" if signed else f"{iv.mean:.3f}"
    if iv.n < MIN_INTERVAL_N:  # a t-interval on one degree of freedom is wider than it is useful: the mean and its n
        return f"{mean} (n={iv.n})"
    # Say so when a value is missing from some of the row's runs.
    return f"{mean} ± {iv.half_width:.3f}" + (f" (n={iv.n})" if iv.n < n_runs else "")


def table_cells(report: Report) -> tuple[list[str], list[list[Cell]]]:
    """The comparison table as a header and rows of cells, shared by Markdown and LaTeX."""
    b = report.baseline
    header = ["setting", "scheme"]
    for m in METRICS:
        header.append(m.label)
        if m.key in PAIRED_METRICS:
            header.append(f"Δ {m.label} vs {b}")
    header.append("n seeds")
    body = []
    for row in report.rows:
        has_base = any(r.setting == row.setting and r.scheme == b for r in report.rows)
        cells = [Cell(row.setting), Cell(row.scheme)]
        for m in METRICS:
            cells.append(Cell(_interval_text(row.cells[m.key], row.n_runs)))
            if m.key not in PAIRED_METRICS:
                continue
            if row.scheme == b:
                cells.append(Cell("(baseline)"))
            elif not has_base:
                cells.append(Cell(f"n/a (no {b} run)"))
            elif not row.vs_baseline[m.key].seeds:
                cells.append(Cell("n/a (no shared seed)"))
            else:
                pd = row.vs_baseline[m.key]
                cells.append(Cell(_interval_text(pd.diff, row.n_runs, signed=True), pd.significant and pd.diff.n >= MIN_INTERVAL_N))
        cells.append(Cell(str(row.n_runs) + collapse_note(row.collapsed)))
        body.append(cells)
    return header, body


def collapse_note(collapsed: Sequence[int | str]) -> str:
    """`` (k collapsed: seeds ...)`` after a count of runs, where some collapsed in length (METHOD §6)."""
    if not collapsed:
        return ""
    return f" ({len(collapsed)} collapsed: seed{'s' if len(collapsed) > 1 else ''} {', '.join(map(str, collapsed))})"


LEGEND = (
    "Cells: mean ± half-width of the 95% Student-t interval over seeds (below 3 values the mean "
    "and its (n=k) alone; (n=k) also where the value is missing from some runs). Δ: paired by seed, scheme minus baseline, "
    "mean ± 95% t half-width; bold where the interval excludes zero. Credit accuracy is "
    "undefined for uniform weights (GRPO): n/a. (k collapsed: seeds ...) after n seeds: k of the row's runs had a length "
    "collapse (METHOD §6: mean response length below half of its step-0 value, or more than half of a batch "
    "ending at its first token); their values are in the row's means, so read them with that mark."
)


def markdown_table(report: Report) -> str:
    header, body = table_cells(report)

    def md(c: Cell) -> str:
        return f"**{c.text}**" if c.bold else c.text

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(md(c) for c in cells) + " |" for cells in body]
    return f"{LEGEND}\n\n" + "\n".join(lines) + "\n"


TEX_ESCAPES = {
    "\\": r"\textbackslash{}",
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\^{}",
    "±": r"$\pm$",
    "Δ": r"$\Delta$",
    "≥": r"$\geq$",
}


def _tex(text: str) -> str:
    return "".join(TEX_ESCAPES.get(ch, ch) for ch in text)


def latex_table(report: Report) -> str:
    """A booktabs ``tabular`` to ``\\input`` into a table float (needs booktabs)."""
    header, body = table_cells(report)

    def tex(c: Cell) -> str:
        return rf"\textbf{{{_tex(c.text)}}}" if c.bold else _tex(c.text)

    lines = [
        f"% {LEGEND}",
        r"\begin{tabular}{ll" + "r" * (len(header) - 2) + "}",
        r"\toprule",
        " & ".join(_tex(h) for h in header) + r" \\",
        r"\midrule",
    ]
    lines += [" & ".join(tex(c) for c in cells) + r" \\" for cells in body]
    lines += [r"\bottomrule", r"\end{tabular}"]
    return "\n".join(lines) + "\n"


PLOTS = {
    "gold_curves.png": "Held-out gold during training",
    "credit_accuracy.png": "Credit accuracy",
    "rm_vs_gold.png": "Final RM score against final gold",
}


def summary_markdown(report: Report) -> str:
    b = report.baseline.upper()
    lines = [
        f"# Every scheme vs {b}",
        "",
        f'A scheme "beat" {b} where the 95% Student-t interval of its mean paired difference in final '
        f"held-out gold (the scheme minus {b}, paired by seed) excludes zero and the mean is positive; it "
        '"lost to" it where the interval excludes zero and the mean is negative; otherwise the difference '
        "is not resolved.",
        "",
    ]
    lines += [f"- {v.sentence}" for v in report.verdicts]
    lines += [
        "",
        "All settings and schemes: [table.md](table.md) ([LaTeX](table.tex)); numbers in "
        "[report.json](report.json); the runs in [runs.csv](runs.csv).",
        "",
        "## Plots",
        "",
    ]
    lines += [f"![{title}]({name})\n" for name, title in PLOTS.items()]
    return "\n".join(lines)


def runs_csv(runs: Sequence[Run]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=CSV_FIELDS, lineterminator="\n")
    writer.writeheader()
    for run in sorted(
        runs, key=lambda r: (r.data, r.policy, r.credit, r.seed is None, r.seed or 0, r.run_name)
    ):
        writer.writerow({k: "" if (v := getattr(run, k)) is None else v for k in CSV_FIELDS})
    return buf.getvalue()


def report_json(report: Report, warnings: Sequence[str]) -> str:
    def row(r: Row) -> dict[str, Any]:
        return {
            "setting": r.setting,
            "data": r.data,
            "policy": r.policy,
            "scheme": r.scheme,
            "n_runs": r.n_runs,
            "seeds": list(r.seeds),
            "metrics": {k: asdict(iv) for k, iv in r.cells.items()},
            "length_collapsed": list(r.collapsed),
            "vs_baseline": {
                k: {**asdict(pd.diff), "seeds": list(pd.seeds), "significant": pd.significant}
                for k, pd in r.vs_baseline.items()
            },
        }

    def verdict(v: Verdict) -> dict[str, Any]:
        d = v.diff
        return {
            "setting": v.setting,
            "treatment": v.treatment,
            "baseline": v.baseline,
            "has_treatment": v.has_treatment,
            "has_baseline": v.has_baseline,
            "final_gold_diff": None
            if d is None
            else {**asdict(d.diff), "seeds": list(d.seeds), "significant": d.significant},
            "sentence": v.sentence,
        }

    obj = {
        "confidence": CONFIDENCE,
        "baseline": report.baseline,
        "treatment": TREATMENT,
        "rows": [row(r) for r in report.rows],
        "verdicts": [verdict(v) for v in report.verdicts],
        "warnings": list(warnings),
    }
    return json.dumps(obj, indent=2) + "\n"
