"""The reward model's scores of single-token edits (``rm_counterfactual``'s cost), prefix-cached
against the edited rows scored whole, side by side in one run, written to
results/bench/edit_scores.{json,md}.

A sequence-classification reward model built from a local causal LM (default: the prepared
SmolLM2-135M of ``experiment=real_smollm2``, ``datc-prepare`` makes it; its score head is
freshly initialized, which does not change the cost), one torch thread, ``--rows`` responses of
``--prompt`` + ``--response`` random tokens, ``--k`` edits at every response position (as
``rm_counterfactual`` with K draws makes them). Timed: :func:`datc.forward.attribution.rm_edit_scorer`
prefix-cached at each ``--chunks`` edits per forward, and the edited rows scored whole
(``datc.rewards.model.score``, each prompt once per forward) at 512 per forward, the path before
the prefix cache. The largest score difference between the two paths is reported too.

    python -m scripts.bench.edit_scores [--model DIR] [--rows 10] [--k 4] [--chunks 64 512]
"""

from __future__ import annotations

import argparse
import glob
import sys
import time
from pathlib import Path

import torch

from datc.atomic import atomic_write_json, atomic_write_text
from datc.forward.attribution import rm_edit_scorer
from datc.models.rm_inputs import build_rm_inputs
from datc.rewards.model import score
from datc.run.provenance import load_average, provenance
from datc.utils import quiet_libraries

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "results" / "bench"


def whole(*args, **kw):
    """The stock scorer behind another name: :func:`rm_edit_scorer` then scores every edited row whole."""
    return score(*args, **kw)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m scripts.bench.edit_scores", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a local causal LM directory (default: the prepared SmolLM2-135M)")
    ap.add_argument("--rows", type=int, default=10)
    ap.add_argument("--prompt", type=int, default=40)
    ap.add_argument("--response", type=int, default=31)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--chunks", type=int, nargs="+", default=[64, 512])
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args()
    quiet_libraries()
    torch.set_num_threads(1)
    from transformers import AutoModelForSequenceClassification

    model = a.model or next(iter(sorted(glob.glob(str(ROOT / ".cache/datc/models/smollm2_135m-*")))), None)
    if model is None:
        raise SystemExit("no --model and no prepared SmolLM2 (run: datc-prepare experiment=real_smollm2)")
    rm = AutoModelForSequenceClassification.from_pretrained(model, num_labels=1, dtype=torch.float32).eval()
    rm.config.pad_token_id = 0
    g = torch.Generator().manual_seed(0)
    B, P, T, K = a.rows, a.prompt, a.response, a.k
    vocab = rm.get_input_embeddings().weight.shape[0]
    prefix = torch.randint(100, vocab, (B, P), generator=g)
    resp = torch.randint(100, vocab, (B, T), generator=g)
    pmask, rmask = torch.ones(B, P, dtype=torch.bool), torch.ones(B, T, dtype=torch.bool)
    inputs = build_rm_inputs(prefix, pmask, resp, rmask, 0)
    w = rmask.nonzero()
    rows, pos = w[:, 0].repeat_interleave(K), w[:, 1].repeat_interleave(K)
    new = torch.randint(100, vocab, rows.shape, generator=g)
    load0 = load_average()
    cases, out = {}, {}
    for name, fn, chunk in [*((f"prefix_cached_{c}", score, c) for c in a.chunks), ("whole_rows_512", whole, 512)]:
        t0 = time.perf_counter()
        out[name] = rm_edit_scorer(fn, rm, inputs, rmask, batch_size=8)(rows, pos, new, chunk)
        cases[name] = {"seconds": round(time.perf_counter() - t0, 2), "edits_per_forward": chunk}
    base = cases["whole_rows_512"]["seconds"]
    for name, c in cases.items():
        c["ms_per_edit"] = round(1000 * c["seconds"] / len(rows), 1)
        c["speedup_vs_whole"] = round(base / c["seconds"], 2)
        c["max_abs_score_diff_vs_whole"] = float((out[name] - out["whole_rows_512"]).abs().max())
    result = {**provenance(" ".join(["python -m scripts.bench.edit_scores", *sys.argv[1:]])),
              "model": Path(model).name, "rows": B, "prompt": P, "response": T, "k": K, "edits": len(rows), "threads": 1,
              "load_average_before_after": [load0[0], load_average()[0]], "cases": cases}
    a.out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(a.out / "edit_scores.json", result)
    lines = [f"# Reward-model scores of single-token edits: prefix-cached vs whole rows ({result['model']})", "",
             f"`{result['command']}` at commit {result['commit']}, one torch thread on a {result['machine']['cpus']}-core CPU, "
             f"load average {result['load_average_before_after'][0]} before, {result['load_average_before_after'][1]} after; "
             f"{B} responses of {P} prompt + {T} response tokens, K = {K} edits per position: {len(rows)} edits.", "",
             "| path | edits per forward | seconds | ms per edit | speedup vs whole rows | max score diff |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {n} | {c['edits_per_forward']} | {c['seconds']} | {c['ms_per_edit']} | {c['speedup_vs_whole']}x | "
              f"{c['max_abs_score_diff_vs_whole']:.1e} |" for n, c in cases.items()]
    atomic_write_text(a.out / "edit_scores.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
