"""Where a scheme's credit lands (METHOD §6, "where credit lands"): its token credit by quintile of
the sampled token's probability ``π_old(y_t)`` and by token class, on the same responses for every
scheme (``datc-credit-accuracy`` collects the tokens, :func:`breakdown` reports them).

Per token with ``A ≠ 0`` (pure tensors in, plain numbers out):

- ``aligned = sign(A)·c_t``: the gold contribution signed by the advantage (> 0: the token earned
  its response's advantage; < 0: it worked against it);
- ``judged = sign(A)·s_t``: the scheme's score (its weight for a scheme that returns weights) times
  the advantage's sign, which a scheme that credits well ranks like ``c_t`` (the oracle's is
  ``c_t`` itself), and ``z``: ``judged`` standardized over its response's tokens (mean 0,
  standard deviation 1; 0 where a response has one token or constant scores), so the sizes
  compare across responses and schemes;
- ``w``: the credit weight the loss applies.

Per quintile (edges over every recorded token's ``π_old(y_t)``, so each holds a fifth) and per class
(``earned``: aligned > 0, ``neutral``: c_t = 0, ``against``: aligned < 0, and the end-of-text token
by the advantage's sign): the tokens, the share of the gold mass ``Σ|c_t|`` there, the **sign
accuracy** (fraction of the tokens with ``c_t ≠ 0`` whose ``judged`` has ``c_t``'s sign; a zero
score counts as wrong), the mean ``|z|`` (how strongly the scheme singles the tokens out), the
**separation** (mean ``z`` over the tokens with ``c_t > 0`` minus over those with ``c_t < 0``; > 0:
ranked the right way round), and the mean weight.

The Jacobian hypothesis of METHOD §6 (DATC's map multiplies each token's work by about ``π_y``, so
it would mute the uncertain tokens) predicts, against ``datc_identity`` on the same tokens, a lower
mean ``|z|`` and sign accuracy in the lowest quintiles, where the gold mass lies if credit matters
there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

N_BINS = 5
CLASSES = ("earned", "neutral", "against", "end token, A > 0", "end token, A < 0")


@dataclass
class Tokens:
    """The recorded tokens, one entry per token with ``A ≠ 0``, concatenated over batches."""

    prob: list[Tensor] = field(default_factory=list)  # π_old(y_t)
    contrib: list[Tensor] = field(default_factory=list)  # c_t
    aligned: list[Tensor] = field(default_factory=list)  # sign(A)·c_t
    end: list[Tensor] = field(default_factory=list)  # the response's end-of-text token
    adv_sign: list[Tensor] = field(default_factory=list)
    schemes: dict[str, dict[str, list[Tensor]]] = field(default_factory=dict)  # name -> judged, z, w

    def add_batch(self, prob: Tensor, contrib: Tensor, adv: Tensor, mask: Tensor, end: Tensor) -> Tensor:
        """Record a batch's shared fields: ``prob``, ``contrib``, ``end`` (B, T), ``adv`` (B,),
        ``mask`` (B, T) the response tokens. Returns the mask of the recorded tokens (``A ≠ 0``)."""
        m = mask & (adv != 0)[:, None]
        s = torch.sign(adv)[:, None].expand_as(contrib)
        self.prob.append(prob[m].float())
        self.contrib.append(contrib[m].float())
        self.aligned.append((s * contrib)[m].float())
        self.end.append(end[m])
        self.adv_sign.append(s[m])
        return m

    def add_scheme(self, name: str, judged_scores: Tensor, weights: Tensor, adv: Tensor, m: Tensor) -> None:
        """A scheme's (B, T) scores (its weights if it returns none) and weights on the batch whose
        recorded mask ``m`` :meth:`add_batch` returned."""
        judged = torch.sign(adv)[:, None] * judged_scores.float()
        rec = self.schemes.setdefault(name, {"judged": [], "z": [], "w": []})
        rec["judged"].append(judged[m])
        rec["z"].append(standardize_rows(judged, m)[m])
        rec["w"].append(weights.float()[m])


def standardize_rows(x: Tensor, mask: Tensor) -> Tensor:
    """``x`` standardized over each row's masked entries (population standard deviation); 0 where
    a row has fewer than two or constant entries, and off the mask."""
    m = mask.float()
    n = m.sum(-1, keepdim=True)
    mean = (x * m).sum(-1, keepdim=True) / n.clamp_min(1)
    var = (((x - mean) * m) ** 2).sum(-1, keepdim=True) / n.clamp_min(1)
    std = var.sqrt()
    ok = (n >= 2) & (std > 1e-12 * (mean.abs() + 1))
    return torch.where(ok & mask, (x - mean) / std.clamp_min(1e-30), torch.zeros_like(x))


def quintile_edges(prob: Tensor, n_bins: int = N_BINS) -> Tensor:
    """The inner edges splitting ``prob`` into ``n_bins`` equal-count bins."""
    q = torch.linspace(0, 1, n_bins + 1, dtype=torch.float64)[1:-1]
    return torch.quantile(prob.double(), q)


def _group(contrib: Tensor, judged: Tensor, z: Tensor, w: Tensor, sel: Tensor, gold_total: float) -> dict[str, float | int | None]:
    def mean(x: Tensor) -> float | None:
        return float(x.double().mean()) if x.numel() else None

    c, j = contrib[sel], judged[sel]
    nz = c != 0
    up, down = z[sel][c > 0], z[sel][c < 0]
    sep = None if not up.numel() or not down.numel() else float(up.double().mean() - down.double().mean())
    return {
        "tokens": int(sel.sum()),
        "gold_share": float(c.abs().sum() / gold_total) if gold_total > 0 else None,
        "sign_accuracy": mean((torch.sign(j[nz]) == torch.sign(c[nz])).float()) if nz.any() else None,
        "mean_abs_z": mean(z[sel].abs()),
        "separation": sep,
        "mean_weight": mean(w[sel]),
    }


def breakdown(tokens: Tokens, n_bins: int = N_BINS) -> dict:
    """Per scheme: the groups by quintile of ``π_old(y_t)`` and by class, and the edges used."""
    prob, contrib, aligned = torch.cat(tokens.prob), torch.cat(tokens.contrib), torch.cat(tokens.aligned)
    end, sign = torch.cat(tokens.end), torch.cat(tokens.adv_sign)
    edges = quintile_edges(prob, n_bins)
    bins = torch.bucketize(prob.double(), edges, right=True)  # bin k: edges[k-1] <= p < edges[k]
    classes = {"earned": aligned > 0, "neutral": aligned == 0, "against": aligned < 0,
               "end token, A > 0": end & (sign > 0), "end token, A < 0": end & (sign < 0)}
    gold_total = float(contrib.abs().sum())
    out = {"edges": [float(e) for e in edges], "tokens": int(prob.numel()), "schemes": {}}
    for name, rec in tokens.schemes.items():
        judged, z, w = (torch.cat(rec[k]) for k in ("judged", "z", "w"))
        out["schemes"][name] = {
            "by_quintile": [_group(contrib, judged, z, w, bins == k, gold_total) for k in range(n_bins)],
            "by_class": {c: _group(contrib, judged, z, w, sel, gold_total) for c, sel in classes.items()},
        }
    return out


def breakdown_markdown(result: dict) -> list[str]:
    """The breakdown's tables, one per measure, schemes as rows."""
    def f(x):
        return "n/a" if x is None else f"{x:.3f}"

    e = result["edges"]
    names = [f"Q{k + 1} ({'0' if k == 0 else f'{e[k - 1]:.2g}'}–{'1' if k == len(e) else f'{e[k]:.2g}'})" for k in range(len(e) + 1)]
    schemes = result["schemes"]
    lines = [f"## Where credit lands: by quintile of π_old(y_t) and by token class ({result['tokens']} tokens with A ≠ 0)", ""]
    first = next(iter(schemes.values()), None)
    if first is not None:
        lines += ["Gold mass share (`Σ|c_t|` there over all): " + ", ".join(
            f"{n} {f(g['gold_share'])}" for n, g in zip(names, first["by_quintile"], strict=True)) + "; tokens per class: " + ", ".join(
            f"{c} {g['tokens']}" for c, g in first["by_class"].items()) + ".", ""]
    for key, label in (("sign_accuracy", "sign accuracy"), ("mean_abs_z", "mean |z|"), ("separation", "z separation (c > 0 minus c < 0)"),
                       ("mean_weight", "mean weight")):
        lines += [f"**{label}**", "", "| scheme | " + " | ".join(names) + " | " + " | ".join(CLASSES) + " |",
                  "|---|" + "---|" * (len(names) + len(CLASSES))]
        for n, r in schemes.items():
            lines.append(f"| {n} | " + " | ".join(f(g[key]) for g in r["by_quintile"]) + " | "
                         + " | ".join(f(r["by_class"][c][key]) for c in CLASSES) + " |")
        lines.append("")
    return lines


def plot_breakdown(result: dict, path, title: str) -> None:
    """Three panels over the quintiles of π_old(y_t): the gold mass share, each scheme's sign
    accuracy and its mean |z|; written atomically to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from datc.atomic import atomic_write_bytes

    schemes = result["schemes"]
    if not schemes:
        return
    k = range(1, len(result["edges"]) + 2)
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    first = next(iter(schemes.values()))
    axes[0].bar(list(k), [g["gold_share"] or 0 for g in first["by_quintile"]], color="0.6")
    axes[0].set_title("gold mass share")
    for name, r in schemes.items():
        for ax, key in ((axes[1], "sign_accuracy"), (axes[2], "mean_abs_z")):
            ax.plot(list(k), [float("nan") if g[key] is None else g[key] for g in r["by_quintile"]], marker="o", label=name)
    axes[1].set_title("sign accuracy")
    axes[2].set_title("mean |z| (how strongly singled out)")
    for ax in axes:
        ax.set_xlabel("quintile of π_old(y_t) (1: least likely)")
        ax.set_xticks(list(k))
    axes[2].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
