"""This project's side of the benchmark: its session, and its training step.

The only module of scripts/bench that calls into the training step (:mod:`datc.step`), in
:func:`step` and :func:`learn`; the rest of the benchmark runs this project's trainer through
these two functions. A forced response length goes through the step's sampler seam
(:class:`datc.step.ops.StepOps`), so the timed step is ``train_step``'s own.
"""

from __future__ import annotations

import dataclasses
import functools
import time


def datc_session(overrides: list[str], max_new_tokens: int | None = None):
    """This project's session; ``max_new_tokens`` (not None) replaces the response budget after
    the build, so the cache (keyed by the configured budget) is not prepared again."""
    from datc.analysis.inputs import session_for

    s = session_for(overrides)
    if max_new_tokens is not None:
        s.c.trainer.max_new_tokens = max_new_tokens
    return s


def step(s, it: int, min_new_tokens: int = 0) -> dict[str, float]:
    """One training step, ``datc.step.train_step(s, it)``'s metrics; with ``min_new_tokens`` its
    sampler forbids EOS before that many tokens (the same prompts, plan, sampling calls and
    ``learn``, timed from the same point)."""
    from datc.engines.generate import sample_groups
    from datc.step import train_step

    if min_new_tokens:
        forced = functools.partial(sample_groups, min_new_tokens=min_new_tokens)
        s = dataclasses.replace(s, ops=dataclasses.replace(s.ops, sample=forced))
    return train_step(s, it).metrics


def learn(s, it: int, ro) -> dict[str, float]:
    """Step ``it`` on a given rollout ``ro`` (everything after the rollout: frozen passes,
    reward, credit, update), ``datc.step.learn`` under the session's autocast, as
    ``train_step`` runs it."""
    from datc.step import learn as step_learn

    with s.autocast():
        return step_learn(s, it, ro, time.perf_counter()).metrics
