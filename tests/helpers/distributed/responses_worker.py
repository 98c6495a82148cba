"""Run by ``torchrun`` for tests/e2e/test_deterministic.py: whole training runs
(:func:`datc.training.trainer.train`) one after the other in the same processes, each recording
the responses of every step's rollout on this rank (:class:`datc.step.ops.StepOps`'s ``observe``),
keyed by their prompt, into ``OUT.rank<r>.json``.

    python tests/helpers/distributed/responses_worker.py SPEC.json OUT    # SPEC: {name: [override, ...]}
"""

from __future__ import annotations

import json
import sys

import torch
from hydra import compose, initialize_config_dir

from datc.paths import CONFIG_DIR
from datc.step.ops import StepOps
from datc.training.trainer import train


def recorder(steps: list[dict[str, list[list[int]]]]):
    """An ``observe`` that appends each rollout's responses, {prompt row as JSON: [ids of each
    response, in group order]}, to ``steps``."""
    def observe(phase: str, result) -> None:
        if phase != "rollout":
            return
        out: dict[str, list[list[int]]] = {}
        for ex, ids, mask in zip(result.examples, result.response_ids, result.response_mask, strict=True):
            out.setdefault(json.dumps(ex, sort_keys=True), []).append(ids[mask].tolist())
        steps.append(out)
    return observe


def main(spec_file: str, out: str) -> None:
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    recorded = {}
    for name, overrides in json.loads(open(spec_file).read()).items():
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
            cfg = compose(config_name="train", overrides=overrides)
        recorded[name] = []
        train(cfg, ops=StepOps(observe=recorder(recorded[name])))
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(recorded, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
