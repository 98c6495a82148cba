"""The equality protocol of a structural change: the same debug runs on two source trees (the
commit before and the commit after), compared for what a refactoring must not change.

    python -m scripts.dev.equality_runs --before /path/to/old/checkout --after . --out /tmp/eq

For each case (a set of Hydra overrides covering one special case of the step, below), both trees
train it from one prepare cache; the check is that ``metrics.jsonl`` is equal row for row without
the ``perf/*`` timings, the final policy's parameters are ``torch.equal``, and ``datc-compare``
over each side's runs gives the same figures (its ``runs.csv`` equal but for the timings, the
commit and the source paths; the files that hold timings are reported, not required, to match). Prints one line per case and exits 1 on
any difference. Two-process cases run through ``datc-launch`` (DeepSpeed on CPU over gloo).
"""

from __future__ import annotations

import argparse
import csv
import filecmp
import json
import os
import subprocess
import sys
from pathlib import Path

CASES = {  # name -> overrides (every one with debug=fast)
    "grpo": ["credit=grpo"],
    "datc": ["credit=datc"],
    "datc-off-policy": ["credit=datc", "trainer.epochs=2"],  # old log-probs pass, the left-out rows' pass
    "datc-skip-off": ["credit=datc", "trainer.skip_zero_advantage=false"],
    "entropy_top": ["credit=entropy_top"],  # a global normalization
    "delta": ["credit=delta"],  # hidden states
    "gcpo": ["credit=gcpo"],  # log-probs under other prompts
    "datc-llama-trunk": ["credit=datc", "policy=tiny_llama", "+reward.init=policy", "+reward.train.trainable_layers=1"],
    "datc-lora": ["credit=datc", "policy.lora.r=4"],
    "datc-recompute": ["credit=datc", "trainer.reuse_rollout_logits=never", "trainer.micro_batch_size=4"],
    "grpo-zero2-2proc": ["credit=grpo", "deepspeed=zero2", "--nproc=2"],
    "datc-zero3-2proc": ["credit=datc", "deepspeed=zero3", "--nproc=2"],
    "datc-fsdp2-2proc": ["credit=datc", "backend=fsdp2", "--nproc=2"],
}


TIMING_AND_PROVENANCE = ("step_s", "wall_time_s", "git_commit", "source")


def _run(tree: Path, case: str, overrides: list[str], out: Path, cache: Path) -> Path:
    run_dir = out / case
    nproc = next((int(o.split("=")[1]) for o in overrides if o.startswith("--nproc=")), 1)
    args = [o for o in overrides if not o.startswith("--nproc=")]
    env = {**os.environ, "PYTHONPATH": str(tree), "DATC_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    # datc-launch's module, in whichever layout the tree has (it moved with the floors)
    launch = "datc.commands.launch" if (tree / "datc" / "commands" / "launch.py").exists() else "datc.backends.launch"
    cmd = [sys.executable, "-m", launch, "--nproc", str(nproc), "--master-port", "29730",
           "debug=fast", *args, f"cache_dir={cache}", f"run_dir={run_dir}", f"results_dir={out / 'results'}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tree, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{case} on {tree}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return run_dir


def _metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]


def _params(run_dir: Path):
    import torch
    from safetensors.torch import load_file

    files = sorted((run_dir / "final").glob("*.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(f))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.dev.equality_runs", description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, type=Path)
    p.add_argument("--after", required=True, type=Path)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--cases", nargs="*", default=list(CASES))
    a = p.parse_args(argv)
    import torch

    cache = a.out / "cache"
    bad = 0
    for case in a.cases:
        dirs = [_run(tree.resolve(), case, CASES[case], a.out / side, cache)
                for side, tree in (("before", a.before), ("after", a.after))]
        same_metrics = _metrics(dirs[0]) == _metrics(dirs[1])
        pa, pb = _params(dirs[0]), _params(dirs[1])
        same_params = pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)
        ok = same_metrics and same_params and bool(pa)
        bad += not ok
        print(f"{case}: metrics {'equal' if same_metrics else 'DIFFER'}, final parameters "
              f"{'torch.equal' if same_params else 'DIFFER'} ({len(pa)} tensors)", flush=True)
    outs = []
    for side, tree in (("before", a.before), ("after", a.after)):
        dst = a.out / f"compare-{side}"
        env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
        proc = subprocess.run([sys.executable, "-m", "datc.compare", str(a.out / side), "--out", str(dst)], env=env,
                              capture_output=True, text=True, cwd=tree)
        if proc.returncode != 0:
            raise SystemExit(f"datc-compare on {tree}: {proc.stderr[-2000:]}")
        outs.append(dst)
    files = sorted(p.name for p in outs[0].iterdir() if p.is_file() and p.suffix in (".md", ".csv", ".json"))
    _, mismatch, errors = filecmp.cmpfiles(outs[0], outs[1], files, shallow=False)
    print(f"datc-compare: {len(files) - len(mismatch) - len(errors)} of {len(files)} files byte-identical"
          + (f"; differ: {mismatch + errors}" if mismatch or errors else ""))
    # Timings, the commit and the source paths differ between two trees by design: every other
    # column of every run must be the same.
    rows = [list(csv.DictReader((d / "runs.csv").open())) for d in outs]
    cols = [k for k in rows[0][0] if k not in TIMING_AND_PROVENANCE] if rows[0] else []
    same = len(rows[0]) == len(rows[1]) and all(x[k] == y[k] for x, y in zip(*rows, strict=True) for k in cols)
    bad += not same
    print(f"datc-compare runs.csv: {len(rows[0])} runs, columns {', '.join(cols)} "
          f"{'identical' if same else 'DIFFER'} (not compared: {', '.join(TIMING_AND_PROVENANCE)})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
