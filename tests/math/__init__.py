"""datc.math: advantages, losses, the sampler correction, length collapse, non-finite numbers."""
