"""``datc-launch``: start a run on one process, on N local devices, or on several nodes.

    datc-launch credit=datc                                   # one process, no launcher
    datc-launch --nproc 8 deepspeed=zero3 credit=datc         # 8 local devices (or CPU processes)
    datc-launch --hostfile hosts --nproc 8 deepspeed=zero3    # every node listed in hosts, 8 each

It builds the ``deepspeed`` launcher's command line (``--no_local_rank``: ranks come from the
environment, so Hydra overrides pass through untouched) and sets ``OMP_NUM_THREADS`` and
``trainer.threads`` to the machine's cores divided among its processes unless they are given:
the launcher leaves them unset, and oversubscribed CPU threads made a 2-process CPU run about
80× slower. ``--dry-run`` prints the command instead of running it.

Rank 0 speaks for the run: the launcher logs warnings only (not its per-process INFO lines,
such as a ``CUDA_VISIBLE_DEVICES`` that means nothing on a CPU machine), and on a machine
without CUDA ``DS_ACCELERATOR=cpu`` saves every process DeepSpeed's "Setting accelerator to
CPU" warning.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass


@dataclass
class Launch:
    argv: list[str]  # the command
    env: dict[str, str]  # variables added to the environment


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="datc-launch",
        description="Start datc-train on one process, N local devices or several nodes (DeepSpeed launcher).",
        epilog="Everything after the options is passed to datc-train as Hydra overrides.",
    )
    p.add_argument("--nproc", type=int, default=1, help="processes per node (one per GPU; on CPU, processes sharing the cores)")
    p.add_argument("--hostfile", default=None, help="DeepSpeed hostfile ('host slots=N' per line) for multi-node runs")
    p.add_argument("--num-nodes", type=int, default=None, help="use the first N nodes of the hostfile (default: all)")
    p.add_argument("--master-addr", default=None, help="address of rank 0 (multi-node; default: the first host)")
    p.add_argument("--master-port", type=int, default=29500, help="rendezvous port (default 29500)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads per process (default: cores // nproc); sets OMP_NUM_THREADS and trainer.threads")
    p.add_argument("--dry-run", action="store_true", help="print the command and exit")
    p.add_argument("overrides", nargs=argparse.REMAINDER, help="Hydra overrides for datc-train")
    return p


def _stage(overrides: list[str]) -> int | None:
    """The DeepSpeed stage the overrides compose to (an experiment may choose it); the config is
    validated here, so a bad one stops before any process starts."""
    from hydra import compose, initialize_config_dir

    from datc.config import ConfigError, validate
    from datc.paths import CONFIG_DIR

    try:
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
            cfg = compose(config_name="train", overrides=[o for o in overrides if not o.startswith(("hydra.", "hydra/"))])
        return validate(cfg).deepspeed.stage
    except ConfigError as e:
        raise SystemExit(f"datc-launch: {e}") from None
    except Exception as e:  # Hydra's own override errors: name what it said
        raise SystemExit(f"datc-launch: {str(e).splitlines()[0]}") from None


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def build(args: argparse.Namespace, cpu_count: int | None = None, environ: dict[str, str] | None = None,
          cuda: bool | None = None) -> Launch:
    """The command and environment for ``args`` (pure: no process is started). ``cpu_count``,
    ``environ`` and ``cuda`` (whether this machine has a CUDA device) default to this machine's."""
    environ = dict(os.environ) if environ is None else environ
    overrides = [o for o in args.overrides if o != "--"]
    if args.nproc < 1:
        raise SystemExit("datc-launch: --nproc must be >= 1")
    multi = args.nproc > 1 or args.hostfile is not None
    if multi and _stage(overrides) is None:
        raise SystemExit("datc-launch: several processes need a DeepSpeed stage: add deepspeed=zero2, zero3 or zero3_offload")
    threads = args.threads or max(1, (cpu_count or os.cpu_count() or 1) // args.nproc)
    env: dict[str, str] = {}
    if "OMP_NUM_THREADS" not in environ:
        env["OMP_NUM_THREADS"] = str(threads)
    if not any(o.startswith("trainer.threads=") for o in overrides):
        overrides = [*overrides, f"trainer.threads={threads}"]
    if not multi:
        return Launch([sys.executable, "-m", "datc.train", *overrides], env)
    if "DS_ACCELERATOR" not in environ and not (_has_cuda() if cuda is None else cuda):
        env["DS_ACCELERATOR"] = "cpu"  # said, not detected: no "Setting accelerator to CPU" warning per process
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--log_level", "warning"]
    if args.hostfile is not None:
        cmd += ["--hostfile", args.hostfile]
        if args.num_nodes is not None:
            cmd += ["--num_nodes", str(args.num_nodes)]
        if args.nproc > 1:
            cmd += ["--num_gpus", str(args.nproc)]
        if args.master_addr:
            cmd += ["--master_addr", args.master_addr]
    else:
        cmd += ["--num_nodes", "1", "--num_gpus", str(args.nproc)]
    cmd += ["--master_port", str(args.master_port), "--no_local_rank", "--module", "datc.train", *overrides]
    return Launch(cmd, env)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        launch = build(args)
    except SystemExit as e:  # a refused command line: its one-line reason, exit status 2
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
            return 2
        raise
    shown = " ".join([*(f"{k}={v}" for k, v in launch.env.items()), *map(shlex.quote, launch.argv)])
    if args.dry_run:
        print(shown)
        return 0
    print(f"datc-launch: {shown}", file=sys.stderr)
    return subprocess.run(launch.argv, env={**os.environ, **launch.env}).returncode


if __name__ == "__main__":
    sys.exit(main())
