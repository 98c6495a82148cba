"""The reward model's delta (``datc.models.reward_delta``): integer LoRA factors merged into the base
weights with the same bits whatever the order of addition, saved and loaded whole, and the model
that training leaves behind equal to the one a delta file rebuilds."""

from __future__ import annotations

import pytest
import torch

from datc.errors import ConfigError
from datc.models.reward_delta import (
    QMAX,
    RewardDelta,
    add_adapters,
    apply_delta,
    delta_weight,
    dequantize,
    load_delta,
    quantize,
    save_delta,
    take_delta,
)


def _factors(seed: int, r: int = 16, d_in: int = 96, d_out: int = 64):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(r, d_in, generator=g) * 0.02
    b = torch.randn(d_out, r, generator=g) * 1e-3
    return a, b


def test_quantize_keeps_each_entry_within_half_a_step_of_the_largest():
    a, _ = _factors(0)
    q, e = quantize(a)
    assert q.dtype == torch.int16 and int(q.abs().max()) <= QMAX
    assert int(q.abs().max()) > QMAX // 2  # the range is used, not wasted
    err = (dequantize(q, e) - a.double()).abs().max()
    assert err <= 2.0 ** e / 2
    assert quantize(torch.zeros(3, 4))[0].abs().sum() == 0


def test_the_merged_delta_does_not_depend_on_the_order_of_addition():
    # float32 factors multiplied by a BLAS give bits that depend on the order it adds in; the
    # integer factors' product is exact in float64, so any order gives the same bits.
    a, b = _factors(1)
    (qa, ea), (qb, eb) = quantize(a), quantize(b)
    ref = delta_weight(qa, ea, qb, eb, 2.0)
    by_hand = torch.zeros_like(ref)
    for k in reversed(range(qa.shape[0])):  # one rank at a time, last first
        by_hand += torch.outer(qb[:, k].double(), qa[k].double())
    by_hand = by_hand * 2.0 ** (ea + eb) * 2.0
    exact = (qb.long() @ qa.long()).double()  # integer arithmetic
    assert torch.equal(ref, by_hand)
    assert torch.equal(ref, exact * 2.0 ** (ea + eb) * 2.0)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(delta_weight(qa, ea, qb, eb, 2.0), ref)
    finally:
        torch.set_num_threads(threads)
    # and it is close to the float product it stands for
    assert (ref - 2.0 * (b.double() @ a.double())).abs().max() < 1e-3 * (b.abs().max() * a.abs().max())


def _tiny_reward_model():
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, num_labels=1, pad_token_id=0)
    return LlamaForSequenceClassification(cfg).eval()


def test_take_delta_leaves_the_model_a_file_rebuilds_bit_for_bit(tmp_path):
    rm = _tiny_reward_model()
    base = {k: v.clone() for k, v in rm.state_dict().items()}
    for p in rm.parameters():
        p.requires_grad_(False)
    for p in (*rm.model.norm.parameters(), *rm.score.parameters()):
        p.requires_grad_(True)
    names = add_adapters(rm, [1, 2], ["q_proj", "down_proj"], 4, 8.0, seed=0)
    assert names == sorted(f"model.layers.{i}.{m}" for i in (1, 2) for m in ("self_attn.q_proj", "mlp.down_proj"))
    trainable = sorted(n for n, p in rm.named_parameters() if p.requires_grad)
    assert all("lora_" in n for n in trainable if n not in ("model.norm.weight", "score.weight"))
    assert "model.norm.weight" in trainable and "score.weight" in trainable
    ids = torch.randint(1, 64, (3, 7))
    with torch.no_grad():  # B starts at zero: the adapted model computes what the base did
        assert torch.allclose(rm(input_ids=ids).logits, LlamaForSequenceClassification_from(base)(input_ids=ids).logits)
        for p in rm.parameters():  # a step of training
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
        trained = rm(input_ids=ids).logits
    delta = take_delta(rm, 4, 8.0, ["model.norm.weight", "score.weight"], meta={"note": "x"})
    assert not any("lora_" in n for n, _ in rm.named_parameters())  # the adapters are gone, merged
    with torch.no_grad():
        assert torch.allclose(rm(input_ids=ids).logits, trained, atol=1e-4)  # up to the factors' rounding
    save_delta(delta, tmp_path / "d.safetensors")
    again = LlamaForSequenceClassification_from(base)
    apply_delta(again, load_delta(tmp_path / "d.safetensors"))
    for (n, p), (n2, p2) in zip(rm.state_dict().items(), again.state_dict().items(), strict=True):
        assert n == n2 and torch.equal(p, p2), n
    assert load_delta(tmp_path / "d.safetensors").meta == {"note": "x"}
    untouched = [n for n in base if not any(s in n for s in ("layers.1.self_attn.q_proj", "layers.2.self_attn.q_proj",
                                                             "layers.1.mlp.down_proj", "layers.2.mlp.down_proj",
                                                             "norm.weight", "score"))]
    assert all(torch.equal(again.state_dict()[n], base[n]) for n in untouched)


def LlamaForSequenceClassification_from(state):  # noqa: N802 (named after what it builds)
    rm = _tiny_reward_model()
    rm.load_state_dict(state)
    return rm


