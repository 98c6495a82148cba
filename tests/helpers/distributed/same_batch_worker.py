"""Run by ``torchrun`` from tests/e2e/test_distributed.py (and called in-process there for the one-process
references, plain PyTorch): a few training steps in which every process samples the same *global*
rollout batch from the same seed and keeps its share of whole groups, so a 2-process DeepSpeed run
and a 1-process plain run see exactly the same responses. Several configurations run one after the
other in the same processes (one process group, one interpreter start for all of them); each
session is built from the same seed. Writes, from rank 0, per configuration the per-step global
losses and grad norms and the final policy parameters.

    python tests/helpers/distributed/same_batch_worker.py OUT.pt SPEC.json    # SPEC: {name: [override, ...]}
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from hydra import compose, initialize_config_dir

from datc.backends.plugins import gathered
from datc.backends.plugins import init as init_distributed
from datc.checks import validate
from datc.paths import CONFIG_DIR
from datc.step import learn
from datc.step.sample import rollout
from datc.training.session import build_session
from datc.utils import quiet_libraries

SESSION_SEED = 0  # the global RNG before each session is built (LoRA's adapters draw from it)


def run_one(overrides: list[str]) -> dict:
    """One configuration's steps; its result on rank 0 ({} on the others)."""
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        c = validate(compose(config_name="train", overrides=overrides))
    t = c.trainer
    dist = init_distributed(c)  # joins the process group once; later configurations find it joined
    torch.manual_seed(SESSION_SEED)
    s = build_session(c, dist)
    steps = []
    for it in range(t.steps):
        torch.manual_seed(1000 + it)  # the same global batch on every rank
        examples = [s.assets.train[i] for i in s.sampler.indices(it)]
        with s.autocast():
            ro = rollout(s, examples, keep_logits=False)  # the global batch; then this rank's share of whole groups
            metrics = learn(s, it, ro.select(dist.shard(ro.response_ids.shape[0])), time.perf_counter()).metrics
        steps.append({k: metrics[k] for k in ("loss/total", "loss/grad_norm", "loss/kl", "reward/rm_score")})
    params = {n: gathered(p).float().clone() for n, p in s.m.policy.named_parameters()}
    out = {"steps": steps, "params": params, "world_size": dist.world_size,
           "share_prompts": s.plan.share_prompts, "share_update_prompts": s.plan.share_update_prompts,
           "gather_generation": s.plan.gather_generation,
           "synced": s.plan.synced_gpus, "backend": s.backend.name} if dist.is_main else {}
    dist.barrier()
    return out


def run_all(spec: dict[str, list[str]]) -> dict[str, dict]:
    """Every configuration of ``spec`` in turn; {name: result} (rank 0's; {} on the others)."""
    torch.set_num_threads(1)
    quiet_libraries()
    results = {}
    for name, overrides in spec.items():
        results[name] = run_one(overrides)
    if torch.distributed.is_initialized():  # joined by the first configuration, left after the last
        torch.distributed.destroy_process_group()
    return results


def main(out: str, spec_file: str) -> None:
    results = run_all(json.loads(open(spec_file).read()))
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(results, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
