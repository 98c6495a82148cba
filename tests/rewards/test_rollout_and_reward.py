import torch

from datc.batch import response_mask_from_ids
from datc.engines.generate import sample_groups
from datc.models.rm_inputs import build_rm_inputs
from datc.rewards.model import score


def test_response_mask_includes_first_eos_only():
    eos = 2
    ids = torch.tensor([[5, 6, 2, 7, 2], [5, 5, 5, 5, 5], [2, 0, 0, 0, 0]])
    mask, truncated = response_mask_from_ids(ids, eos)
    assert mask.int().tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    assert truncated.tolist() == [False, True, False]


def test_groups_are_contiguous_and_padded_to_budget(policy, tok):
    rows = [{"prompt": "write about food :"}, {"prompt": "compute 1 plus 2 ="}]
    torch.manual_seed(0)
    ro = sample_groups(policy, tok, rows, 3, 7)
    assert ro.response_ids.shape == (6, 7)
    assert [ex["prompt"] for ex in ro.examples] == ["write about food :"] * 3 + ["compute 1 plus 2 ="] * 3
    # Prompts are left-padded once and repeated for the group.
    assert torch.equal(ro.prompt_ids[0], ro.prompt_ids[2]) and ro.prompt_mask[:, -1].all()
    assert (ro.response_ids[~ro.response_mask] == tok.pad_token_id).all()


def _rows(tok):
    # Hand-made rollout with different prompt and response lengths (EOS in the middle).
    enc = tok(["write about food :", "compute 1 plus 12 ="], padding=True, return_tensors="pt")
    resp = torch.tensor([tok.convert_tokens_to_ids(["bread", "the", "<eos>", "<pad>"]),
                         tok.convert_tokens_to_ids(["answer", "13", "so", "sum"])])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]).bool()
    return enc["input_ids"], enc["attention_mask"].bool(), resp, mask


def test_rm_inputs_splice_ids_and_know_each_position(tok):
    p_ids, p_mask, r_ids, r_mask = _rows(tok)
    inp = build_rm_inputs(p_ids, p_mask, r_ids, r_mask, tok.pad_token_id)
    for i in range(2):
        expected = torch.cat([p_ids[i][p_mask[i]], r_ids[i][r_mask[i]]])
        assert torch.equal(inp.input_ids[i][inp.attention_mask[i]], expected)  # ids as sampled, in order
        assert inp.attention_mask[i, -1]  # the last column is every row's last token: the score is read there
        valid = r_mask[i]
        assert torch.equal(inp.input_ids[i, inp.response_pos[i][valid]], r_ids[i][valid])


def test_scores_match_unpadded_single_rows(tok, reward_model):
    p_ids, p_mask, r_ids, r_mask = _rows(tok)
    inp = build_rm_inputs(p_ids, p_mask, r_ids, r_mask, tok.pad_token_id)
    out = score(reward_model, inp, r_mask, with_grad=True)
    for i in range(2):
        ids = torch.cat([p_ids[i][p_mask[i]], r_ids[i][r_mask[i]]])[None]
        ref = reward_model(input_ids=ids).logits[0, 0]
        torch.testing.assert_close(out.scores[i], ref, atol=1e-5, rtol=1e-5)
    assert out.grad.shape == (2, 4, 32)
    assert (out.grad[0, 3] == 0).all()  # padding gets no gradient
    assert all(p.grad is None for p in reward_model.parameters())  # no parameter gradients


