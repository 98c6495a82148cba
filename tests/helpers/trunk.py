"""The shared-trunk tests' models: a frozen reference and a reward model made from it, equal in
their leading blocks (also LoRA's tests')."""

from __future__ import annotations

import torch

from datc.models.build import build_causal_lm, build_reward_model, freeze
from tests.helpers.testbed import ARCHS

LAYERS = 4
FAMILIES = {"llama": ARCHS["llama"],
            "qwen2": dict(model_type="qwen2", num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                          hidden_size=32, intermediate_size=64, max_position_embeddings=64)}


def trunk_pair(tok, family="llama", differ_at: int | None = 3):
    """A frozen reference and a reward model made from it (its base loaded, a new head), with
    block ``differ_at`` then changed as reward-model training changes its top blocks."""
    arch = {**FAMILIES[family], "num_hidden_layers": LAYERS}
    ref = freeze(build_causal_lm(arch, tok, 0))
    rm = build_reward_model(arch, tok, 1)
    rm.base_model.load_state_dict(ref.base_model.state_dict())
    with torch.no_grad():
        if differ_at is not None:
            for p in rm.base_model.layers[differ_at].parameters():
                p.add_(0.05 * torch.randn_like(p))
        rm.score.weight.normal_()  # scores of a useful spread
    return ref, freeze(rm)
