"""Credit schemes: the registry and the one entry point the trainer calls.

Schemes live one per module in :mod:`datc.credit.schemes` (imported automatically) or in the
user's own module, named by ``_target_`` in a ``configs/credit/*.yaml`` file.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Iterable
from typing import Any

import torch

from datc.credit.base import (
    NEEDS,
    CreditBatch,
    CreditOutput,
    CreditScheme,
    NoParams,
    Normalization,
    Output,
)
from datc.registry import Registry

CREDIT_SCHEMES: Registry[CreditScheme] = Registry("credit scheme")

__all__ = [
    "CREDIT_SCHEMES",
    "CreditBatch",
    "CreditOutput",
    "CreditScheme",
    "compute_credit",
    "credit_scheme",
    "register_credit",
    "resolve_scheme",
    "scheme_key",
    "check_credit",
]


def credit_scheme(
    name: str,
    *,
    needs: Iterable[str] = (),
    output: Output = "weights",
    normalization: Normalization = "per_response",
    params: type = NoParams,
    row_local: bool = False,
    row_separable: bool = False,
) -> Callable[[Callable], CreditScheme]:
    """Wrap a function as a :class:`CreditScheme` without registering it (for ``_target_``)."""
    needs = frozenset(needs)
    unknown = needs - NEEDS
    if unknown:
        raise ValueError(f"scheme {name!r} declares unknown inputs {sorted(unknown)}; known: {sorted(NEEDS)}")
    if output not in ("scores", "weights"):
        raise ValueError(f"scheme {name!r}: output must be 'scores' or 'weights', got {output!r}")

    def deco(fn: Callable) -> CreditScheme:
        return CreditScheme(name, fn, needs, output, normalization, params, (fn.__doc__ or "").strip(), row_local,
                            row_separable)

    return deco


def register_credit(name: str, **kwargs: Any) -> Callable[[Callable], CreditScheme]:
    """Decorator: build a :class:`CreditScheme` and register it by name (duplicates refused)."""

    def deco(fn: Callable) -> CreditScheme:
        return CREDIT_SCHEMES.register(name)(credit_scheme(name, **kwargs)(fn))

    return deco


def _import_schemes() -> None:
    from datc.credit import schemes

    for mod in pkgutil.iter_modules(schemes.__path__):
        importlib.import_module(f"{schemes.__name__}.{mod.name}")


def resolve_scheme(credit_cfg: dict[str, Any]) -> tuple[CreditScheme, Any]:
    """Turn a ``credit`` config node into (scheme, params).

    ``name`` is the run's label (run names, tables, plots, summaries). ``scheme: <registered>``
    picks the registered scheme that computes it, default ``name`` (so an ablation that only
    changes a default is a config over its scheme's: ``name: datc_unsigned``, ``scheme: datc``,
    ``direction: unsigned``); ``_target_: pkg.module.obj`` imports a user's scheme instead (a
    :class:`CreditScheme`, e.g. made with :func:`credit_scheme`). All other fields are the
    scheme's parameters, checked against its params dataclass.
    """
    fields = dict(credit_cfg)
    target = fields.pop("_target_", None)
    name = fields.pop("name", None)
    key = fields.pop("scheme", None)
    if target is not None:
        if key is not None:
            raise ValueError(f"credit: give a registered 'scheme' ({key!r}) or a '_target_' ({target!r}), not both")
        from hydra.utils import get_object

        scheme = get_object(target)
        if not isinstance(scheme, CreditScheme):
            raise ValueError(
                f"credit._target_ {target!r} is a {type(scheme).__name__}, not a CreditScheme; "
                "decorate the function with datc.credit.credit_scheme(...)"
            )
    elif key is not None or name is not None:
        scheme = CREDIT_SCHEMES.get(scheme_key(credit_cfg))
    else:
        raise ValueError(f"credit needs a 'name' (one of {CREDIT_SCHEMES.names()}) or a '_target_'")
    return scheme, scheme.make_params(fields)


def check_credit(c) -> None:
    """``credit``: a registered scheme (or a ``_target_``) whose options resolve, said in one
    line before any model loads."""
    from datc.errors import ConfigError
    from datc.registry import RegistryError

    key = scheme_key(c.credit)  # credit.scheme, else credit.name (the run's label)
    if "_target_" not in c.credit and key not in CREDIT_SCHEMES:
        field = "credit.scheme" if c.credit.get("scheme") is not None else "credit.name"
        raise ConfigError(
            f"{field}: {key!r} is not a registered credit scheme; "
            f"choose one of {', '.join(CREDIT_SCHEMES.names())} or give a _target_"
            + ("" if field == "credit.scheme" else " (or a registered credit.scheme, with credit.name as its label)")
        )
    try:
        resolve_scheme(c.credit)
    except (ValueError, TypeError, ImportError, RegistryError) as e:
        raise ConfigError(f"credit: {e}") from None


def scheme_key(credit_cfg: Any) -> str | None:
    """The registry key of a ``credit`` config node: its ``scheme``, else its ``name`` (None
    for a ``_target_`` scheme, which is imported, not registered)."""
    if credit_cfg.get("_target_") is not None:
        return None
    key = credit_cfg.get("scheme")
    return credit_cfg.get("name") if key is None else key


@torch.no_grad()
def compute_credit(scheme: CreditScheme, batch: CreditBatch, params: Any) -> CreditOutput:
    """Run a scheme on a batch and return token weights (METHOD §1: ``Â = A · w``).

    Score-based schemes go through the shared weight step of METHOD §2.5
    (:func:`datc.credit.weights.scores_to_weights`); weight-returning schemes are taken as they
    are, with masked positions zeroed.

    Schemes and the weight step run outside any autocast region (the trainer's step runs inside
    one under ``policy.dtype: bfloat16``): their matrix products stay in their inputs' precision
    (float32 or float64), as the schemes' own math promises, instead of being cast to bf16.
    """
    with torch.autocast(batch.response_mask.device.type, enabled=False):
        return _compute_credit(scheme, batch, params)


def _compute_credit(scheme: CreditScheme, batch: CreditBatch, params: Any) -> CreditOutput:
    mask = batch.response_mask
    missing = [n for n in scheme.needs if getattr(batch, n) is None]
    if missing:
        raise ValueError(f"credit scheme {scheme.name!r} needs {missing}, which the trainer did not fill")
    out = scheme.fn(batch, params).detach()
    if out.shape != mask.shape:
        raise ValueError(f"credit scheme {scheme.name!r} returned shape {tuple(out.shape)}, expected {tuple(mask.shape)}")
    if scheme.output == "scores":
        from datc.credit.weights import WeightParams, scores_to_weights

        if not isinstance(params, WeightParams):
            raise TypeError(
                f"credit scheme {scheme.name!r} returns scores, so its params must subclass "
                f"datc.credit.weights.WeightParams (the shared weight step's fields); got {type(params).__name__}"
            )
        weights, fallback = scores_to_weights(out, mask, params, batch.response_end)
        return CreditOutput(weights, out, fallback, "per_response")
    weights = torch.where(mask, out.float(), torch.zeros((), dtype=torch.float32))
    fallback = torch.zeros(mask.shape[0], dtype=torch.bool, device=mask.device)
    return CreditOutput(weights, None, fallback, scheme.normalization)


_import_schemes()
