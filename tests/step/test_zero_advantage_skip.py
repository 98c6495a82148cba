"""``trainer.skip_zero_advantage``: a response with ``A = 0`` gets ``Â = A · w = 0`` whatever its
weights, so a row-separable scheme's credit (and the reward model's backward for a group of
identical responses) is left out for it, and the update is the same bit for bit (with the plain
forwards; with ``share_prompts`` a prompt's forward rounds with the number of distinct prompts
computed together, so there it is the same up to float rounding). Schemes whose weights compare
responses are computed in full."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from datc.checks import validate
from datc.config import ConfigError
from datc.credit import CREDIT_SCHEMES, compute_credit, credit_scheme
from datc.credit.base import CreditOutput
from datc.credit.diagnostics import credit_metrics
from datc.models.rm_inputs import build_rm_inputs
from datc.rewards.model import score
from datc.step.ops import StepOps
from tests.helpers.testbed import cfg_for
from tests.helpers.zero_advantage import SAME, ZERO_ADV, B, same_update, skip_step


@pytest.fixture
def cache(cache_dir):
    return cache_dir  # the session's (assets are keyed by their config)


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    ("credit=datc",),  # on-policy, credit from generate's logits
    ("credit=datc", "trainer.reuse_rollout_logits=never", "trainer.micro_batch_size=4"),  # a pass, in row chunks
    ("credit=datc", "trainer.epochs=2"),  # off-policy: the skipped rows' old log-probs from their own pass
    ("credit=rm_saliency",),
    ("credit=prob_reweight", "trainer.epochs=2"),
    ("credit=gcpo",),
    ("credit=oracle",),
    ("credit=grail",),
    ("credit=p2t",),
], ids=lambda o: "-".join(x.split("=")[1] for x in o))
def test_the_update_is_the_same_with_the_skip_on_or_off(cache, tmp_path, forced, overrides):
    m_on, m_off = same_update(cache, tmp_path, *overrides, ops=forced["ops"])
    on, off = forced["rewarded"]
    assert torch.equal(on.advantages, off.advantages) and m_off["credit/weight_std"] > 0
    assert torch.equal(on.credited, off.advantages != 0) and off.credited.all()
    assert m_on["credit/skipped_frac"] == ZERO_ADV / B
    if {"credit=rm_saliency", "credit=datc", "credit=p2t"} & set(overrides):  # the schemes that read the RM gradient
        on_rows, off_rows = forced["grad_rows"]
        assert off_rows.all() and not on_rows[SAME].any() and on_rows[:SAME.start].all() and on_rows[SAME.stop:].all()
        g_on, g_off = forced["rm_grad"]
        assert torch.equal(g_on[on.credited], g_off[off.advantages != 0])


@pytest.mark.slow
def test_the_update_is_the_same_with_shared_prompt_forwards_up_to_rounding(cache, tmp_path, forced):
    # credit in row chunks of 4 from its own pass: the skip changes which prompts are forwarded together
    m_on, _ = same_update(cache, tmp_path, "credit=datc", "trainer.reuse_rollout_logits=never",
                           "trainer.micro_batch_size=4", share=True, ops=forced["ops"])
    on, off = forced["rewarded"]
    assert torch.equal(on.advantages, off.advantages) and m_on["credit/skipped_frac"] == ZERO_ADV / B
    g_on, g_off = forced["rm_grad"]
    torch.testing.assert_close(g_on[on.credited], g_off[off.advantages != 0], rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_identical_responses_whose_rewards_still_differ_get_their_gradient_afterwards(cache, tmp_path, forced):
    forced["split_same"] = True  # the group of identical responses is scored unequally: A != 0
    same_update(cache, tmp_path, "credit=datc", ops=forced["ops"])
    on, off = forced["rewarded"]
    assert on.credited[SAME].all() and int((on.advantages == 0).sum()) == ZERO_ADV - 4
    on_rows, repaired, off_rows = forced["grad_rows"]
    assert not on_rows[SAME].any() and repaired.shape == (4,) and off_rows.all()  # a second call for those 4 rows
    g_on, g_off = forced["rm_grad"]
    assert g_on[SAME].any() and torch.equal(g_on[on.credited], g_off[on.credited])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["delta", "entropy_top", "datc_shuffled"])
def test_schemes_that_are_not_row_separable_are_computed_in_full(cache, tmp_path, forced, name):
    assert not CREDIT_SCHEMES.get(name).row_separable
    m_on, _ = same_update(cache, tmp_path, f"credit={name}", ops=forced["ops"])
    on, _ = forced["rewarded"]
    assert m_on["credit/skipped_frac"] == 0.0 and on.credited.all() and (on.advantages == 0).sum() == ZERO_ADV
    assert all(rows.all() for rows in forced["grad_rows"])


@pytest.mark.slow
def test_skipped_fraction_is_the_fraction_of_zero_advantages(cache, tmp_path, forced):
    m, _ = skip_step(cache, tmp_path, True, "credit=datc", ops=forced["ops"])
    (rw,) = forced["rewarded"]
    assert m["credit/skipped_frac"] == float((rw.advantages == 0).float().mean()) == ZERO_ADV / B


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [("credit=datc",), ("credit=datc", "trainer.epochs=2"), ("credit=gcpo",)],
                         ids=lambda o: "-".join(x.split("=")[1] for x in o))
def test_a_batch_without_any_advantage_skips_everything(cache, tmp_path, overrides):
    calls = []
    ops = StepOps(score=lambda *a, **k: dataclasses.replace(out := score(*a, **k), scores=torch.full_like(out.scores, 0.3)),
                  credit=lambda *a: calls.append(1) or compute_credit(*a))
    m_on, m_off = same_update(cache, tmp_path, *overrides, ops=ops)
    assert len(calls) == 1  # the skip-off step's only: the skip-on step computed no credit at all
    assert m_on["credit/skipped_frac"] == 1.0 and m_on["reward/advantage_abs"] == 0.0
    assert math.isnan(m_on["credit/weight_std"]) and m_on["credit/fallback_frac"] == 0.0  # no response whose credit matters
    assert math.isfinite(m_on["loss/total"]) and math.isfinite(m_on["rollout/entropy"])


def test_the_reward_model_differentiates_only_the_rows_asked_for(tok, reward_model):
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(5, 40, (6, 3), generator=g)
    resp = torch.randint(5, 40, (6, 5), generator=g)
    rmask = torch.arange(5)[None, :] < torch.tensor([5, 3, 4, 1, 5, 2])[:, None]
    inputs = build_rm_inputs(prefix, torch.ones_like(prefix, dtype=torch.bool), resp, rmask, tok.pad_token_id)
    full = score(reward_model, inputs, rmask, with_grad=True, batch_size=4)
    rows = torch.tensor([True, False, True, True, False, False])
    part = score(reward_model, inputs, rmask, with_grad=True, batch_size=4, grad_rows=rows)
    torch.testing.assert_close(part.scores, full.scores, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(part.grad[rows], full.grad[rows], rtol=1e-5, atol=1e-6)  # other prompts forwarded together
    assert not part.grad[~rows].any()
    none = score(reward_model, inputs, rmask, with_grad=True, batch_size=4, grad_rows=torch.zeros(6, dtype=torch.bool))
    assert none.grad.shape == full.grad.shape and not none.grad.any()


def test_credit_diagnostics_ignore_responses_without_advantage():
    w = torch.tensor([[2.0, 0.0, 1.0], [1.0, 1.0, 1.0], [5.0, 0.0, 0.0]])
    scores = torch.tensor([[3.0, 1.0, 2.0], [0.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    out = CreditOutput(w, scores, torch.tensor([False, True, False]), "per_response")
    mask = torch.ones(3, 3, dtype=torch.bool)
    with_zero = credit_metrics(out, torch.tensor([1.0, 0.0, 0.0]), mask, None)
    alone = credit_metrics(dataclasses.replace(out, weights=w[:1], scores=scores[:1], fallback=out.fallback[:1]),
                           torch.tensor([1.0]), mask[:1], None)
    assert with_zero == alone and with_zero["credit/weight_max"] == 2.0 and with_zero["credit/score_p50"] == 2.0
    none = credit_metrics(out, torch.zeros(3), mask, None)
    assert none.keys() == alone.keys() and math.isnan(none["credit/weight_mean"]) and none["credit/fallback_frac"] == 0.0


def test_row_separable_schemes_are_row_local_and_a_new_scheme_is_not_separable_by_default():
    # which schemes declare it is verified, scheme by scheme, in
    # tests/credit/test_registry_generic.py::test_a_row_separable_scheme_gives_each_row_the_same_weights_alone
    separable = {n for n in CREDIT_SCHEMES.names() if CREDIT_SCHEMES.get(n).row_separable}
    assert {"grpo", "datc"} <= separable and all(CREDIT_SCHEMES.get(n).row_local for n in separable)
    assert not credit_scheme("mine")(lambda batch, params: batch.response_mask.float()).row_separable  # conservative


def test_the_option_is_a_validated_bool_that_names_no_other_run():
    from hydra import compose, initialize_config_dir

    from datc.paths import CONFIG_DIR

    assert validate(cfg_for("c", "r")).trainer.skip_zero_advantage is True
    with pytest.raises(ConfigError, match="skip_zero_advantage"):
        validate(cfg_for("c", "r", "trainer.skip_zero_advantage=maybe"))
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        names = {compose(config_name="train", overrides=[f"trainer.skip_zero_advantage={v}"]).run_name
                 for v in ("true", "false")}
    assert len(names) == 1  # how the step runs, not what it computes: a run resumes across it
