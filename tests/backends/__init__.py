"""The optimizer step and the DeepSpeed optimizer choice (datc.backends)."""
