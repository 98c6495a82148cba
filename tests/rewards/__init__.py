"""The reward model's scores and the rollout's response masks."""
