"""Passes over a batch: the shared trunk, gradient checkpointing, the chunked LM head (datc.forward)."""
