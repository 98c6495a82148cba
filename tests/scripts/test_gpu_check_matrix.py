"""The GPU check's matrix and its parts that need no run: the default matrix fits one lent
device's 10 minutes, holds every case built since the first run, and orders them first; the
verdicts say what a case showed in one line; a case's result.json is written once and whole
(two writers once left it empty: the rehearsal's intermittent JSONDecodeError)."""

from __future__ import annotations

import argparse
import json
import threading
from pathlib import Path

import pytest

from scripts.gpu_check import cases as gc_cases
from scripts.gpu_check.check import REAL, TINY
from scripts.gpu_check.kit import PURE
from scripts.gpu_check.matrix import DEFAULT_BUDGET_S, build_cases, verdict

NEW = {"train/qwen3/grpo/none/lora", "train/llama32/grpo/none/lora", "train/qwen3/grpo/none/async", "determinism/qwen3",
       "train/qwen3/grpo/fsdp2", "train/qwen3/grpo/fsdp2/2ranks"}


def _args(**kw) -> argparse.Namespace:
    base = dict(families=["qwen3", "llama32"], credits=["grpo", "datc"], stages=["none", "zero2", "zero3", "fsdp2"],
                engines=["torch"], tiny=False, full=False, inject_failures=False)
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize("gpus", [1, 2])
def test_the_default_matrix_fits_ten_minutes_and_runs_what_was_built_since_first(tmp_path, gpus):
    cases = build_cases(_args(), REAL, tmp_path, gpus)
    names = [c.name for c in cases]
    assert NEW <= set(names)
    assert {"train/qwen3/grpo/zero2", "train/qwen3/grpo/zero3", "train/qwen3/grpo/none"} <= set(names)  # the comparators
    run = [c for c in cases if not (c.kind == "ranks" and gpus < c.spec["nproc"])]  # skipped on one GPU, at no cost
    total = sum(c.est_s for c in run)
    assert total <= DEFAULT_BUDGET_S + (70 if gpus > 1 else 0), total  # two GPUs: the deadline cuts ZeRO-3, the last
    assert DEFAULT_BUDGET_S <= 600 - 45  # the kit's install and the report's writing inside the 10 minutes
    assert names[-1] == "train/qwen3/grpo/zero3"  # the dearest case last: a cut loses it, not a new one
    assert max(names.index(n) for n in NEW) < names.index("credit/qwen3")


def test_the_full_and_tiny_matrices_hold_every_earlier_case_too(tmp_path):
    names = {c.name for c in build_cases(_args(tiny=True), TINY, tmp_path, 0)}
    assert NEW <= names and "train/qwen3/datc/zero3" in names and "decode/llama32" in names and "synced/qwen3/gathered" in names
    assert "fused_adam" in {c.name for c in build_cases(_args(full=True), REAL, tmp_path, 1)}


def test_the_kit_carries_peft_for_the_lora_cases():
    assert "peft" in PURE


def _train_result(step, rollout, update, peak, total, rollout_total, **kw):
    return {"status": "ok", "device": "NVIDIA H200", "plan": {"gib": peak * 1.05},
            "summary": {"step_s": step, "rollout_s": rollout, "update_s": update, "peak_mem_gib": peak,
                        "total_s": total, "rollout_total_s": rollout_total}, **kw}


def test_the_asynchronous_verdict_says_whether_sampling_overlapped_the_update():
    base = _train_result(6.0, 4.0, 1.0, 22.5, 14.0, 9.0)
    same_stream = {"own_stream": False}
    serial = _train_result(6.1, 0.1, 1.0, 29.0, 14.2, 4.0, **{"async": same_stream})
    line = verdict("train/qwen3/grpo/none/async", serial, {"train/qwen3/grpo/none": base})
    assert "does not overlap" in line and "shares the trainer's CUDA stream" in line and "peak 29.00 GiB" in line
    assert serial["overlap"]["overlaps"] is False
    overlapped = _train_result(3.0, 0.1, 1.0, 29.0, 8.0, 4.0, **{"async": same_stream})
    assert verdict("train/qwen3/grpo/none/async", overlapped, {"train/qwen3/grpo/none": base}).count("overlaps:") == 1


def test_the_determinism_and_stage_verdicts():
    base = {"train/qwen3/grpo/none": _train_result(6.0, 4.0, 1.0, 22.5, 14.0, 9.0)}
    equal = {"status": "ok", "steps": 2, "metrics_equal": True, "params_equal": True, "unequal_metrics": [],
             "params_diff": {"unequal_tensors": 0, "tensors": 10, "max_abs_diff": 0.0}, "step_s": 7.5}
    assert verdict("determinism/qwen3", equal, base) == (
        "two identical runs of 2 steps: EQUAL bit for bit; step 7.50 s against 6.00 s by default (+25%)")
    unequal = {**equal, "metrics_equal": False, "params_equal": False, "unequal_metrics": ["loss/total"],
               "params_diff": {"unequal_tensors": 3, "tensors": 10, "max_abs_diff": 1e-7}}
    assert "NOT equal: metrics loss/total; parameters 3 of 10 tensors differ" in verdict("determinism/qwen3", unequal, base)
    fsdp = verdict("train/qwen3/grpo/fsdp2", _train_result(7.0, 4.0, 2.0, 30.0, 15.0, 9.0), base)
    assert "peak 30.00 GiB, plan 31.50 GiB (+5% of the peak)" in fsdp and "beside none 6.00 s / 22.50 GiB" in fsdp
    assert verdict("train/qwen3/grpo/zero3", {"status": "timeout", "error": "no result"}, base) == "timeout: no result"


def test_a_cases_result_is_written_once_and_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(gc_cases, "_result_written", False)
    big = {"status": "ok", "blob": "x" * 2_000_000}
    won = []
    threads = [threading.Thread(target=lambda r=r: won.append(gc_cases._write_result(tmp_path, r)))
               for r in (big, {"status": "ok", "ended": "run finished"})]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(won) == [False, True]
    result = json.loads((tmp_path / "result.json").read_text())  # one writer's whole result, never a torn one
    assert result in (big, {"status": "ok", "ended": "run finished"})
    assert gc_cases._write_result(tmp_path, {"status": "error"}) is False  # the first result stands
    assert not [p for p in Path(tmp_path).iterdir() if p.name != "result.json"]  # no temporary file left
