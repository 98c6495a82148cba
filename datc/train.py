"""``datc-train`` / ``python -m datc.train``: the Hydra entry point.

    datc-train credit=grpo policy=tiny_llama data=arithmetic trainer.steps=40
    datc-train -m credit=grpo seed=0,1,2 policy=tiny_gpt2,tiny_llama
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from datc.config import ConfigError

CONFIG_DIR = str(Path(__file__).resolve().parents[1] / "configs")


def _run(cfg: DictConfig) -> float | None:
    from datc.models import ModelLoadError
    from datc.numerics import NonFiniteError
    from datc.trainer import train

    try:
        summary = train(cfg, run_dir=HydraConfig.get().runtime.output_dir)
    except (ConfigError, ModelLoadError, FileNotFoundError, NonFiniteError) as e:
        print(f"datc-train: {e}", file=sys.stderr)
        sys.exit(2)
    final = summary["eval"]["final"]
    if os.environ.get("RANK", "0") == "0":  # rank 0 speaks for a multi-process run
            print(f"run {summary['run_name']}: eval gold {summary['eval']['initial'].get('eval/gold')} -> {final.get('eval/gold')}, "
              f"rm score {summary['eval']['initial'].get('eval/rm_score'):.3f} -> {final.get('eval/rm_score'):.3f}")
    return final.get("eval/gold")  # the sweep objective


@hydra.main(config_path=CONFIG_DIR, config_name="train", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> float | None:
    return _run(cfg)


def main() -> None:
    _hydra_main()


if __name__ == "__main__":
    main()
