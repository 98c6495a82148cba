"""METHOD §6's bracketing rule (datc/study/bracket.py) on synthetic objectives: every edge case,
no run started (the points are made by hand)."""

from __future__ import annotations

import itertools
import random

from datc.study.bracket import (
    KNOB,
    RATE,
    Limits,
    Point,
    bracket_step,
    extra_at_most,
    factor,
    lattice_k,
)


def pts(scores: dict[int, float | None], **flags: set[int]) -> dict[int, Point]:
    """Complete points with these mean scores; ``diverged=``, ``collapsed=``, ``cut=`` sets of k."""
    return {k: Point(k, s, k not in flags.get("cut", set()), k in flags.get("diverged", set()),
                     k in flags.get("collapsed", set())) for k, s in scores.items()}


def search(objective, lim=RATE, start=None, **flags) -> tuple[int | None, tuple[str, ...], list[int]]:
    """Runs the rule to its end against ``objective(k)``: the chosen k, its edges, the points run."""
    done: dict[int, Point] = dict(start or {})
    for _ in range(20):
        step = bracket_step(done, lim)
        if step.done:
            return step.chosen, step.edges, sorted(done)
        for k in step.needed:
            done[k] = Point(k, objective(k), True, k in flags.get("diverged", ()), k in flags.get("collapsed", ()))
    raise AssertionError("the search did not end")


def test_the_start_points_missing_or_cut_are_needed_first():
    assert bracket_step({}, RATE).needed == (-1, 0, 1)
    assert bracket_step(pts({-1: 0.1, 0: 0.2, 1: 0.3}, cut={0}), RATE).needed == (0,)


def test_an_interior_best_is_chosen_bracketed():
    step = bracket_step(pts({-1: 0.1, 0: 0.3, 1: 0.2}), RATE)
    assert step.done and step.chosen == 0 and step.edges == ()


def test_best_at_the_top_extends_up_until_a_worse_point():
    assert bracket_step(pts({-1: 0.1, 0: 0.2, 1: 0.3}), RATE).needed == (2,)
    step = bracket_step(pts({-1: 0.1, 0: 0.2, 1: 0.3, 2: 0.25}), RATE)
    assert step.done and step.chosen == 1 and step.edges == ()
    assert bracket_step(pts({-1: 0.1, 0: 0.2, 1: 0.3, 2: 0.25}, cut={2}), RATE).needed == (2,)  # cut: finish it


def test_a_monotone_objective_runs_to_the_cap_at_either_end():
    assert search(lambda k: k) == (5, ("edge: at the search's limit (×32)",), list(range(-1, 6)))
    assert search(lambda k: -k) == (-5, ("edge: at the search's limit (×1/32)",), list(range(-5, 2)))
    assert search(lambda k: k, KNOB) == (3, ("edge: at the search's limit (×8)",), list(range(-1, 4)))
    assert search(lambda k: -k, KNOB)[:2] == (-3, ("edge: at the search's limit (×1/8)",))


def test_a_peak_anywhere_is_found_with_its_two_neighbours():
    for peak in range(-5, 6):
        chosen, edges, tried = search(lambda k, p=peak: -abs(k - p))
        assert chosen == peak and {peak - 1, peak + 1} & set(range(-5, 6)) <= set(tried)
        assert len(tried) <= 7


def test_ties_keep_the_default_then_the_nearest_then_the_lower():
    assert bracket_step(pts({-1: 0.2, 0: 0.3, 1: 0.3}), RATE).chosen == 0
    assert bracket_step(pts({-1: 0.3, 0: 0.1, 1: 0.3}), RATE).needed == (-2,)  # x0.5 before x2, then x1/4 needed
    step = bracket_step(pts({-2: 0.1, -1: 0.3, 0: 0.1, 1: 0.3}), RATE)
    assert step.done and step.chosen == -1
    # a new end that ties the old best keeps the old best (nearer the default)
    step = bracket_step(pts({-1: 0.1, 0: 0.2, 1: 0.3, 2: 0.3}), RATE)
    assert step.done and step.chosen == 1


