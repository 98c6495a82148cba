"""``oracle``: s_t = sign(A_i) · c_t with c_t the task's per-token gold contribution."""

import math

import pytest
import torch

from datc.checks import validate
from datc.config import ConfigError
from datc.credit import CREDIT_SCHEMES, CreditBatch, compute_credit, resolve_scheme
from datc.credit.base import GOLD_CONTRIB
from datc.training.session import build_session
from tests.helpers.testbed import cfg_for


def _batch(contrib, mask, adv):
    return CreditBatch(torch.zeros(contrib.shape, dtype=torch.long), mask, adv, gold_contrib=contrib)


def test_hand_values_through_the_softmax_weight_step():
    # Response 0, A = +0.5, contributions (1/16, 0, -1/16, 0): scores s = (1, 0, -1, 0)/16.
    #   z-score: mean 0, population std sqrt(2/64)/... = sqrt((1 + 1)/4)/16 = 0.7071/16, so
    #   z = (1.4142, 0, -1.4142, 0); w = 4 softmax(z) = 4 (e^1.414, 1, e^-1.414, 1) / S,
    #   S = 4.1133 + 1 + 0.2431 + 1 = 6.3564: w = (2.5885, 0.6293, 0.1530, 0.6293).
    # Response 1, A = -2: the same contributions score (-1, 0, 1, 0)/16: the mirrored weights,
    #   the bad-camp token (third) now carrying the advantage.
    # Response 2, A = 0: scores 0, fallback to w = 1 on its two valid tokens.
    c = torch.tensor([[1, 0, -1, 0], [1, 0, -1, 0], [1, -1, 0, 0]], dtype=torch.float32) / 16
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    scheme, params = resolve_scheme({"name": "oracle"})
    assert scheme.needs == {GOLD_CONTRIB} and scheme.row_separable
    out = compute_credit(scheme, _batch(c, mask, torch.tensor([0.5, -2.0, 0.0])), params)
    e = math.exp(math.sqrt(2))
    S = e + 2 + 1 / e
    w0 = torch.tensor([4 * e / S, 4 / S, 4 / (e * S), 4 / S])
    torch.testing.assert_close(out.weights[0], w0)
    torch.testing.assert_close(out.weights[0], torch.tensor([2.5885, 0.6293, 0.1530, 0.6293]), atol=1e-4, rtol=0)
    torch.testing.assert_close(out.weights[1], w0[[2, 1, 0, 3]])
    assert torch.equal(out.weights[2], torch.tensor([1.0, 1.0, 0.0, 0.0]))
    assert out.fallback.tolist() == [False, False, True]
    torch.testing.assert_close(out.scores[1], torch.tensor([-1, 0, 1, 0], dtype=torch.float32) / 16)


def test_padding_never_changes_weights():
    c = torch.tensor([[0.3, -0.1, 0.2]])
    mask = torch.tensor([[True, True, False]])
    scheme, params = resolve_scheme({"name": "oracle"})
    w = compute_credit(scheme, _batch(c, mask, torch.tensor([1.0])), params).weights
    c2 = c.clone()
    c2[0, 2] = float("nan")
    assert torch.equal(compute_credit(scheme, _batch(c2, mask, torch.tensor([1.0])), params).weights, w)
    assert w[0, 2] == 0 and w[0, 0] > w[0, 1]


def test_a_run_without_per_token_gold_is_refused_before_any_model_loads(tmp_path):
    # Neither model exists: reaching the assets or the models would fail with another error.
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello"}\n')
    c = validate(cfg_for(tmp_path / "cache", tmp_path / "run", "credit=oracle", "data.task=null",
                         f"data.path={prompts}", "reward=pretrained", "reward.path=some/rm", "policy=pretrained",
                         "policy.path=some/policy"))
    with pytest.raises(ConfigError, match=r"credit.name: 'oracle' .*data.task.*arithmetic"):
        build_session(c)


def test_registered():
    assert "oracle" in CREDIT_SCHEMES.names()
