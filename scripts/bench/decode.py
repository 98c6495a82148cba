"""The rollout's two decode loops side by side on CPU, at the testbed's shape (the default trainer's
64 rows = 8 prompts x 8 responses, 16-token responses, shared prompts), for both testbed policies
(configs/policy/tiny_gpt2.yaml and tiny_llama.yaml, random weights, forced to the full length),
written to results/bench/decode_cpu.{json,md}. Chooses what ``trainer.decode=auto`` takes on CPU.

    python -m scripts.bench.decode [--repeats 30] [--threads 1]
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[2]
POLICIES = ("tiny_gpt2", "tiny_llama")


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m scripts.bench.decode", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    a = ap.parse_args()
    from datc.atomic import atomic_write_json, atomic_write_text
    from datc.batch import encode_prompts
    from datc.models.build import build_causal_lm
    from datc.models.tokenizer import build_testbed_tokenizer, load_tokenizer
    from datc.paths import CONFIG_DIR
    from datc.run.provenance import provenance
    from datc.tasks import TASKS
    from datc.utils import quiet_libraries
    from scripts.gpu_check.decode_bench import time_modes

    quiet_libraries()
    torch.set_num_threads(a.threads)
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        tok = load_tokenizer(build_testbed_tokenizer(Path(d) / "tok"))
    rng = random.Random(0)
    task = TASKS.get("keywords")()
    rows = [task.make_example(rng) for _ in range(a.prompts)]
    ids, mask = encode_prompts(tok, rows, "prompt", torch.device("cpu"))
    ids, mask = ids.repeat_interleave(a.generations, 0), mask.repeat_interleave(a.generations, 0)
    results = {}
    for name in POLICIES:
        arch = OmegaConf.to_container(OmegaConf.load(Path(CONFIG_DIR) / "policy" / f"{name}.yaml").arch)
        policy = build_causal_lm(arch, tok, 0).eval()
        with torch.no_grad():
            results[name] = time_modes(policy, ids, mask, a.max_new_tokens, tok.eos_token_id, tok.pad_token_id,
                                       ["dynamic", "static"], a.repeats, prompt_repeats=a.generations)
    cmd = "python -m scripts.bench.decode " + " ".join(sys.argv[1:])
    shape = {"rows": ids.shape[0], "prompt_width": ids.shape[1], "max_new_tokens": a.max_new_tokens,
             "threads": a.threads, "repeats": a.repeats}
    atomic_write_json(ROOT / "results/bench/decode_cpu.json", {**provenance(cmd), "shape": shape, "results": results})
    lines = ["# Decode loops on CPU", "", f"Command: `{cmd}`  ",
             f"{shape['rows']} rows ({a.prompts} prompts x {a.generations}, shared prompts), prompt width "
             f"{shape['prompt_width']}, {a.max_new_tokens} tokens forced, {a.threads} torch thread(s); medians of "
             f"{a.repeats} interleaved calls after one warm-up round. Step: (call - prefill) / (T - 1).", "",
             "| policy | loop | call ms | step ms | tokens/s | static / dynamic |", "|---|---|---|---|---|---|"]
    for name, r in results.items():
        for mode in ("dynamic", "static"):
            ratio = r[mode]["call_s"] / r["dynamic"]["call_s"]
            lines.append(f"| {name} | {mode} | {1e3 * r[mode]['call_s']:.2f} | {1e3 * r[mode]['step_s']:.3f} | "
                         f"{r[mode]['tokens_per_s']:.0f} | {ratio:.2f} |")
    atomic_write_text(ROOT / "results/bench/decode_cpu.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
