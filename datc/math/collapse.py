"""The length collapse of METHOD §6: a run whose mean response length falls below half of its
step-0 value, or whose responses end at their first token in more than half of a batch.

The step's metrics give each rollout batch's ``rollout/response_len`` (mean tokens per response,
the end-of-text token included) and ``rollout/first_token_end_frac`` (the fraction of responses
whose first sampled token ended them). :class:`CollapseWatch` keeps the step-0 length (the first
training step's rollout, sampled by the initial policy) and turns each step into the 0/1 metric
``rollout/length_collapse``; :func:`collapse_record` is the run's summary of it. Plain numbers in,
plain numbers out: the trainer, the summary and the tests share this one rule.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

LENGTH_FRACTION = 0.5  # below this fraction of the step-0 mean length: collapsed
FIRST_TOKEN_FRACTION = 0.5  # more than this fraction of a batch ending at its first token: collapsed
LEN_KEY = "rollout/response_len"
FIRST_KEY = "rollout/first_token_end_frac"
FLAG_KEY = "rollout/length_collapse"


def _finite(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(float(x)):
        return None
    return float(x)


def is_collapsed(response_len: float | None, first_token_end_frac: float | None, initial_len: float | None) -> bool:
    """One batch's verdict: its mean length below :data:`LENGTH_FRACTION` of ``initial_len``, or
    more than :data:`FIRST_TOKEN_FRACTION` of its responses ended at their first token. A value
    that is missing (``None``) or not finite takes no part."""
    short = response_len is not None and initial_len is not None and response_len < LENGTH_FRACTION * initial_len
    first = first_token_end_frac is not None and first_token_end_frac > FIRST_TOKEN_FRACTION
    return short or first


@dataclass
class CollapseWatch:
    """The run's collapse flag, step by step. ``initial_len``: the step-0 mean response length
    (set by the first step seen); ``first_step``: the first step flagged (None: none yet)."""

    initial_len: float | None = None
    first_step: int | None = None
    last: tuple[float | None, float | None] = (None, None)  # the last step's length and first-token fraction

    def update(self, step: int, metrics: Mapping[str, Any]) -> tuple[int, bool]:
        """This step's flag (0 or 1) and whether it is the run's first (the warning's moment)."""
        length, first_frac = _finite(metrics.get(LEN_KEY)), _finite(metrics.get(FIRST_KEY))
        if self.initial_len is None:
            self.initial_len = length
        self.last = (length, first_frac)
        flag = is_collapsed(length, first_frac, self.initial_len)
        first = flag and self.first_step is None
        if first:
            self.first_step = step
        return int(flag), first

    @classmethod
    def from_rows(cls, rows: Iterable[Mapping[str, Any]]) -> CollapseWatch:
        """The watch as a run's logged training rows (``metrics.jsonl``, in step order) leave it:
        what a resumed run continues from, so it neither warns twice nor forgets its step 0."""
        watch = cls()
        for r in rows:
            if LEN_KEY in r:
                watch.update(int(r.get("step", 0)), r)
        return watch

    def warning(self, step: int) -> str:
        """The warning line of the step just flagged, saying which rule fired."""
        length, first_frac = self.last
        why = []
        if length is not None and self.initial_len is not None and length < LENGTH_FRACTION * self.initial_len:
            why.append(f"mean response length {length:.2f} tokens, below {LENGTH_FRACTION:g} x its step-0 value "
                       f"{self.initial_len:.2f}")
        if first_frac is not None and first_frac > FIRST_TOKEN_FRACTION:
            why.append(f"{first_frac:.0%} of the batch ended at its first token")
        return f"length collapse at step {step}: {'; '.join(why)} ({FLAG_KEY} = 1; METHOD §6: tables mark this run)"


def collapse_record(rows: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The run's collapse in its summary: the first step flagged (``step``, None if never), how
    many steps were flagged, the step-0 and the last mean response length."""
    watch, flagged, last = CollapseWatch(), 0, None
    for r in rows:
        if LEN_KEY not in r:
            continue
        flagged += watch.update(int(r.get("step", 0)), r)[0]
        last = _finite(r.get(LEN_KEY))
    return {"step": watch.first_step, "steps_flagged": flagged, "initial_len": watch.initial_len, "final_len": last}
