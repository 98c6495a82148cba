"""``trainer.micro_batch_size: auto`` (datc.memory.micro_batch): the rule as a pure function of the
planned peak and the budget, the config's validation, and a debug run that resolves, records and
trains with it."""

from __future__ import annotations

import json

import pytest
import torch

from datc.checks import validate
from datc.config import ConfigError
from datc.memory.formulas import GIB
from datc.memory.micro_batch import MARGIN, RECORD_FILE, choose_micro_batch, resolve_micro_batch
from tests.helpers.testbed import cfg_for


def test_largest_divisor_whose_planned_peak_fits():
    peak = lambda n: (10 + 2 * n) * GIB  # noqa: E731 - 10 GiB of states, 2 GiB a response
    # mini-batch 32: divisors 1 2 4 8 16 32; budget 40 GiB: 10 + 2n <= 40 / 1.15 = 34.8 -> n <= 12.4 -> 8
    n, why = choose_micro_batch(32, peak, 40 * GIB)
    assert n == 8 and "32" in why and "16 would plan 42.0 GiB" in why
    assert choose_micro_batch(32, peak, 200 * GIB)[0] == 32  # everything fits: no accumulation
    assert choose_micro_batch(24, peak, 40 * GIB)[0] == 12  # divisors of 24: 12 fits, 24 does not
    n, why = choose_micro_batch(32, peak, 11 * GIB)  # not even one response
    assert n == 1 and "may run out of memory" in why
    assert (10 + 2 * 8) * MARGIN * GIB <= 40 * GIB < (10 + 2 * 16) * MARGIN * GIB


def test_cpu_and_uncovered_models_have_documented_rules():
    assert choose_micro_batch(64, None, None)[0] == 64  # CPU: the whole per-process mini-batch
    assert choose_micro_batch(64, None, 80 * GIB)[0] == 4  # a model the plan does not cover: up to 4
    assert choose_micro_batch(6, None, 80 * GIB)[0] == 3


@pytest.mark.parametrize("value", ["auto", 4, "4"])
def test_valid_values(tmp_path, value):
    c = validate(cfg_for(tmp_path, tmp_path, f"trainer.micro_batch_size={value}"))
    assert c.trainer.micro_batch_size == ("auto" if value == "auto" else 4)


@pytest.mark.parametrize("value", ["big", "0", "-2", "3", "2.5", "true"])
def test_bad_values_name_the_field_and_the_choices(tmp_path, value):
    with pytest.raises(ConfigError, match=r"^trainer\.micro_batch_size: ") as e:
        validate(cfg_for(tmp_path, tmp_path, f"trainer.micro_batch_size={value}"))
    assert "auto" in str(e.value) or "must divide" in str(e.value) or "incompatible" in str(e.value)


def test_resolution_is_recorded_and_read_back(tmp_path):
    c = validate(cfg_for(tmp_path, tmp_path, "trainer.micro_batch_size=auto"))
    record = tmp_path / RECORD_FILE
    resolved, why = resolve_micro_batch(c, None, None, 1, torch.device("cpu"), record)
    assert resolved.trainer.micro_batch_size == c.trainer.mini_batch_size and "CPU" in why
    assert json.loads(record.read_text())["micro_batch_size"] == c.trainer.mini_batch_size
    record.write_text(json.dumps({"micro_batch_size": 2}))  # started elsewhere with 2: a resume keeps it
    resolved, why = resolve_micro_batch(c, None, None, 1, torch.device("cpu"), record)
    assert resolved.trainer.micro_batch_size == 2 and RECORD_FILE in why
    assert resolve_micro_batch(validate(cfg_for(tmp_path, tmp_path)), None, None, 1, torch.device("cpu"))[1] is None


@pytest.mark.slow
def test_a_debug_run_with_auto_trains(tmp_path, cache_dir, caplog):
    import logging

    from datc.training.trainer import train

    with caplog.at_level(logging.INFO, logger="datc.training.session"):
        summary = train(cfg_for(cache_dir, tmp_path / "run", "trainer.micro_batch_size=auto", "trainer.steps=2",
                                "trainer.checkpoint_every=2", "trainer.eval_every=2"))
    assert summary["eval"]["final"]["eval/rm_score"] is not None
    assert json.loads((tmp_path / "run" / RECORD_FILE).read_text())["micro_batch_size"] == 8  # debug: mini-batch 8
    assert any("trainer.micro_batch_size=auto -> 8" in r.getMessage() for r in caplog.records)
