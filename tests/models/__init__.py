"""Models, tokenizers, chat templates, LoRA and shared prompt forwards."""
