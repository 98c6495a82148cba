"""``rm_counterfactual``: c_t = R(y) - E_{v~π_t} R(y with y_t := v), K draws per position."""

import pytest
import torch

from datc.credit import CREDIT_SCHEMES, CreditBatch, compute_credit, resolve_scheme
from datc.credit.schemes.rm_counterfactual import counterfactual_contributions
from datc.forward.attribution import rm_edit_scorer
from datc.models.rm_inputs import build_rm_inputs
from datc.rewards.model import score

V = 5


def toy_reward(ids: torch.Tensor) -> torch.Tensor:
    """A reward that is not additive over tokens: (B, T) ids -> (B,)."""
    value = torch.tensor([0.0, 1.0, -1.0, 0.5, 2.0], dtype=torch.float64)
    r = value[ids].sum(-1)
    return r + (ids[:, 0] == ids[:, 1]).double() * 0.7  # an interaction between positions 0 and 1


def toy_batch(generator=None):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(V, (3, 4), generator=gen)
    mask = torch.arange(4) < torch.tensor([4, 3, 2])[:, None]
    logits = torch.randn(3, 4, V, generator=gen, dtype=torch.float64)
    calls = []

    def edit_scores(rows, positions, new, rows_per_forward=None):
        calls.append(len(rows))
        edited = ids[rows].clone()
        edited[torch.arange(len(rows)), positions] = new
        return toy_reward(edited).float()

    batch = CreditBatch(ids, mask, torch.tensor([1.0, -0.5, 0.0]), policy_logits=logits,
                        rm_scores=toy_reward(ids).float(), rm_edit_scores=edit_scores, generator=generator)
    return batch, calls


def exact_contributions(batch):
    """Brute force: every alternative token v at every valid position, weighted by π_t(v)."""
    ids, mask = batch.response_ids, batch.response_mask
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for i in range(ids.shape[0]):
        for t in range(ids.shape[1]):
            if not mask[i, t]:
                continue
            pi = torch.softmax(batch.policy_logits[i, t], -1)
            expected = 0.0
            for v in range(V):
                y = ids[i : i + 1].clone()
                y[0, t] = v
                expected += float(pi[v]) * float(toy_reward(y))
            out[i, t] = float(toy_reward(ids[i : i + 1])) - expected
    return out


def test_the_estimator_converges_to_the_brute_force_expectation():
    batch, _ = toy_batch()
    exact = exact_contributions(batch)
    est = counterfactual_contributions(batch.rm_scores, batch.policy_logits, batch.response_mask, batch.rm_edit_scores,
                                       20_000, torch.Generator().manual_seed(1))
    # Monte-Carlo error: the edited rewards' spread is at most ~3, so the standard error of a
    # 20,000-draw mean is below 0.025; 0.08 is three of them.
    torch.testing.assert_close(est.double(), exact, atol=0.08, rtol=0)
    assert (est[~batch.response_mask] == 0).all()
    assert exact.abs().max() > 0.5  # the reference is not trivially zero


def test_k_draws_are_exactly_the_mean_of_the_drawn_edits():
    batch, calls = toy_batch(torch.Generator().manual_seed(7))
    K = 3
    scheme, params = resolve_scheme({"name": "rm_counterfactual", "k": K})
    s = scheme.fn(batch, params)
    # The same draws by hand: row-major over the valid positions of the responses with A != 0.
    g = torch.Generator().manual_seed(7)
    mask = batch.response_mask & (batch.advantages != 0)[:, None]
    expected = torch.zeros(mask.shape)
    where = mask.nonzero()
    pi = torch.softmax(batch.policy_logits[where[:, 0], where[:, 1]], -1)
    draws = torch.multinomial(pi, K, replacement=True, generator=g)
    for n, (i, t) in enumerate(where.tolist()):
        edits = []
        for v in draws[n].tolist():
            y = batch.response_ids[i : i + 1].clone()
            y[0, t] = v
            edits.append(float(toy_reward(y)))
        expected[i, t] = float(torch.sign(batch.advantages[i])) * (float(toy_reward(batch.response_ids[i : i + 1]))
                                                                  - sum(edits) / K)
    torch.testing.assert_close(s, expected)
    assert calls == [K * int(mask.sum())]  # one batched call, K edits per valid token, none for A = 0
    assert (s[2] == 0).all()  # A = 0: no forwards, score 0 (falls back to w = 1)
    out = compute_credit(scheme, batch, params)
    assert out.fallback.tolist() == [False, False, True]


