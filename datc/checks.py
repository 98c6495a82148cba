"""The whole config check, made before any model loads: the schema's fields
(:func:`datc.config.check_fields`), then each room's own checks in turn, each naming its own
fields in a one-line :class:`datc.errors.ConfigError`. It sits above the rooms it calls, so the
schema below them stays importable by all of them."""

from __future__ import annotations

from omegaconf import DictConfig

from datc.config import TrainConfig, check_fields


def validate(cfg: DictConfig | dict) -> TrainConfig:
    """Typed and range-checked config, or a :class:`ConfigError` naming the field."""
    c = check_fields(cfg)
    # the rooms' checks are imported here, after the fields: a bad value is said before torch loads
    from datc.backends.checks import check_backend
    from datc.engines.checks import check_engine
    from datc.models.lora import check_lora
    from datc.models.reward_delta import check_reward_delta
    from datc.run.checks import check_logger

    for check in (check_logger, check_lora, check_reward_delta, check_engine, check_backend):  # in this order: each names its own fields
        check(c)
    from datc.data.checks import check_data

    check_data(c)
    from datc.credit import check_credit
    from datc.rewards.rules import check_rules

    for check in (check_rules, check_credit):
        check(c)
    return c
