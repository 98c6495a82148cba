"""Testbed tasks: synthetic prompt sets whose gold reward and per-token gold contribution are
known exactly, so a run can measure gold reward (not just the reward model's score) and
credit accuracy. Each task is one module registered in :data:`TASKS`."""

from datc.tasks import arithmetic, keywords, reviews  # noqa: F401  (registration)
from datc.tasks.base import TASKS, Task, gold_contributions, gold_of

__all__ = ["TASKS", "Task", "gold_contributions", "gold_of"]
