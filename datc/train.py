"""``datc-train`` / ``python -m datc.train``: the Hydra entry point.

    datc-train credit=grpo policy=tiny_llama data=arithmetic trainer.steps=40
    datc-train -m credit=grpo seed=0,1,2 policy=tiny_gpt2,tiny_llama
"""

from __future__ import annotations

import difflib
import errno
import os
import re
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from datc.checks import validate
from datc.config import MOVED_KEYS, ConfigError, valid_keys
from datc.paths import CONFIG_DIR
from datc.run.runlock import remove_new_dirs

__all__ = ["CONFIG_DIR", "main"]


def _run(cfg: DictConfig) -> float | None:
    run_dir = HydraConfig.get().runtime.output_dir
    try:
        validate(cfg)  # before the heavy imports below: a bad value is said in about a second
    except ConfigError as e:
        remove_new_dirs(run_dir)
        print(f"datc-train: {e}", file=sys.stderr)
        sys.exit(2)
    from datc.engines.base import EngineError
    from datc.math.numerics import NonFiniteError
    from datc.models.build import ModelLoadError
    from datc.run.signals import Interrupted
    from datc.training.trainer import train

    if (line := in_process_sweep_note(HydraConfig.get(), cfg)) is not None:
        from datc.errors import warn

        warn(line)
    try:
        summary = train(cfg, run_dir=run_dir)
    except (ConfigError, ModelLoadError, FileNotFoundError, NonFiniteError) as e:
        remove_new_dirs(run_dir)  # a refused command leaves no directory behind
        print(f"datc-train: {e}", file=sys.stderr)
        sys.exit(2)
    except Interrupted as e:
        remove_new_dirs(run_dir)  # stopped in the set-up of a fresh run: nothing of it stays
        print(f"datc-train: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            remove_new_dirs(run_dir)
            raise
        from datc.run.checkpoint import latest_checkpoint

        last = latest_checkpoint(run_dir)
        print(f"datc-train: no space left on device writing {e.filename or run_dir} ({e.strerror}); "
              f"{'the last good checkpoint ' + last.name + ' is kept' if last else 'no checkpoint was written yet'}: "
              "free space and run the same command again to resume", file=sys.stderr)
        sys.exit(2)
    except EngineError as e:  # mid-run: the checkpoints stay, the same command resumes
        from datc.run.checkpoint import latest_checkpoint

        last = latest_checkpoint(run_dir)
        print(f"datc-train: {e}; {'the last checkpoint ' + last.name + ' is kept' if last else 'no checkpoint was written yet'}: "
              "run the same command again to resume", file=sys.stderr)
        sys.exit(1)
    except Exception as e:
        if (lost := lost_peer_line(e, run_dir)) is not None:  # another rank of this run ended: one line
            print(lost, file=sys.stderr)
            sys.exit(1)
        remove_new_dirs(run_dir)  # an unexpected error: its traceback follows, and no stray directory
        raise
    ev = summary["eval"]
    if os.environ.get("RANK", "0") == "0":  # rank 0 speaks for a multi-process run
        print(f"run {summary['run_name']}: eval gold {_num(ev['initial'].get('eval/gold'))} -> {_num(ev['final'].get('eval/gold'))}, "
              f"rm score {_num(ev['initial'].get('eval/rm_score'))} -> {_num(ev['final'].get('eval/rm_score'))}")
    return ev["final"].get("eval/gold")  # the sweep objective


# What gloo, NCCL and torch's stores say when the other end of a collective is gone or silent
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
            "long sweep run each job as its own command (scripts/tuned_sweep.py does: --process-per-job)")


_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "timed out", "Timed out",
         "NCCL communicator was aborted", "failed to recv", "Socket closed")


def lost_peer_line(e: BaseException, run_dir) -> str | None:
    """One line for a collective that failed because another rank of a multi-process run ended
    (killed, out of memory, its node lost) or stopped answering within the collective timeout
    (``backend.timeout_s``); None for any other error (its traceback follows)."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    text = str(e)
    if world < 2 or not any(s in text for s in _LOST):
        return None
    from datc.run.checkpoint import latest_checkpoint

    last = latest_checkpoint(run_dir)
    first = text.strip().splitlines()[0][:160] if text.strip() else type(e).__name__
    return (f"datc-train: rank {os.environ.get('RANK', '?')} of {world}: another process of this run ended or stopped "
            f"answering (killed, out of memory, or its node lost), so this one stops too ({type(e).__name__}: {first}); "
            f"{'its last checkpoint is ' + last.name if last else 'no checkpoint was written yet'}: run the same "
            "command again to resume")


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


def hydra_error_line(e: Exception) -> str:
    """One line for Hydra's own composition errors (an unknown option of a config group, an
    unknown key, a malformed override), naming the group or key and the valid choices."""
    options = getattr(e, "options", None)
    missing = getattr(e, "missing_cfg_file", None)
    if options is not None and missing:
        group, _, choice = str(missing).rpartition("/")
        return f"{group}={choice}: no such option in {group}/; choose one of {', '.join(options)}"
    key = getattr(e.__cause__, "full_key", None)
    if key in MOVED_KEYS:
        return f"{key}: moved to {MOVED_KEYS[key]} (the vLLM engine's own settings are rollout.vllm.*)"
    if key:
        parent, _, last = key.rpartition(".")
        valid = valid_keys(parent)
        hint = f"; valid keys{' of ' + parent if parent else ''}: {', '.join(valid)}" if valid else ""
        close = difflib.get_close_matches(last, valid + (_groups() if not parent else []), n=1, cutoff=0.75)
        if close:  # a typo of a key or a config group (crdit=datc): say which, not how to add a new key
            valid_line = f" Valid keys{' of ' + parent if parent else ''}: {', '.join(valid)}" if valid else ""
            return f"{key}: not a config key; did you mean `{parent + '.' if parent else ''}{close[0]}`?{valid_line}"
        return f"{key}: not a config key{hint} (add one with +{key}=...)"
    lines = [ln.strip() for ln in str(e).split("Config search path")[0].splitlines() if ln.strip()]
    line = " ".join(lines) or type(e).__name__
    if "LexerNoViableAltException" in line or "mismatched input" in line or "extraneous input" in line:
        found = re.search(r"([\w.+~]+)=", line)
        key = found.group(1) if found else "key"
        line += (f"; a value with spaces, quotes or non-ASCII characters must be quoted for Hydra, inside the shell's "
                 f"quotes: '{key}=\"...\"' (with an apostrophe in the value: \"{key}=\\\"...\\\"\")")
    return line


def _groups() -> list[str]:
    """The config groups (``configs/<group>/``), experiment and debug included."""
    return sorted(p.name for p in Path(CONFIG_DIR).iterdir() if p.is_dir() and p.name != "hydra")


if __name__ == "__main__":
    main()
