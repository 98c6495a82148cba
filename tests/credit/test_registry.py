"""The registry's refusals and compute_credit's checks, each with the message a user sees."""

from __future__ import annotations

import pytest
import torch

from datc.credit import (
    CREDIT_SCHEMES,
    CreditBatch,
    compute_credit,
    credit_scheme,
    register_credit,
    resolve_scheme,
    scheme_key,
)
from datc.credit.base import ENTROPY
from datc.registry import Registry, RegistryError


def _batch():
    return CreditBatch(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.bool), torch.tensor([1.0, -1.0]))


def test_a_duplicate_name_is_refused():
    with pytest.raises(RegistryError, match="'grpo' is already registered"):
        register_credit("grpo")(lambda batch, params: batch.response_mask.float())
    assert CREDIT_SCHEMES.get("grpo").name == "grpo"  # the original is untouched


def test_an_unknown_name_lists_the_registered_ones():
    with pytest.raises(RegistryError) as e:
        Registry("thing").get("nope")
    assert str(e.value) == "unknown thing 'nope'; registered: "
    with pytest.raises(RegistryError) as e:
        resolve_scheme({"name": "nope"})
    assert str(e.value) == f"unknown credit scheme 'nope'; registered: {', '.join(CREDIT_SCHEMES.names())}"
    with pytest.raises(RegistryError, match="unknown credit scheme 'nope'; registered: datc, datc_magnitude"):
        resolve_scheme({"name": "datc_unsigned", "scheme": "nope"})  # the registry key is scheme, not the label


def test_scheme_names_the_registered_scheme_and_name_stays_the_label():
    scheme, params = resolve_scheme({"name": "my_ablation", "scheme": "datc", "direction": "unsigned"})
    assert scheme is CREDIT_SCHEMES.get("datc") and "my_ablation" not in CREDIT_SCHEMES
    assert params.direction == "unsigned"  # scheme is not a parameter: the params dataclass never sees it
    assert resolve_scheme({"scheme": "grpo"})[0] is CREDIT_SCHEMES.get("grpo")
    assert scheme_key({"name": "my_ablation", "scheme": "datc"}) == "datc"
    assert scheme_key({"name": "datc"}) == "datc"
    assert scheme_key({"name": "mine", "_target_": "my.module.mine"}) is None
    with pytest.raises(ValueError, match="a registered 'scheme' \\('datc'\\) or a '_target_'"):
        resolve_scheme({"name": "mine", "scheme": "datc", "_target_": "my.module.mine"})


def test_unknown_declared_inputs_and_outputs_are_refused():
    with pytest.raises(ValueError, match="declares unknown inputs \\['lm_head'\\]"):
        credit_scheme("x", needs={"lm_head"})
    with pytest.raises(ValueError, match="output must be 'scores' or 'weights'"):
        credit_scheme("x", output="probabilities")


def test_unknown_params_name_the_valid_fields():
    with pytest.raises(ValueError, match="has no field\\(s\\) \\['taus'\\]; valid fields: .*'tau'"):
        resolve_scheme({"name": "datc", "taus": 2.0})


def test_a_declared_input_the_trainer_did_not_fill_is_an_error():
    scheme = credit_scheme("needs_entropy", needs={ENTROPY})(lambda batch, params: batch.entropy)
    with pytest.raises(ValueError, match="needs \\['entropy'\\], which the trainer did not fill"):
        compute_credit(scheme, _batch(), scheme.make_params({}))


def test_a_wrong_output_shape_is_an_error():
    scheme = credit_scheme("flat")(lambda batch, params: torch.ones(2))
    with pytest.raises(ValueError, match="returned shape \\(2,\\), expected \\(2, 3\\)"):
        compute_credit(scheme, _batch(), scheme.make_params({}))


def test_a_score_scheme_without_weight_step_params_is_an_error():
    scheme = credit_scheme("bare_scores", output="scores")(lambda batch, params: torch.rand(2, 3))
    with pytest.raises(TypeError, match="must subclass datc.credit.weights.WeightParams"):
        compute_credit(scheme, _batch(), scheme.make_params({}))


def test_schemes_run_outside_the_steps_autocast_region():
    """The training step runs in a bf16 autocast region; compute_credit takes every scheme (and
    the weight step) out of it, so a scheme's matrix products stay in float32."""
    seen = {}

    def product_weights(batch, params):
        seen["autocast"] = torch.is_autocast_enabled("cpu")
        x = batch.advantages[:, None].expand(2, 3).contiguous()
        seen["dtype"] = (x @ x.T).dtype  # bf16 inside an active CPU autocast region
        return batch.response_mask.float()

    scheme = credit_scheme("product_weights")(product_weights)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.is_autocast_enabled("cpu")
        out = compute_credit(scheme, _batch(), scheme.make_params({}))
        assert torch.is_autocast_enabled("cpu")  # restored for the rest of the step
    assert seen == {"autocast": False, "dtype": torch.float32}
    assert out.weights.dtype == torch.float32
