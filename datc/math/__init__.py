"""The math at the bottom: pure tensor functions (advantages, the loss, log-probabilities, statistics,
the sampler/trainer correction, non-finite guards). No model, config, I/O or other ``datc`` module."""
