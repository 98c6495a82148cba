"""The checks of where the run's prompts, policy and reward model come from (``data.path``,
``data.task``, ``policy.path``, ``reward.path``), called by :func:`datc.checks.validate` before
any file or model is read."""

from __future__ import annotations

import os

from datc.errors import ConfigError


def check_data(c) -> None:  # c: datc.config.TrainConfig
    """A testbed task or a real dataset, with what each needs; a :class:`ConfigError` naming the field."""
    from datc.tasks import TASKS

    if c.data.task is None and c.data.path is None:
        raise ConfigError("data.path: a real prompt dataset needs a path (hub name or local files) when data.task is null")
    if c.data.task is not None and c.data.task not in TASKS:
        raise ConfigError(f"data.task: {c.data.task!r} is not a testbed task; choose one of {', '.join(TASKS.names())} or null")
    if c.policy.path is None and not c.policy.arch:
        raise ConfigError("policy.arch: a testbed policy (policy.path=null) needs an architecture")
    if c.data.path is not None and _looks_local(c.data.path) and not os.path.exists(c.data.path):
        raise ConfigError(f"data.path: {c.data.path!r} does not exist (a local file or directory; a hub dataset is "
                          "a name such as 'imdb' or 'owner/name')")
    if c.policy.path is None and c.policy.gguf_file is None and c.data.task is None:
        raise ConfigError("policy.path: the testbed policy (policy.path=null) is warm-started on a testbed task, and "
                          "data.task is null; give a pretrained model (policy=pretrained policy.path=...) or a data.task")
    if c.reward.path is None and c.data.task is None:
        raise ConfigError("reward.path: a real dataset has no gold reward to train a testbed reward model on; set reward.path")


def _looks_local(path: str) -> bool:
    """Whether ``data.path`` names a local file or directory rather than a hub dataset."""
    return path.startswith(("/", "./", "../", "~")) or path.endswith((".json", ".jsonl", ".csv", ".parquet", ".txt"))
