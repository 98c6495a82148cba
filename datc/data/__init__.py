"""Prompt data and the testbed's assets: prompt files and datasets, the word-level tokenizer, the
prepare step (``datc-prepare``) and the testbed's warm start and reward-model training."""
