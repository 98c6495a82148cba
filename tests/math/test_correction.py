"""The sampler/trainer importance-sampling correction (datc.math.correction), by hand, and its place
in the loss (TRL's order: the surrogate re-weighted, then the KL term added)."""

import math

import pytest
import torch

from datc.checks import validate
from datc.config import ConfigError
from datc.math.correction import is_weights, mismatch_sums, weight_stats
from datc.math.losses import clipped_policy_loss
from tests.helpers.testbed import cfg_for

# two responses of three positions; the second has two valid tokens
TRAIN = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, -9.0]])
SAMPLER = torch.tensor([[-1.5, -1.0, -0.5], [-0.2, -0.2, 0.0]])
MASK = torch.tensor([[True, True, True], [True, True, False]])


def test_token_truncate_is_the_capped_per_token_ratio():
    w = is_weights(TRAIN, SAMPLER, MASK, "token_truncate", 2.0)
    # exp(-1 + 1.5) = e^0.5 = 1.6487; exp(-2 + 1) = e^-1 = 0.3679; exp(0) = 1
    # exp(-0.1 + 0.2) = e^0.1 = 1.1052; exp(-3 + 0.2) = e^-2.8 = 0.0608; padding: exp(0) = 1
    want = torch.tensor([[math.exp(0.5), math.exp(-1.0), 1.0], [math.exp(0.1), math.exp(-2.8), 1.0]])
    assert torch.allclose(w, want)
    w = is_weights(TRAIN, SAMPLER, MASK, "token_truncate", 1.5)  # e^0.5 = 1.65 > 1.5: truncated
    assert w[0, 0] == 1.5 and torch.allclose(w[1, 0], torch.tensor(math.exp(0.1)))


def test_token_mask_drops_the_tokens_over_the_cap():
    w = is_weights(TRAIN, SAMPLER, MASK, "token_mask", 1.5)
    assert w[0, 0] == 0.0 and torch.allclose(w[0, 1], torch.tensor(math.exp(-1.0)))


def test_sequence_modes_use_the_sum_over_valid_tokens():
    # response 1: 0.5 - 1 + 0 = -0.5; response 2: 0.1 - 2.8 = -2.7 (the padded -9 vs 0 ignored)
    w = is_weights(TRAIN, SAMPLER, MASK, "sequence_truncate", 2.0)
    assert w.shape == (2, 1)
    assert torch.allclose(w[:, 0], torch.tensor([math.exp(-0.5), math.exp(-2.7)]))
    up = is_weights(SAMPLER, TRAIN, MASK, "sequence_truncate", 2.0)  # the inverse ratios: e^0.5, e^2.7
    assert torch.allclose(up[:, 0], torch.tensor([math.exp(0.5), 2.0]))
    masked = is_weights(SAMPLER, TRAIN, MASK, "sequence_mask", 2.0)
    assert torch.allclose(masked[:, 0], torch.tensor([math.exp(0.5), 0.0]))


def test_none_is_no_weights_and_an_unknown_mode_is_refused():
    assert is_weights(TRAIN, SAMPLER, MASK, "none", 2.0) is None
    with pytest.raises(ValueError, match="token_truncate"):
        is_weights(TRAIN, SAMPLER, MASK, "tokens", 2.0)


def test_the_weights_carry_no_gradient():
    train = TRAIN.clone().requires_grad_(True)
    assert not is_weights(train, SAMPLER, MASK, "token_truncate", 2.0).requires_grad


def test_mismatch_sums_by_hand():
    s = mismatch_sums(TRAIN, SAMPLER, MASK)
    d = torch.tensor([0.5, -1.0, 0.0, 0.1, -2.8])
    assert s["tokens"] == 5
    assert s["abs"] == pytest.approx(float(d.abs().sum()))
    assert s["max"] == pytest.approx(2.8)
    assert s["k3"] == pytest.approx(float((d.exp() - d - 1).sum()))
    assert s["k3"] > 0


def test_weight_stats_over_valid_tokens_or_responses():
    w = is_weights(TRAIN, SAMPLER, MASK, "token_truncate", 2.0)
    st = weight_stats(w, MASK)
    assert st["n"] == 5 and st["min"] == pytest.approx(math.exp(-2.8)) and st["max"] == pytest.approx(math.exp(0.5))
    seq = weight_stats(is_weights(TRAIN, SAMPLER, MASK, "sequence_mask", 2.0), MASK)
    assert seq["n"] == 2


def test_the_loss_reweights_the_surrogate_and_not_the_kl():
    torch.manual_seed(0)
    logps = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    old, ref = logps.detach() + 0.05, logps.detach() - 0.1
    adv = torch.randn(2, 3, dtype=torch.float64)
    w = torch.tensor([[0.5, 2.0, 1.0], [0.0, 1.5, 1.0]], dtype=torch.float64)
    plain = clipped_policy_loss(logps, old, adv, 0.2, 0.2, beta=0.1, ref_logps=ref)
    corrected = clipped_policy_loss(logps, old, adv, 0.2, 0.2, beta=0.1, ref_logps=ref, is_weight=w)
    surrogate = plain.loss - 0.1 * plain.kl
    assert torch.allclose(corrected.loss, w * surrogate + 0.1 * plain.kl)
    assert torch.equal(clipped_policy_loss(logps, old, adv, 0.2, 0.2, is_weight=torch.ones(2, 3, dtype=torch.float64)).loss,
                       clipped_policy_loss(logps, old, adv, 0.2, 0.2).loss)


@pytest.mark.parametrize("overrides,line", [
    (["rollout.correction=token_truncate"], "rollout.correction: 'token_truncate' needs an engine"),
    (["rollout=vllm", "trainer.top_p=0.9"], "rollout.correction: 'token_truncate' compares"),
    (["rollout=vllm", "rollout.vllm.gpu_memory_utilization=1.5"], "rollout.vllm.gpu_memory_utilization: must be in (0, 1]"),
    (["rollout=vllm", "rollout.vllm.sleep_mode=maybe"], "rollout.vllm.sleep_mode: 'maybe' is not valid; choose one of auto, on, off"),
    (["rollout=vllm", "rollout.correction=tis"], "rollout.correction: 'tis' is not valid"),
    (["rollout=vllm", "rollout.vllm.max_model_len=8"], "rollout.vllm.max_model_len: 8 is less than"),
    (["rollout=vllm", "rollout.vllm.kv_cache_memory_bytes=0"], "rollout.vllm.kv_cache_memory_bytes: must be > 0 or null, got 0"),
    (["rollout=sglang"], None),
])
def test_bad_rollout_configs_are_one_line(tmp_path, overrides, line):
    if line is None:  # not a config group option: Hydra's own error names the group and its options
        from hydra.errors import MissingConfigException

        with pytest.raises(MissingConfigException, match="rollout"):
            cfg_for(tmp_path / "c", tmp_path / "r", *overrides)
        return
    with pytest.raises(ConfigError) as e:
        validate(cfg_for(tmp_path / "c", tmp_path / "r", *overrides))
    assert str(e.value).startswith(line) and "\n" not in str(e.value)
