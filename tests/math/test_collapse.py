"""The length collapse of METHOD §6 (datc/math/collapse.py): flagged on a hand-made metric
sequence as it happens, kept across a resume, summarized, and marked in datc-compare's table."""

from __future__ import annotations

from datc.math.collapse import FIRST_KEY, LEN_KEY, CollapseWatch, collapse_record, is_collapsed
from datc.report import build_report, markdown_table, run_from_summary


def rows(lengths, firsts=None):
    firsts = firsts or [0.0] * len(lengths)
    return [{"step": i + 1, LEN_KEY: n, FIRST_KEY: f} for i, (n, f) in enumerate(zip(lengths, firsts, strict=True))]


def test_the_flag_fires_below_half_the_step0_length_or_above_half_first_token_ends():
    watch = CollapseWatch()
    seq = rows([10.0, 8.0, 5.0, 4.99, 6.0, 6.0], [0.0, 0.0, 0.0, 0.0, 0.5, 0.51])
    flags, warnings = [], []
    for r in seq:
        flags.append(watch.update(r["step"], r))
        warnings.append(watch.warning(r["step"]) if flags[-1][0] else None)
    # 5.0 is half of 10 (not below); 4.99 is; a first-token fraction of 0.5 is not above half, 0.51 is
    assert [f for f, _ in flags] == [0, 0, 0, 1, 0, 1]
    assert [first for _, first in flags] == [False, False, False, True, False, False]  # one warning, at step 4
    assert watch.initial_len == 10.0 and watch.first_step == 4
    assert "at step 4: mean response length 4.99 tokens, below 0.5 x its step-0 value 10.00 (" in warnings[3]
    assert "at step 6: 51% of the batch ended at its first token (" in warnings[5]
    assert not is_collapsed(None, None, 10.0) and not is_collapsed(4.0, None, None)  # missing values take no part


def test_a_resumed_run_keeps_its_step0_and_does_not_warn_again():
    seq = rows([12.0, 5.0, 11.0])
    watch = CollapseWatch.from_rows(seq)
    assert watch.initial_len == 12.0 and watch.first_step == 2
    assert watch.update(4, {LEN_KEY: 5.5, FIRST_KEY: 0.0}) == (1, False)  # still measured against 12 tokens


def test_the_summary_record_and_the_table_mark():
    assert collapse_record(rows([10.0, 12.0, 11.0])) == {"step": None, "steps_flagged": 0, "initial_len": 10.0,
                                                         "final_len": 11.0}
    rec = collapse_record(rows([10.0, 4.0, 1.0], [0.0, 0.2, 0.9]))
    assert rec == {"step": 2, "steps_flagged": 2, "initial_len": 10.0, "final_len": 1.0}

    def summary(credit, seed, collapse):
        return {"run_name": f"{credit}-{seed}", "seed": seed, "credit": credit, "data": "keywords", "policy": "tiny_gpt2",
                "eval": {"final": {"eval/gold": 0.1 * seed}}, "length_collapse": collapse}

    runs = [run_from_summary(summary(c, s, rec if (c, s) == ("datc", 2) else {"step": None}), "x", 0.0, "x")
            for c in ("grpo", "datc") for s in (0, 1, 2)]
    table = markdown_table(build_report(runs))
    line = next(ln for ln in table.splitlines() if ln.startswith("| keywords / tiny_gpt2 | datc |"))
    assert line.rstrip(" |").endswith("3 (1 collapsed: seed 2)")
    grpo = next(ln for ln in table.splitlines() if ln.startswith("| keywords / tiny_gpt2 | grpo |"))
    assert grpo.rstrip(" |").endswith("| 3") and "collapsed" not in grpo
