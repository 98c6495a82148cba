"""Run by ``torchrun`` for tests/helpers/distributed/resume.py: several whole training runs
(:func:`datc.training.trainer.train`, the command's own loop: evaluations, checkpoints, resume,
``final/``) one after the other in the same processes. The worker joins the process group
itself, so every run finds it joined and leaves it to the worker (one interpreter start and one
rendezvous for all of them).

    python tests/helpers/distributed/runs_worker.py SPEC.json    # SPEC: {name: [override, ...]}, run_dir among them
"""

from __future__ import annotations

import json
import sys

import torch
from hydra import compose, initialize_config_dir

from datc.paths import CONFIG_DIR
from datc.training.trainer import train


def main(spec_file: str) -> None:
    torch.distributed.init_process_group("gloo")
    for name, overrides in json.loads(open(spec_file).read()).items():
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
            cfg = compose(config_name="train", overrides=overrides)
        print(f"[runs_worker] {name}", file=sys.stderr, flush=True)
        train(cfg)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
