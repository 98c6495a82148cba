"""Which credit schemes the analysis covers, and their outputs on one batch of inputs.

The schemes are found, never listed by hand: every ``configs/credit/*.yaml`` (a registered
scheme's config, or an ablation that is a config over one) and every registered scheme
(:func:`datc.credit.configs.credit_labels`), so a new scheme appears in the heatmaps and the
credit-accuracy table with no edit here. Each is resolved from its config, as a run with
``credit=<label>`` resolves it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from functools import cache
from typing import TYPE_CHECKING, Any

import torch

from datc.credit import CreditOutput, CreditScheme, compute_credit, resolve_scheme
from datc.credit.configs import credit_configs, credit_labels
from datc.report.loading import UNIFORM_CREDIT

if TYPE_CHECKING:
    from datc.analysis.inputs import CreditInputs


def analysed_schemes(*, uniform: bool = True) -> list[str]:
    """Every scheme label, the uniform baseline (``grpo``) first and the others sorted; with
    ``uniform=False`` without the uniform schemes, whose credit ranks no token."""
    labels = [n for n in credit_labels() if uniform or n not in UNIFORM_CREDIT]
    return sorted(labels, key=lambda n: (n not in UNIFORM_CREDIT, n))


@cache
def scheme_of(label: str) -> tuple[CreditScheme, Any]:
    """(scheme, params) of ``credit=<label>``: its config's values (a registered scheme without
    a config: its defaults). Composed once per label."""
    return resolve_scheme(credit_configs([label])[label])


def scheme_outputs(inputs: CreditInputs, labels: Iterable[str]) -> dict[str, CreditOutput]:
    """Each scheme on the same inputs: label -> its output, with weights (B, T). Deterministic:
    a random scheme gets a generator seeded with ``inputs.generator_seed`` afresh, whatever ran
    before it."""
    out = {}
    for label in labels:
        scheme, params = scheme_of(label)
        batch = dataclasses.replace(inputs.batch,
                                    generator=torch.Generator().manual_seed(inputs.generator_seed))
        out[label] = compute_credit(scheme, batch, params)
    return out