def test_a_diverged_or_collapsed_next_point_is_an_edge_and_never_chosen():
    step = bracket_step(pts({-1: 0.1, 0: 0.2, 1: 0.3, 2: None}, diverged={2}), RATE)
    assert step.done and step.chosen == 1 and step.edges == ("edge: the next point (×4) diverged",)
    step = bracket_step(pts({-1: 0.1, 0: 0.2, 1: 0.3, 2: 0.9}, collapsed={2}), RATE)
    assert step.done and step.chosen == 1 and step.edges == ("edge: the next point (×4) collapsed",)
    # the best score collapsed: not a candidate (the records' arithmetic/tiny_llama GRPO x8)
    step = bracket_step(pts({-1: 0.1, 0: 0.3, 1: 0.2, 3: 0.9}, collapsed={3}), RATE)
    assert step.done and step.chosen == 0
    assert search(lambda k: k, collapsed={3}) == (2, ("edge: the next point (×8) collapsed",), [-1, 0, 1, 2, 3])


def test_a_point_with_one_diverged_seed_is_diverged():
    p = {-1: Point(-1, 0.1, True), 0: Point(0, 0.2, True), 1: Point(1, 0.3, True, diverged=True)}
    step = bracket_step(p, RATE)
    assert step.done and step.chosen == 0 and step.edges == ("edge: the next point (×2) diverged",)


def test_everything_diverging_goes_down_to_the_cap_then_says_so():
    chosen, edges, tried = search(lambda k: None, diverged=set(range(-5, 6)))
    assert chosen is None and edges[0].startswith("no usable point") and tried == list(range(-5, 2))
    assert search(lambda k: None if k > -3 else 0.1, diverged={-2, -1, 0, 1})[:2] == (
        -3, ("edge: the next point (×1/4) diverged",))


def test_a_complete_point_without_a_score_is_not_eligible():
    assert bracket_step(pts({-1: 0.1, 0: None, 1: 0.05}), RATE).needed == (-2,)


def test_lattice_points_from_elsewhere_are_used_and_gaps_filled():
    # x8 from the matched-KL search (on the lattice) is the best so far: its neighbours are needed
    step = bracket_step(pts({-1: 0.1, 0: 0.2, 1: 0.3, 3: 0.5}), RATE)
    assert step.needed == (2, 4)
    assert lattice_k(0.004, 0.0005) == 3 and lattice_k(0.0012, 0.0005) is None  # x2.4: off the lattice
    assert lattice_k(5e-4 * 2 ** -5, 5e-4) == -5 and lattice_k(None, 1.0) is None


def test_points_outside_the_limits_are_ignored():
    step = bracket_step(pts({-1: 0.1, 0: 0.2, 1: 0.3, 6: 0.9}), Limits(-1, 1))
    assert step.done and step.chosen == 1 and step.edges == ("edge: at the search's limit (×2)",)


def test_the_decision_does_not_depend_on_the_order_of_the_points():
    rng = random.Random(0)
    for _ in range(50):
        scores = {k: rng.choice([0.1, 0.2, 0.3, None]) for k in range(-3, 4)}
        p = pts(scores, diverged={k for k, s in scores.items() if s is None})
        first = bracket_step(p, RATE)
        for perm in itertools.islice(itertools.permutations(p.items()), 5):
            assert bracket_step(dict(perm), RATE) == first


def test_the_plans_worst_case():
    assert extra_at_most({}, RATE) == 7 and extra_at_most({}, KNOB) == 5
    assert extra_at_most(pts({-1: 0.1, 0: 0.3, 1: 0.2}), RATE) == 0
    assert extra_at_most(pts({-1: 0.1, 0: 0.2, 1: 0.3, 2: 0.4, 3: 0.5, 4: 0.6}), RATE) == 1  # x32 is the last
    assert extra_at_most(pts({-1: 0.1, 0: 0.2, 1: 0.3}), RATE) == 4  # x4 .. x32
    assert extra_at_most(pts({-1: 0.3, 0: 0.2, 1: 0.1}), KNOB) == 2  # x1/4, x1/8
    # the worst case bounds what the search then runs, for any objective
    rng = random.Random(1)
    for _ in range(200):
        f = {k: rng.random() for k in range(-5, 6)}
        bound = extra_at_most({}, RATE)
        assert len(search(lambda k, f=f: f[k])[2]) <= bound
    assert factor(0) == "×1" and factor(-2) == "×1/4" and factor(5) == "×32"
