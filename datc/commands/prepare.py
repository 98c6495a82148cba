"""``datc-prepare``: fill the cache for a config without training (the same overrides as
``datc-train``): the testbed's warm start and reward model, or a real model's files, by
:func:`datc.prepare.assets.ensure_assets`."""

from __future__ import annotations

import logging

import torch

from datc.prepare.assets import ensure_assets


def main() -> None:
    """``datc-prepare``: fill the cache for a config without training (same overrides as datc-train)."""
    import json
    import sys

    import hydra
    from omegaconf import DictConfig

    from datc.checks import validate
    from datc.config import ConfigError
    from datc.models.build import ModelLoadError
    from datc.paths import CONFIG_DIR

    @hydra.main(config_path=CONFIG_DIR, config_name="train", version_base="1.3")
    def _prepare(cfg: DictConfig) -> None:
        logging.basicConfig(level=logging.INFO)
        try:
            c = validate(cfg)
            torch.set_num_threads(c.trainer.threads)
            a = ensure_assets(c)
        except (ConfigError, ModelLoadError, FileNotFoundError) as e:
            print(f"datc-prepare: {e}", file=sys.stderr)
            sys.exit(2)
        print(json.dumps({"tokenizer": a.tokenizer_path, "policy": a.policy_path, "reward": a.reward_path,
                          "rm_report": a.rm_report}, indent=2))

    sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=none", "hydra/hydra_logging=none", "hydra.run.dir=."]
    _prepare()


if __name__ == "__main__":
    main()
