"""Rewards: the frozen reward model (scores and input-embedding gradients) and rule-based rewards."""
