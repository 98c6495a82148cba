"""The training step: its plan, rows, the zero-advantage skip, sampling in calls, the stale stream."""
