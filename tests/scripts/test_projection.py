"""The GPU check's projected paper-preset run time: its arithmetic, checked by hand."""

from __future__ import annotations

import pytest

from scripts.gpu_check.projection import project


def test_the_projection_adds_the_measured_phases_scaled_to_the_preset():
    decode = {"shape": {"rows": 128}, "modes": {"prefill": {"call_s": 0.5}, "dynamic": {"step_s": 0.030},
                                                "static_graph": {"step_s": 0.004}}}
    train = {"reward_s": 2.0, "credit_s": 1.0, "update_s": 4.0, "response_len": 128.0}
    p = project(decode, train, train_batch=32, prompt_tokens=128)
    # rollout: 512/128 = 4 calls x (0.5 + 512 x 0.004) = 4 x 2.548 = 10.192 s (the fastest loop)
    assert p.rollout_s == pytest.approx(10.192)
    # the rest: (2 + 1 + 4) x (512 x 640) / (32 x 256) = 7 x 40 = 280 s
    assert p.other_s == pytest.approx(280.0)
    assert p.seconds_per_step == pytest.approx(290.192) and p.hours == pytest.approx(500 * 290.192 / 3600)
    assert "static_graph" in p.lines[0] and p.lines[-1].endswith(f"= {p.hours:.2f} h")


def test_a_decode_case_at_fewer_rows_is_scaled_to_the_calls_rows():
    decode = {"shape": {"rows": 16}, "modes": {"prefill": {"call_s": 0.1}, "dynamic": {"step_s": 0.01}}}
    train = {"reward_s": 0.0, "credit_s": 0.0, "update_s": 0.0, "response_len": 8.0}
    p = project(decode, train, train_batch=16, prompt_tokens=8, preset={"steps": 1, "responses": 128,
                                                                        "max_new_tokens": 10, "rows_per_call": 64})
    assert p.rollout_s == pytest.approx(2 * (0.1 + 10 * 0.01) * 64 / 16)