def test_rm_gradient_matches_finite_difference(tok, reward_model):
    # g_t = dR/dh_t: perturb the input embedding at one response token along a random unit
    # direction v; (R(h + e v) - R(h - e v)) / 2e must equal g_t . v. The model runs in float64
    # except Llama's rotary tables (float32 inside transformers), so e = 1e-3 keeps that noise
    # (~1e-7 / e) and the truncation error (O(e^2)) both small: measured errors were < 7e-5
    # at |g.v| ~ 1, so the tolerance is 1e-4 relative (GPT-2 alone passes at 1e-6).
    rm = reward_model.double()
    p_ids, p_mask, r_ids, r_mask = _rows(tok)
    inp = build_rm_inputs(p_ids, p_mask, r_ids, r_mask, tok.pad_token_id)
    out = score(rm, inp, r_mask, with_grad=True)
    from datc.rewards.model import rm_forward

    torch.manual_seed(0)
    for i, t in [(0, 0), (0, 2), (1, 1), (1, 3)]:
        v = torch.randn(32, dtype=torch.float64)
        v /= v.norm()
        eps = 1e-3
        h = rm.get_input_embeddings()(inp.input_ids).detach()
        pos = inp.response_pos[i, t]
        hp, hm = h.clone(), h.clone()
        hp[i, pos] += eps * v
        hm[i, pos] -= eps * v
        with torch.no_grad():
            fd = (rm_forward(rm, hp, inp.attention_mask)[i] - rm_forward(rm, hm, inp.attention_mask)[i]) / (2 * eps)
        gv = float(out.grad[i, t].double() @ v)
        assert abs(float(fd) - gv) < 1e-4 * max(1.0, abs(gv))


def test_kept_generate_logits_equal_a_forward_pass(policy, tok):
    # Credit schemes may read the rollout distribution from generate's logits instead of a
    # second forward pass: both must be the same distribution at every valid position
    # (KV-cached vs full attention differ only by float32 rounding; tolerance 1e-4).
    from datc.forward.passes import rollout_policy_pass

    rows = [{"prompt": "write about food :"}, {"prompt": "compute 1 plus 12 ="}]
    torch.manual_seed(0)
    ro = sample_groups(policy, tok, rows, 3, 6, keep_logits=True)
    z = rollout_policy_pass(policy, ro, 1.0, 8, True).logits
    mk = ro.response_mask
    torch.testing.assert_close(ro.logits[mk], z[mk], atol=1e-4, rtol=1e-4)



def test_gold_of_is_each_rows_task_gold(tok):
    """The batched gold: each row's contributions over its tokens up to the end token (0 from
    there and in the padding), and row sums equal to the task's own ``gold``."""
    from datc.tasks import TASKS, gold_of
    from datc.tasks.keywords import CAMP_WORDS

    task = TASKS.get("keywords")(max_new_tokens=4)
    good, bad = CAMP_WORDS[0][0], CAMP_WORDS[1][0]
    words = [[good, bad, "<eos>", good], ["<eos>", good, good, good], [good, good, "the", bad]]
    ids = torch.tensor([tok.convert_tokens_to_ids(w) for w in words])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]]).bool()  # row 0's last id is padding
    examples = [{"prompt": "write about food :"}] * 3
    gold, contrib = gold_of(task, tok, examples, ids, mask)
    u = 1 / 4
    assert contrib.tolist() == [[u, -u, 0, 0], [0, 0, 0, 0], [u, u, 0, -u]]
    assert contrib.dtype == gold.dtype == torch.float32
    assert gold.tolist() == [task.gold(examples[0], [good, bad]), 0.0, task.gold(examples[2], words[2])]


def test_rows_split_by_gradient():
    from datc.rewards.model import rows_by_gradient

    def split(*a):
        return [(w, r.tolist()) for w, r in rows_by_gradient(*a)]

    some = torch.tensor([True, False, True, False])
    assert split(4, True, some) == [(True, [0, 2]), (False, [1, 3])]
    assert split(4, True, None) == [(True, [0, 1, 2, 3])]
    assert split(4, False, some) == [(False, [0, 1, 2, 3])]  # no gradient asked: grad_rows is moot
    assert split(4, True, torch.zeros(4, dtype=torch.bool)) == [(False, [0, 1, 2, 3])]
    assert split(0, True, None) == []
