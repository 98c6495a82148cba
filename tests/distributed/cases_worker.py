"""Run by ``torchrun`` (or alone, one process) from tests/test_fsdp2.py: several cases in one
process group, each a few training steps in which every process samples the same *global* rollout
batch from the same seed and keeps its share of whole groups (as tests/distributed/same_batch_worker.py
does for one case), so a 2-process run and a 1-process run see exactly the same responses. One
interpreter and one process group for all cases: the start-up is paid once. Writes, from rank 0,
``OUT_<i>.pt`` per case: the per-step global losses and grad norms, the final policy parameters
(whole) and the plan's placement decisions.

    python tests/distributed/cases_worker.py OUT override... [:: override...]...
"""

from __future__ import annotations

import sys
import time

import torch
from hydra import compose, initialize_config_dir

from datc.backends.plugins import gathered
from datc.backends.plugins import init as init_distributed
from datc.config import validate
from datc.paths import CONFIG_DIR
from datc.step import learn, rollout
from datc.training.session import build_session
from datc.utils import quiet_libraries


def run_case(overrides: list[str], dist=None):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        c = validate(compose(config_name="train", overrides=overrides))
    dist = dist or init_distributed(c)
    s = build_session(c, dist)
    steps = []
    for it in range(c.trainer.steps):
        torch.manual_seed(1000 + it)  # the same global batch on every rank
        examples = [s.assets.train[i] for i in s.sampler.indices(it)]
        with s.autocast():
            ro = rollout(s, examples, keep_logits=False)  # the global batch; then this rank's share of whole groups
            metrics = learn(s, it, ro.select(dist.shard(ro.response_ids.shape[0])), time.perf_counter()).metrics
        steps.append({k: metrics[k] for k in ("loss/total", "loss/grad_norm", "loss/kl", "reward/rm_score")})
    params = {n: gathered(p).float().clone() for n, p in s.m.policy.named_parameters()}
    out = {"steps": steps, "params": params, "world_size": dist.world_size, "share_prompts": s.plan.share_prompts,
           "gather_generation": s.plan.gather_generation, "synced": s.plan.synced_gpus, "backend": s.backend.name}
    return out, dist


def main(out: str, argv: list[str]) -> None:
    torch.set_num_threads(1)
    quiet_libraries()
    cases, cur = [], []
    for a in argv:
        if a == "::":
            cases.append(cur)
            cur = []
        else:
            cur.append(a)
    cases.append(cur)
    dist = None
    for i, overrides in enumerate(cases):
        result, dist = run_case(overrides, dist)
        if dist.is_main:
            torch.save(result, f"{out}_{i}.pt")
        dist.barrier()
    dist.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
