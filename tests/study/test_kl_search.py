"""METHOD §6's matched-KL search at ±5% (datc/study/kl_search.py): proposals, the match, the stops."""

from __future__ import annotations

import math

import pytest

from datc.study.kl_search import KlStep, credit_share, kl_step, round3

B = (5e-4 / 32, 5e-4 * 32)


def step(points, target, rounds=1, **kw):
    return kl_step(points, target, rounds, bounds=kw.pop("bounds", B), **kw)


def test_the_proposal_between_a_bracketing_pair_is_the_log_log_interpolation():
    s = step([(1e-3, 1.0), (4e-3, 4.0)], 2.0)  # KL ~ lr: the geometric midpoint
    assert s.propose == round3(math.sqrt(1e-3 * 4e-3)) == 0.002
    s = step([(1e-3, 1.0), (2e-3, 1.5)], 1.2)
    f = (math.log(1.2) - math.log(1.0)) / (math.log(1.5) - math.log(1.0))
    assert s.propose == round3(math.exp(math.log(1e-3) + f * math.log(2))) and s.propose == 0.00137  # 3 s.f.


def test_within_five_percent_is_matched_and_the_nearest_wins():
    assert step([(1e-3, 1.049)], 1.0) == KlStep(lr=1e-3, ratio=1.049)
    assert step([(1e-3, 1.051), (2e-3, 2.0)], 1.0).lr is None
    s = step([(1e-3, 0.96), (5e-3, 1.01), (1.1e-3, 1.2)], 1.0)  # the nearest in KL, not in rate
    assert s.lr == 5e-3 and s.ratio == pytest.approx(1.01)


def test_extrapolation_up_and_down_with_the_slope_floor_and_the_move_cap():
    assert step([(1e-3, 1.0)], 2.0).propose == 0.002  # one point: slope 1
    assert step([(1e-3, 1.0)], 100.0).propose == 0.004  # at most x4
    assert step([(1e-3, 1.0), (2e-3, 1.01)], 1.5).propose == round3(2e-3 * math.exp(math.log(1.5 / 1.01) / 0.5))  # slope floor
    assert step([(1e-3, 1.0), (2e-3, 2.0)], 0.25).propose == 0.00025  # down from the smallest KL, x1/4


def test_the_bounds_clamp_and_then_stop():
    assert step([(8e-3, 1.0)], 100.0).propose == 0.016  # clamped to x32 of the default
    s = step([(8e-3, 1.0), (0.016, 1.5)], 100.0)
    assert s.stopped.startswith("the target is beyond the search's bound 0.016") and s.ratio == pytest.approx(0.015)
    assert step([(1.5625e-5, 1.0)], 0.01).stopped.startswith("the target is beyond the search's bound 1.5625e-05")


def test_a_diverged_rate_is_a_wall_going_up():
    assert step([(1e-3, 1.0), (2e-3, None)], 10.0).propose == round3(math.sqrt(2e-6))
    assert step([(1e-3, None), (2e-3, None)], 1.0).propose == 0.00025  # all diverged: a quarter of the lowest


def test_a_stalled_bracket_bisects_then_stops():
    # the interpolation rounds onto a tried rate: the log-midpoint instead
    assert step([(1e-3, 1.0), (1.1e-3, 100.0)], 1.06).propose == 0.00105
    assert step([(1e-3, 1.0), (1.01e-3, 1.5), (2e-3, 3.0)], 1.053).stopped.startswith("the bracket 0.001..0.00101")
    s = step([(1e-3, 1.0), (1.001e-3, 1.5)], 1.2)
    assert s.stopped.startswith("the bracket 0.001..0.001001 is narrower than the rounding")


def test_the_rounds_run_out():
    s = step([(1e-3, 1.0), (2e-3, 1.2)], 2.0, rounds=6)
    assert s.stopped.startswith("no rate within ±5% in 6 rounds; nearest lr 0.002 at ratio 0.600")


def test_a_proposal_on_a_tried_rate_stops():
    # the anchor's own extrapolation clamps onto a rate tried before (the bound, tried and diverged)
    s = step([(1e-3, 1.0), (4e-3, None)], 100.0, bounds=(1e-5, 2e-3))
    assert s.propose == 0.002
    s = step([(1e-3, 1.0), (2e-3, None)], 100.0, bounds=(1e-5, 2e-3))
    assert s.propose == round3(math.sqrt(2e-6))


def test_the_credit_share():
    assert credit_share(0.1, 0.2) == 0.5 and credit_share(-0.1, 0.2) == -0.5 and credit_share(0.3, 0.2) == pytest.approx(1.5)
    assert credit_share(None, 0.2) is None and credit_share(0.1, 0.0) is None
