"""A hand-made tuned sweep (datc-compare --tuned's input): one setting, grpo's rate search and
datc's rate then tau search on selection seeds, both evaluated on evaluation seeds (the tuning,
matched-KL and tuned-sweep tests')."""

from __future__ import annotations

import json
from pathlib import Path

from datc.study.reading import MANIFEST

LR = 5e-4
SELECT, EVAL = [100, 101], {"0": [200, 201], "1": [202, 203]}
SPECS = {
    "grpo": {"lr": LR, "lr_grid": [LR / 2, LR, 2 * LR], "knob": None, "knob_default": None, "knob_grid": []},
    "datc": {"lr": LR, "lr_grid": [LR / 2, LR, 2 * LR], "knob": "credit.tau", "knob_default": 1.0,
             "knob_grid": [0.5, 1.0, 2.0]},
}


def write_run(folder: Path, credit: str, seed: int, lr: float, gold: float, tau: float | None = None,
              draw: int = 0, collapse_step: int | None = None, kl: float = 0.1) -> None:
    name = f"keywords-tiny_gpt2-{credit}-p{draw}-s{seed}-lr{lr:g}-tau{tau}"
    d = folder / name
    d.mkdir(parents=True, exist_ok=True)
    cred = {"name": credit, **({} if tau is None else {"tau": tau, "lam": 1.0})}
    ident = {"seed": seed, "prepare_seed": draw, "trainer": {"lr": lr, "steps": 80}, "credit": cred,
             "data": {"name": "keywords"}, "policy": {"name": "tiny_gpt2"}}
    (d / "run.json").write_text(json.dumps({"run_id": name, "identity": ident}))
    summary = {"run_name": name, "seed": seed, "credit": credit, "data": "keywords", "policy": "tiny_gpt2",
               "steps": 80, "eval": {"final": {"eval/gold": gold, "eval/rm_score": gold, "eval/kl": kl}},
               "length_collapse": {"step": collapse_step}}
    (d / "summary.json").write_text(json.dumps(summary))


def sweep(root: Path) -> Path:
    """One setting: grpo's rate search, datc's rate then tau search, and both evaluated."""
    folder = root / "keywords-tiny_gpt2"
    folder.mkdir(parents=True)
    (folder / MANIFEST).write_text(json.dumps({
        "setting": {"data": "keywords", "policy": "tiny_gpt2"},
        "selection": {"prepare_seed": 0, "seeds": SELECT}, "evaluation": {"seeds": EVAL}, "schemes": SPECS}))
    sel, ev = folder / "select", folder / "eval"
    for i, seed in enumerate(SELECT):
        # grpo: x1 and x2 tie at the top (0.30): the tie keeps the default
        for lr, g in ((LR / 2, 0.10), (LR, 0.30), (2 * LR, 0.30)):
            write_run(sel, "grpo", seed, lr, g)
        # datc, rate at tau 1: x2 best (0.50); then tau at x2: 0.5 best (0.60 +- 0.02)
        for lr, g in ((LR / 2, 0.20), (LR, 0.40), (2 * LR, 0.50)):
            write_run(sel, "datc", seed, lr, g, tau=1.0)
        write_run(sel, "datc", seed, 2 * LR, 0.58 + 0.04 * i, tau=0.5)
        write_run(sel, "datc", seed, 2 * LR, 0.10, tau=2.0)
        # off the coordinate path (tau 0.5 at the default rate): never chosen, however good
        write_run(sel, "datc", seed, LR, 0.99, tau=0.5)
    for draw, seeds in EVAL.items():
        for seed in seeds:
            write_run(ev, "grpo", seed, LR, 0.2 + 0.01 * (seed % 3), draw=int(draw))
            write_run(ev, "datc", seed, 2 * LR, 0.5 + 0.01 * (seed % 3), tau=0.5, draw=int(draw),
                      collapse_step=7 if seed == 203 else None)
            write_run(ev, "datc", seed, LR, 0.3 + 0.01 * (seed % 3), tau=1.0, draw=int(draw))
    return folder