def test_apply_delta_refuses_a_delta_of_another_model_before_changing_anything():
    rm = _tiny_reward_model()
    before = {k: v.clone() for k, v in rm.state_dict().items()}
    q = torch.ones(2, 32, dtype=torch.int16)
    good = ("model.layers.0.self_attn.q_proj", (q, -10, torch.ones(32, 2, dtype=torch.int16), -10))
    for factors, whole, says in [
        (dict([good, ("model.layers.0.self_attn.x_proj", good[1])]), {}, "no module"),
        ({"model.layers.0.mlp.up_proj": good[1]}, {}, "in the delta"),
        (dict([good]), {"score.weight": torch.zeros(2, 32)}, "does not match"),
    ]:
        with pytest.raises(ValueError, match=says):
            apply_delta(rm, RewardDelta(2, 4.0, factors, whole))
        assert all(torch.equal(rm.state_dict()[k], v) for k, v in before.items())


def test_load_delta_refuses_another_file(tmp_path):
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="not a reward delta"):
        load_delta(tmp_path / "other.safetensors")


@pytest.mark.parametrize("overrides, says", [
    (["reward.delta=nowhere.safetensors"], "reward.delta: no file 'nowhere.safetensors'"),
    (["reward.delta=x.safetensors", "reward.init=scratch"], "reward.init must be policy"),
    (["reward.delta=x.safetensors", "reward.path=some/rm"], "not to reward.path='some/rm'; set one of them to null"),
    (["reward.train.lora_r=4", "reward.train.trainable_layers=0"], "set trainable_layers > 0"),
    (["reward.train.lora_r=-1"], "reward.train.lora_r: must be >= 0"),
])
def test_bad_delta_settings_name_the_field_before_any_model_loads(overrides, says):
    from hydra import compose, initialize_config_dir

    from datc.checks import validate
    from datc.paths import CONFIG_DIR

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["experiment=real_smollm2", "reward.delta=null", *overrides])
    with pytest.raises(ConfigError, match=says.replace("(", r"\(")):
        validate(cfg)


def test_a_delta_made_for_another_policy_is_refused_before_a_model_is_built(tmp_path):
    from types import SimpleNamespace

    from transformers import LlamaConfig, LlamaForCausalLM

    from datc.prepare.assets import from_delta

    policy = tmp_path / "policy"
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=8)).save_pretrained(policy)
    save_delta(RewardDelta(2, 4.0, meta={"base_sha256": "0" * 64}), tmp_path / "d.safetensors")
    with pytest.raises(ConfigError, match="reward.delta: .* was trained on a policy whose weights' sha256 is 000000000000"):
        from_delta(SimpleNamespace(prepare_seed=0), str(policy), None, tmp_path / "d.safetensors", str(tmp_path / "rm"))
    assert not (tmp_path / "rm").exists()


def test_factors_that_are_not_int16_of_the_deltas_rank_are_refused():
    rm = _tiny_reward_model()
    a, b = torch.ones(2, 32, dtype=torch.int16), torch.ones(32, 2, dtype=torch.int16)
    for factors, rank in [((a.int(), 0, b, 0), 2), ((a.float(), 0, b.float(), 0), 2), ((a, 0, b, 0), 3)]:
        with pytest.raises(ValueError, match="not int16 of rank"):
            apply_delta(rm, RewardDelta(rank, 4.0, {"model.layers.0.self_attn.q_proj": factors}))
    with pytest.raises(ValueError, match="int16 of one rank"):
        delta_weight(a.float(), 0, b, 0, 2.0)


def test_the_frozen_bottom_with_lora_trains_the_top_blocks_adapters_norm_and_head_only():
    from datc.prepare.testbed import _FrozenBottom

    rm = _tiny_reward_model()
    _FrozenBottom(rm, 2, None, 8, lora_r=4)
    trainable = {n for n, p in rm.named_parameters() if p.requires_grad}
    assert {"model.norm.weight", "score.weight"} <= trainable
    adapters = trainable - {"model.norm.weight", "score.weight"}
    assert adapters and all("lora_" in n and n.startswith(("model.layers.1.", "model.layers.2.")) for n in adapters)
    assert len(adapters) == 2 * 2 * 7  # A and B of seven projections in each of the top two blocks
    whole = _tiny_reward_model()
    _FrozenBottom(whole, 2, None, 8)  # lora_r=0: the top blocks train whole, no adapter
    assert not any("lora_" in n for n, _ in whole.named_parameters())
    assert {n for n, p in whole.named_parameters() if p.requires_grad} >= {"model.layers.2.mlp.up_proj.weight", "score.weight"}


def test_the_options_at_their_defaults_change_no_cache_key_and_no_run_identity():
    # Before: reward.train.lora_r: 0 joined the reward model's cache key (every testbed reward model
    # built again) and reward.delta/lora_r the run identity (every run renamed).
    from dataclasses import asdict

    from datc.config import RewardTrainConfig
    from datc.prepare.assets import train_key
    from datc.run.identity import identity

    assert set(train_key(RewardTrainConfig())) == {"steps", "lr", "batch_size", "n_prompts", "samples_per_prompt",
                                                   "group_weight", "edits_per_sample", "perturbations"}
    assert train_key(RewardTrainConfig(lora_r=16))["lora_r"] == 16
    old = {"trainer": {}, "reward": {"name": "testbed", "train": {k: v for k, v in asdict(RewardTrainConfig()).items()
                                                                  if k not in ("lora_r", "share_prompts")}}}
    new = {"trainer": {}, "reward": {**old["reward"], "delta": None, "train": asdict(RewardTrainConfig())}}
    assert identity(new) == identity(old)
    assert identity({**new, "reward": {**new["reward"], "delta": "x.safetensors"}}) != identity(old)
