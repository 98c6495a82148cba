"""Every credit config (each registered scheme, each ablation over one) runs a short training on
the testbed and logs the credit/ diagnostics."""

from __future__ import annotations

import json
import math

import pytest

from datc.credit.configs import credit_config_names
from datc.training.trainer import train
from tests.conftest import cfg_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("schemes_cache")


@pytest.mark.parametrize("name", credit_config_names())
def test_short_run_finishes_with_credit_diagnostics(cache, tmp_path, name):
    summary = train(cfg_for(cache, tmp_path / "run", f"credit={name}"))
    assert math.isfinite(summary["eval"]["final"]["eval/gold"])
    rows = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl") if "loss/total" in x]
    for key in ("credit/weight_mean", "credit/weight_std", "credit/ess", "credit/fallback_frac", "credit/accuracy"):
        assert all(key in r for r in rows), key
