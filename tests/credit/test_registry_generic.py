"""Every registered credit scheme, on a random batch that fills every CreditBatch field.

Checks what holds for any scheme (METHOD §3, §4): (B, T) weights, finite, no gradient, zero on
masked positions; for per-response-normalized schemes, weights >= 0 with mean 1 per response
(to 1e-6, float32); for score-based schemes, lam = 0 gives GRPO's weights bit for bit. Also
every configs/credit/*.yaml resolves to its scheme.
"""

import dataclasses
from pathlib import Path

import pytest
import torch
import yaml

from datc.credit import CREDIT_SCHEMES, compute_credit, resolve_scheme
from datc.credit.base import CreditBatch, end_of_text
from datc.credit.configs import credit_config, credit_config_names, credit_labels
from datc.credit.weights import WeightParams

B, T, V, D = 6, 7, 23, 8
CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs" / "credit"
# Schemes of this module's author whose YAML must list every field at its default (or, for a
# config over another, every field through the one it is over).
COMPLETE_CONFIGS = [
    "datc",
    "datc_unsigned",
    "datc_identity",
    "datc_magnitude",
    "datc_shuffled",
    "rm_saliency",
    "datc_end_neutral",
]


def random_batch(seed: int = 0) -> CreditBatch:
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, T, V, generator=gen) * 2).requires_grad_()
    ids = torch.randint(V, (B, T), generator=gen)
    logp = torch.log_softmax(logits.detach(), -1)

    def logps_under(prompts: list[str]) -> torch.Tensor:
        # Another prompt shifts the logits by noise that depends on the prompt texts.
        assert len(prompts) == B and all(isinstance(p, str) for p in prompts)
        shift = torch.randn(B, T, V, generator=torch.Generator().manual_seed(sum(map(len, prompts))))
        return torch.log_softmax(logits.detach() + shift, -1).gather(-1, ids[..., None]).squeeze(-1)

    fillers = {
        "response_ids": ids,
        "response_mask": torch.arange(T) < torch.tensor([7, 1, 4, 7, 2, 5])[:, None],
        "advantages": torch.tensor([1.2, -0.4, 0.9, -1.5, 0.3, 0.0]),
        "rm_grad": torch.randn(B, T, D, generator=gen).requires_grad_(),
        "rm_embedding": torch.randn(V, D, generator=gen),
        "policy_logits": logits,
        "entropy": -(logp.exp() * logp).sum(-1),
        "old_logps": logp.gather(-1, ids[..., None]).squeeze(-1),
        "prompts": [f"write about topic {i // 2} :" for i in range(B)],
        "logps_under": logps_under,
        "policy_hidden": torch.randn(B, T, D, generator=gen),
        "gold_contrib": torch.randint(-1, 2, (B, T), generator=gen).float() / 16,
        "rm_scores": torch.randn(B, generator=gen),
        "rm_edit_scores": lambda rows, positions, new, rows_per_forward=None: (  # a reward of (response, position, token)
            torch.sin(rows * 1.3 + positions * 0.7 + new * 0.11).float()),
        "policy_grad_x_input": torch.randn(B, T, D, generator=gen),
        "response_end": end_of_text(torch.arange(T) < torch.tensor([7, 1, 4, 7, 2, 5])[:, None],
                                    torch.tensor([True, False, False, False, False, False])),  # row 0 ran out of budget
        "generator": torch.Generator().manual_seed(seed),
        "all_sum": None,  # one process (2-process reductions: tests/e2e/test_distributed.py)
        "all_cat": None,
    }
    missing = [f.name for f in dataclasses.fields(CreditBatch) if f.name not in fillers]
    assert not missing, f"add a random filler for CreditBatch field(s) {missing} in {__file__}"
    return CreditBatch(**fillers)


@pytest.mark.parametrize("name", CREDIT_SCHEMES.names())
def test_scheme_contract(name):
    scheme = CREDIT_SCHEMES.get(name)
    batch = random_batch()
    mask = batch.response_mask
    out = compute_credit(scheme, batch, scheme.make_params({}))
    w = out.weights
    assert w.shape == (B, T) and w.dtype == torch.float32
    assert torch.isfinite(w).all() and not w.requires_grad
    assert (w[~mask] == 0).all()
    assert out.fallback.shape == (B,) and out.fallback.dtype == torch.bool
    if scheme.output == "scores":
        assert out.scores is not None and out.scores.shape == (B, T)
    if out.normalization == "per_response":
        assert (w >= 0).all()
        mean = (w * mask).sum(-1) / mask.sum(-1)
        assert torch.allclose(mean, torch.ones(B), atol=1e-6, rtol=0)


WEIGHT_STEP_SCHEMES = [
    n for n in CREDIT_SCHEMES.names() if issubclass(CREDIT_SCHEMES.get(n).params, WeightParams)
]


