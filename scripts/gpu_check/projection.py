"""The GPU check's headline figure: the projected wall time of one paper-preset run on the
measured GPU, from the check's measured rates, with its arithmetic written out.

The paper presets (``configs/trainer/paper.yaml``): 500 steps of 64 prompts x 8 responses of up
to 512 tokens (random weights run to the budget, the worst case), sampled in calls of 128
responses, 4 optimizer steps per rollout batch. Per step:

- rollout: ``B / R`` sampling calls of ``R`` rows, each the prefill plus ``T`` decode steps at the
  fastest decode loop the decode case measured at ``R`` rows (its step time is measured at a
  shorter response, so the KV cache it reads is shorter than at ``T``: an underestimate that
  grows with ``T``);
- the frozen models, the credit and the update: the training case's measured phase times at its
  own batch, scaled by the tokens they process, ``B (P + T)`` against the case's
  ``b (P + t)`` (linear in tokens: attention's quadratic part is not scaled up, another
  underestimate at long responses).

Pure arithmetic on the report's figures; no GPU needed (tested on CPU)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PRESET = {"steps": 500, "responses": 512, "max_new_tokens": 512, "rows_per_call": 128}


@dataclass
class Projection:
    seconds_per_step: float
    hours: float
    rollout_s: float
    other_s: float
    lines: list[str]  # the arithmetic, one line per term


def project(decode: dict[str, Any], train: dict[str, Any], train_batch: int, prompt_tokens: int,
            preset: dict[str, int] | None = None) -> Projection:
    """``decode``: a decode case's result (``modes`` with ``step_s``, ``prefill``'s ``call_s``,
    ``shape`` with ``rows``); ``train``: a training case's summary (``reward_s``, ``credit_s``,
    ``update_s``, ``response_len``) at ``train_batch`` responses; ``prompt_tokens``: P."""
    p = {**PRESET, **(preset or {})}
    B, T, R, P = p["responses"], p["max_new_tokens"], p["rows_per_call"], prompt_tokens
    loops = {m: v for m, v in decode["modes"].items() if m != "prefill"}
    best = min(loops, key=lambda m: loops[m]["step_s"])
    step_s, prefill_s = loops[best]["step_s"], decode["modes"]["prefill"]["call_s"]
    rows = decode["shape"]["rows"]
    calls = B / R
    call_s = (prefill_s + T * step_s) * (R / rows)  # a call of R rows from the case's rows (equal at the real scale)
    rollout = calls * call_s
    t = train["response_len"]
    scale = (B * (P + T)) / (train_batch * (P + t))
    other = {k: train[k] * scale for k in ("reward_s", "credit_s", "update_s")}
    per_step = rollout + sum(other.values())
    hours = p["steps"] * per_step / 3600
    lines = [
        f"rollout: {B} / {R} = {calls:g} calls x (prefill {prefill_s:.3f} s + {T} x {1e3 * step_s:.2f} ms, "
        f"the {best} loop at {rows} rows{'' if rows == R else f', x {R}/{rows} rows'}) = {rollout:.1f} s",
        *(f"{k[:-2]}: {train[k]:.2f} s at {train_batch} x (P {P} + {t:.0f}) tokens, x {scale:.2f} for {B} x ({P} + {T})"
          f" = {v:.1f} s" for k, v in other.items()),
        f"step: {rollout:.1f} + {' + '.join(f'{v:.1f}' for v in other.values())} = {per_step:.1f} s; "
        f"run: {p['steps']} steps x {per_step:.1f} s = {hours:.2f} h",
    ]
    return Projection(per_step, hours, rollout, sum(other.values()), lines)
