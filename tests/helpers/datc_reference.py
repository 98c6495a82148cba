"""The slow reference of DATC's scores (METHOD §2 steps 2-4 with explicit ``ρ_t, J_t, f_t, u_t``
vectors, one token at a time), against which the tests check :mod:`datc.credit.datc_math`'s fast
paths. Tests only: nothing in ``datc`` imports it."""

from __future__ import annotations

import torch
from torch import Tensor


def reference_force(
    g: Tensor, E: Tensor, logits: Tensor, logit_map: str, top_k: int | None = None
) -> Tensor:
    """(N, V) explicit ``f_t = J_t ρ_t`` or ``ρ_t - mean ρ_t``, one token at a time."""
    pi = reference_pi(logits, top_k)
    out = []
    for t in range(g.shape[0]):
        rho = E @ g[t]  # (V,)
        if logit_map == "jacobian":
            jac = torch.diag(pi[t]) - torch.outer(pi[t], pi[t])  # (V, V)
            out.append(jac @ rho)
        else:
            out.append(rho - rho.mean())
    return torch.stack(out)


def reference_scores(
    g: Tensor,
    E: Tensor,
    logits: Tensor,
    y: Tensor,
    sign: Tensor,
    *,
    logit_map: str,
    alignment: str,
    top_k: int | None = None,
) -> Tensor:
    """(N,) METHOD §2 steps 2-4 with explicit ``ρ_t, J_t, f_t, u_t`` vectors (tests only)."""
    pi = reference_pi(logits, top_k)
    f = reference_force(g, E, logits, logit_map, top_k)
    out = []
    for t in range(g.shape[0]):
        u = sign[t] * (torch.nn.functional.one_hot(y[t], pi.shape[-1]).to(pi) - pi[t])
        work = f[t] @ u
        den = {"work": 1.0, "projection": u.norm(), "cosine": f[t].norm() * u.norm()}[alignment]
        out.append(work / den if den > 0 else torch.zeros_like(work))
    return torch.stack(out)


def reference_pi(logits: Tensor, top_k: int | None = None) -> Tensor:
    """(N, V) ``softmax(logits)``, restricted to its ``top_k`` largest entries and renormalised."""
    pi = torch.softmax(logits, dim=-1)
    if top_k is None or top_k >= pi.shape[-1]:
        return pi
    keep = torch.zeros_like(pi).scatter(-1, pi.topk(top_k, dim=-1).indices, 1.0)
    pi = pi * keep
    return pi / pi.sum(-1, keepdim=True)