@pytest.mark.parametrize("name", WEIGHT_STEP_SCHEMES)
def test_lambda_zero_is_grpo(name):
    scheme = CREDIT_SCHEMES.get(name)
    batch = random_batch(1)
    out = compute_credit(scheme, batch, scheme.make_params({"lam": 0.0}))
    assert torch.equal(out.weights, batch.response_mask.float())


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.yaml")), ids=lambda p: p.stem)
def test_config_resolves(path):
    cfg = credit_config(path.stem)  # as credit=<stem> composes it (defaults lists followed)
    assert cfg["name"] == path.stem  # the label is the option's name
    scheme, params = resolve_scheme(cfg)
    assert scheme is CREDIT_SCHEMES.get(cfg.get("scheme", path.stem))
    own = yaml.safe_load(path.read_text())  # the file alone
    changed = {}
    if "defaults" in own:  # a config over another: the base's fields, then this file's
        base = [d for d in own["defaults"] if d != "_self_"]
        assert own["defaults"][-1] == "_self_" and len(base) == 1, own["defaults"]
        fields = {k: v for k, v in own.items() if k != "defaults"}
        assert cfg == {**credit_config(base[0]), **fields}
        changed = {k: v for k, v in fields.items() if k not in ("name", "scheme")}
    if path.stem in COMPLETE_CONFIGS:
        fields = {f.name for f in dataclasses.fields(scheme.params)}
        assert set(cfg) - {"name", "scheme"} == fields
        assert params == scheme.params(**changed)  # every other value is the dataclass default


def test_a_config_over_another_is_a_label_not_a_registered_scheme():
    for name, field, value in (("datc_identity", "logit_map", "identity"), ("datc_unsigned", "direction", "unsigned")):
        cfg = credit_config(name)
        assert (cfg["name"], cfg["scheme"], cfg[field]) == (name, "datc", value)
        assert name not in CREDIT_SCHEMES and name in credit_labels()
    assert set(CREDIT_SCHEMES.names()) <= set(credit_labels()) and credit_labels() == sorted(credit_labels())
    assert credit_config_names() == sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
    with pytest.raises(ValueError, match="credit=nope: no such option in credit/; choose one of datc, (.*, )?datc_identity"):
        credit_config("nope")


# ---- row-separability: what the zero-advantage skip relies on --------------------------------------


def _rows_of(batch: CreditBatch, rows: torch.Tensor, seen_prompts: list[str]) -> CreditBatch:
    """``batch``'s responses ``rows`` alone, as the step hands a scheme the rows it computes: every
    per-response field selected; the per-batch ones (the RM's embedding) kept; the batch's
    functions answer for the selected rows as they did for the whole batch."""
    idx = rows.tolist()
    out = {}
    for f in dataclasses.fields(CreditBatch):
        v = getattr(batch, f.name)
        if f.name == "logps_under":
            def sub(prompts, fn=v):
                assert prompts == [seen_prompts[i] for i in idx]  # the same prompts, for the rows asked
                return fn(seen_prompts)[rows]
            out[f.name] = sub
        elif f.name == "rm_edit_scores":
            out[f.name] = lambda r, p, n, rows_per_forward=None, fn=v: fn(rows[r], p, n, rows_per_forward)
        elif isinstance(v, torch.Tensor) and f.name != "rm_embedding" and v.shape[:1] == (B,):
            out[f.name] = v.detach()[rows].requires_grad_(v.requires_grad)
        elif isinstance(v, list) and len(v) == B:
            out[f.name] = [v[i] for i in idx]
        else:
            out[f.name] = v
    return CreditBatch(**out)


@pytest.mark.parametrize("name", [n for n in CREDIT_SCHEMES.names() if CREDIT_SCHEMES.get(n).row_separable])
def test_a_row_separable_scheme_gives_each_row_the_same_weights_alone(name):
    # The zero-advantage skip (datc/step/rows.py) computes credit on the rows with A != 0 only, for
    # a scheme that declares row_separable: verified here for every registered scheme that does,
    # so a new scheme's declaration is checked, not listed by hand.
    scheme = CREDIT_SCHEMES.get(name)
    assert scheme.row_local  # row-separable implies row-local (tests/step/test_zero_advantage_skip.py)
    batch, seen = random_batch(2), []
    if batch.logps_under is not None:
        full_fn = batch.logps_under
        batch = dataclasses.replace(batch, logps_under=lambda prompts: seen.extend(prompts) or full_fn(prompts))
    whole = compute_credit(scheme, batch, scheme.make_params({})).weights
    rows = torch.nonzero(batch.advantages != 0).squeeze(-1)[[0, 2, 3]]
    alone = compute_credit(scheme, _rows_of(random_batch(2), rows, seen or batch.prompts), scheme.make_params({})).weights
    torch.testing.assert_close(alone, whole[rows], rtol=1e-5, atol=1e-6)


def test_the_row_check_catches_a_scheme_that_reads_other_rows():
    from datc.credit import credit_scheme

    @credit_scheme("batch_mean", output="weights", normalization="none", row_local=True, row_separable=True)
    def batch_mean(batch, params):  # declares row-separable but reads every row
        return batch.response_mask.float() * batch.advantages.abs().mean()

    batch, rows = random_batch(2), torch.tensor([0, 2, 3])
    whole = compute_credit(batch_mean, batch, batch_mean.make_params({})).weights
    alone = compute_credit(batch_mean, _rows_of(batch, rows, batch.prompts), batch_mean.make_params({})).weights
    assert not torch.allclose(alone, whole[rows])
