"""The testbed: the tiny models of both families (:data:`ARCHS`), whether vLLM is installed, and
the debug config composed for a run (:func:`cfg_for`) or its command line (:func:`train_cmd`)."""

from __future__ import annotations

import importlib.util
import sys

from hydra import compose, initialize_config_dir

from datc.paths import CONFIG_DIR

ARCHS = {
    "gpt2": dict(model_type="gpt2", n_layer=2, n_head=2, n_embd=32, n_positions=64),
    "llama": dict(model_type="llama", num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                  hidden_size=32, intermediate_size=64, max_position_embeddings=64),
}


HAS_VLLM = importlib.util.find_spec("vllm") is not None


def cfg_for(cache_dir, run_dir, *overrides):
    """``configs/train.yaml`` composed with ``debug=fast``, the given cache and run directories
    and the overrides (not yet validated)."""
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose(config_name="train", overrides=["debug=fast", f"cache_dir={cache_dir}", f"run_dir={run_dir}", *overrides])


def train_cmd(cache_dir, run_dir, *overrides) -> list[str]:
    """The command line of :func:`cfg_for`'s run, for a run in its own process."""
    return [sys.executable, "-m", "datc.train", "debug=fast", f"cache_dir={cache_dir}", f"run_dir={run_dir}", *overrides]


def compose_train(overrides: list[str]):
    """``configs/train.yaml`` composed with the overrides alone (not yet validated)."""
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose(config_name="train", overrides=overrides)
