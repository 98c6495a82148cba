"""What a policy's samples look like token by token: the distribution of per-token entropy
(nats) and of the sampled token's probability ``pi_y`` under the sampling distribution
(temperature applied), and response lengths. Written to ``<out>/<data>-<policy>.{json,md}``.

    python -m scripts.results.rollout_stats [--batches 4] [--out results/real_model/rollout_stats] [hydra overrides ...]

The prompts are the first ``batches x prompts-per-batch`` training prompts, each sampled
``trainer.num_generations`` times with the session's policy, chat template and temperature.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def quantiles(x: torch.Tensor) -> dict[str, float]:
    q = torch.quantile(x.double(), torch.tensor([0.25, 0.5, 0.75], dtype=torch.double)).tolist()
    return {"mean": float(x.double().mean()), "q25": q[0], "median": q[1], "q75": q[2]}


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="python -m scripts.results.rollout_stats", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "real_model" / "rollout_stats")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args(args)
    from hydra import compose, initialize_config_dir

    from datc.atomic import atomic_write_json, atomic_write_text
    from datc.checks import validate
    from datc.data.prompts import load_prompts
    from datc.engines.generate import sample_groups
    from datc.models.build import load_pretrained
    from datc.models.chat import prompt_encoder
    from datc.models.tokenizer import load_tokenizer
    from datc.paths import CONFIG_DIR
    from datc.prepare.assets import ensure_assets, materialize_gguf
    from datc.run.provenance import provenance
    from datc.utils import quiet_libraries

    quiet_libraries()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        c = validate(compose(config_name="train", overrides=a.overrides))
    torch.set_num_threads(c.trainer.threads)
    # The policy only: a GGUF preset needs no reward model here; a testbed one needs its warm start.
    path = materialize_gguf(c.policy, Path(c.cache_dir)) if c.policy.gguf_file else ensure_assets(c).policy_path
    tok = load_tokenizer(path)
    policy = load_pretrained("causal_lm", path, "policy.path").eval()
    encoder = prompt_encoder(c, tok)
    train_rows = load_prompts(c.data, c.cache_dir)[0]
    torch.manual_seed(c.seed)
    t = c.trainer
    per_batch = t.batch_size // t.num_generations
    ents, pis, lens, trunc = [], [], [], []
    for b in range(a.batches):
        examples = [train_rows[i] for i in range(b * per_batch, (b + 1) * per_batch)]
        with torch.no_grad():
            ro = sample_groups(policy, tok, examples, t.num_generations, t.max_new_tokens, t.temperature, t.top_p,
                               c.data.prompt_field, keep_logits=True, encoder=encoder)
        logp = torch.log_softmax(ro.logits.float() / t.temperature, -1)  # (B, T, V) the sampling distribution
        ent = -(logp.exp() * logp).sum(-1)  # (B, T) nats
        pi_y = logp.gather(-1, ro.response_ids[..., None]).squeeze(-1).exp()  # (B, T)
        mask = ro.response_mask
        ents.append(ent[mask].cpu())
        pis.append(pi_y[mask].cpu())
        lens.append(mask.sum(-1).cpu())
        trunc.append(ro.truncated.cpu())
    ent, pi, ln, tr = torch.cat(ents), torch.cat(pis), torch.cat(lens).float(), torch.cat(trunc).float()
    sample = tok.decode(ro.response_ids[0][ro.response_mask[0]])
    result = {
        **provenance("python -m scripts.results.rollout_stats " + " ".join(args)),
        "setting": f"{c.data.name}-{c.policy.name}", "responses": int(ln.numel()), "tokens": int(ent.numel()),
        "vocab": int(ro.logits.shape[-1]), "max_new_tokens": t.max_new_tokens, "temperature": t.temperature,
        "entropy_nats": {**quantiles(ent), "frac_above_1": float((ent > 1).float().mean()),
                         "uniform": float(torch.log(torch.tensor(float(ro.logits.shape[-1]))))},
        "pi_y": {**quantiles(pi), "frac_above_0.9": float((pi > 0.9).float().mean()),
                 "frac_below_0.1": float((pi < 0.1).float().mean())},
        "length": {**quantiles(ln), "truncated_frac": float(tr.mean())},
        "example": {"prompt": ro.examples[0][c.data.prompt_field], "response": sample},
    }
    name = result["setting"]
    atomic_write_json(a.out / f"{name}.json", result)
    e, p, L = result["entropy_nats"], result["pi_y"], result["length"]
    md = [f"# Rollout statistics: {name}", "", f"Command: `{result['command']}`; {result['responses']} responses, "
          f"{result['tokens']} tokens, |V| = {result['vocab']} (uniform entropy {e['uniform']:.2f} nats).", "",
          "| quantity | q25 | median | q75 | mean | other |", "|---|---|---|---|---|---|",
          f"| entropy (nats) | {e['q25']:.3f} | {e['median']:.3f} | {e['q75']:.3f} | {e['mean']:.3f} | above 1 nat: {e['frac_above_1']:.3f} |",
          f"| pi_y | {p['q25']:.3f} | {p['median']:.3f} | {p['q75']:.3f} | {p['mean']:.3f} | >0.9: {p['frac_above_0.9']:.3f}, <0.1: {p['frac_below_0.1']:.3f} |",
          f"| length (tokens) | {L['q25']:.1f} | {L['median']:.1f} | {L['q75']:.1f} | {L['mean']:.1f} | truncated: {L['truncated_frac']:.3f} |"]
    md += ["", f"A sample: {result['example']['prompt']!r} → {result['example']['response']!r}"]
    atomic_write_text(a.out / f"{name}.md", "\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