def test_the_sign_of_the_advantage_flips_the_scores():
    batch, _ = toy_batch(torch.Generator().manual_seed(3))
    scheme, params = resolve_scheme({"name": "rm_counterfactual"})
    s = scheme.fn(batch, params)
    batch.advantages = -batch.advantages
    batch.generator = torch.Generator().manual_seed(3)
    torch.testing.assert_close(scheme.fn(batch, params), -s)


def test_bad_k_is_refused():
    with pytest.raises(ValueError, match="k must be an integer >= 1"):
        resolve_scheme({"name": "rm_counterfactual", "k": 0})
    assert not CREDIT_SCHEMES.get("rm_counterfactual").row_local  # one stream of draws over the batch


def test_edit_scorer_scores_the_edited_response_as_a_fresh_input(tok, reward_model):
    # The edited row through the batched scorer equals the reward model's score of that
    # response built from scratch with the replaced token.
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(5, 40, (2, 3), generator=gen)
    pmask = torch.tensor([[False, True, True], [True, True, True]])
    resp = torch.randint(5, 40, (2, 4), generator=gen)
    rmask = torch.tensor([[True, True, True, False], [True, True, True, True]])
    inputs = build_rm_inputs(prefix, pmask, resp, rmask, tok.pad_token_id)
    edit = rm_edit_scorer(score, reward_model, inputs, rmask, batch_size=2)
    rows, pos, new = torch.tensor([0, 1, 1]), torch.tensor([2, 0, 3]), torch.tensor([7, 9, 11])
    got = edit(rows, pos, new)
    for n in range(3):
        r = resp.clone()
        r[rows[n], pos[n]] = new[n]
        fresh = build_rm_inputs(prefix, pmask, r, rmask, tok.pad_token_id)
        want = score(reward_model, fresh, rmask, share=False).scores[rows[n]]
        torch.testing.assert_close(got[n], want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got[:1], score(reward_model, inputs, rmask).scores[:1])  # the edit changed the score


def test_prefix_cached_edits_equal_whole_rows_and_a_replaced_scorer_is_still_called(tok, reward_model):
    # Both families (GPT-2 through its lean read-out, Llama through its own forward): edits at
    # every response position of left-padded prompts and continuations of unequal lengths, in
    # forwards of 3 edits, equal the edited rows scored whole.
    gen = torch.Generator().manual_seed(1)
    prefix = torch.randint(5, 40, (3, 4), generator=gen)
    pmask = torch.tensor([[False, False, True, True], [True, True, True, True], [False, True, True, True]])
    resp = torch.randint(5, 40, (3, 6), generator=gen)
    rmask = torch.arange(6) < torch.tensor([6, 2, 4])[:, None]
    inputs = build_rm_inputs(prefix, pmask, resp, rmask, tok.pad_token_id)
    where = rmask.nonzero()
    rows, pos = where[:, 0].repeat_interleave(2), where[:, 1].repeat_interleave(2)
    new = torch.randint(5, 40, rows.shape, generator=gen)
    cached = rm_edit_scorer(score, reward_model, inputs, rmask, batch_size=3)(rows, pos, new)
    whole = rm_edit_scorer(score, reward_model, inputs, rmask, batch_size=3, share=False)(rows, pos, new)
    torch.testing.assert_close(cached, whole, atol=1e-5, rtol=1e-5)
    assert cached.std() > 1e-3  # the edits move the score: the comparison is not of constants
    seen = []

    def seam(rm, edited, mask, **kw):
        seen.append(edited.input_ids.shape[0])
        return score(rm, edited, mask, **kw)

    torch.testing.assert_close(rm_edit_scorer(seam, reward_model, inputs, rmask, batch_size=3)(rows, pos, new), whole,
                               atol=1e-5, rtol=1e-5)
    assert seen == [len(rows)]  # a session's own scorer gets every edited row
