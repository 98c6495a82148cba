"""The tasks (datc.tasks)."""
