"""``datc-train`` / ``python -m datc.train``: the Hydra entry point.

    datc-train credit=grpo policy=tiny_llama data=arithmetic trainer.steps=40
    datc-train -m credit=grpo seed=0,1,2 policy=tiny_gpt2,tiny_llama
"""

from __future__ import annotations

import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from datc.paths import CONFIG_DIR
from datc.training.job import JobRefused, hydra_error_line, lost_peer_line, train_job

__all__ = ["CONFIG_DIR", "hydra_error_line", "lost_peer_line", "main"]


def _run(cfg: DictConfig) -> float | None:
    from datc.run.signals import until_said

    run_dir = HydraConfig.get().runtime.output_dir
    with until_said():  # a launcher's SIGTERM as the run fails does not swallow its line
        try:
            summary = train_job(cfg, run_dir, note=lambda: in_process_sweep_note(HydraConfig.get(), cfg))
        except JobRefused as e:
            print(e.line, file=sys.stderr, flush=True)
            sys.exit(e.code)
    ev = summary["eval"]
    if os.environ.get("RANK", "0") == "0":  # rank 0 speaks for a multi-process run
        print(f"run {summary['run_name']}: eval gold {_num(ev['initial'].get('eval/gold'))} -> {_num(ev['final'].get('eval/gold'))}, "
              f"rm score {_num(ev['initial'].get('eval/rm_score'))} -> {_num(ev['final'].get('eval/rm_score'))}")
    return ev["final"].get("eval/gold")  # the sweep objective


def in_process_sweep_note(hc, cfg) -> str | None:
    """A warning for the second and later jobs of a ``-m`` sweep that sample with vLLM in this one
    process (Hydra's basic launcher runs the jobs one after another in it): vLLM's compilation
    leaves about 0.1 GB behind per job at the real scale with every object of the run collected
    (``results/bench/job_memory_vllm.md``), so a long sweep grows with its jobs.
    None otherwise (a single run, the first job, another engine, another launcher)."""
    from hydra.types import RunMode

    basic = str(hc.launcher.get("_target_", "")).endswith("BasicLauncher")
    if hc.mode != RunMode.MULTIRUN or not basic or int(hc.job.num) < 1 or cfg.rollout.name != "vllm":
        return None
    return (f"job {hc.job.num} of this sweep runs in the same process as the jobs before it, and vLLM's compilation "
            "leaves about 0.1 GB in the process per job at a real model's scale (results/bench/job_memory_vllm.md): for a "
            "long sweep run each job in a process of its own (hydra/launcher=submitit_local; datc-study: docs/study.md)")


def _num(x) -> str:
    return f"{x:.3f}" if isinstance(x, (int, float)) else "n/a"


@hydra.main(config_path=CONFIG_DIR, config_name="train", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> float | None:
    return _run(cfg)


def main() -> None:
    from hydra.errors import HydraException

    from datc.run.lifeline import die_with_launcher

    die_with_launcher()  # under datc-launch: this process ends with it, however it ends
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises its errors to us instead of printing many lines
    try:
        _hydra_main()
    except HydraException as e:
        print(f"datc-train: {hydra_error_line(e)}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("datc-train: interrupted (SIGINT) before training started; nothing to save", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
