"""``datc-launch``: start a run on one process, on N local devices, or on several nodes.

    datc-launch credit=datc                                   # one process, no launcher
    datc-launch --nproc 8 deepspeed=zero3 credit=datc         # 8 local devices (or CPU processes)
    datc-launch --hostfile hosts --nproc 8 deepspeed=zero3    # every node listed in hosts, 8 each
    datc-launch --nproc 4 backend=fsdp2 credit=datc           # FSDP2 on 4 local devices (torchrun)

Under DeepSpeed it builds the ``deepspeed`` launcher's command line (``--no_local_rank``: ranks
come from the environment, so Hydra overrides pass through untouched); under FSDP2 ``torchrun``'s
(``python -m datc.commands.torchrun``: torchrun with its failures in one line; one node, several nodes start
torchrun on each, or srun). It sets ``OMP_NUM_THREADS`` and
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
import contextlib
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Launch:
    argv: list[str]  # the command
    env: dict[str, str]  # variables added to the environment


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="datc-launch",
        description="Start datc-train on one process, N local devices or several nodes (DeepSpeed's launcher, or "
                    "torchrun under backend=fsdp2).",
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


def _backend(overrides: list[str]) -> str:
    """The backend the overrides compose to (``plain``, ``deepspeed``, ``fsdp2``: an experiment may
    choose it); the config is validated here, so a bad one stops before any process starts."""
    from hydra import compose, initialize_config_dir

    from datc.checks import validate
    from datc.config import ConfigError
    from datc.paths import CONFIG_DIR

    try:
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
            cfg = compose(config_name="train", overrides=[o for o in overrides if not o.startswith(("hydra.", "hydra/"))])
        from datc.backends.checks import backend_name

        return backend_name(validate(cfg))
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
    backend = _backend(overrides) if multi else "plain"
    if backend == "plain":
        if multi:
            raise SystemExit("datc-launch: several processes need a backend that runs them: add deepspeed=zero2, zero3 "
                             "or zero3_offload, or backend=fsdp2")
    elif backend == "fsdp2" and args.hostfile is not None:
        raise SystemExit("datc-launch: --hostfile starts DeepSpeed's multi-node launcher; for FSDP2 on several nodes "
                         "start torchrun on each node (--nnodes, --node-rank, --rdzv-endpoint) or use srun")
    threads = args.threads or max(1, (cpu_count or os.cpu_count() or 1) // args.nproc)
    env: dict[str, str] = {}
    if "OMP_NUM_THREADS" not in environ:
        env["OMP_NUM_THREADS"] = str(threads)
    if not any(o.startswith("trainer.threads=") for o in overrides):
        overrides = [*overrides, f"trainer.threads={threads}"]
    if not multi:
        return Launch([sys.executable, "-m", "datc.train", *overrides], env)
    if backend == "fsdp2":
        return Launch([sys.executable, "-m", "datc.commands.torchrun", "--nnodes", "1", "--nproc-per-node",
                       str(args.nproc), "--master-port", str(args.master_port), "-m", "datc.train", *overrides], env)
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
    try:
        return _main(argv)
    except KeyboardInterrupt:  # a Ctrl-C before the processes started (while the config is checked)
        print("datc-launch: interrupted (SIGINT) before the run started; nothing was started", file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
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
    return run_forwarding_signals(launch.argv, {**os.environ, **launch.env})


def _children() -> dict[int, list[int]]:
    """Every process's children, by parent pid (from ``/proc``; empty where there is none)."""
    out: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    return out


def _is_rank(pid: int) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(a == b"-m" and b == b"datc.train" for a, b in zip(argv, argv[1:], strict=False))


def rank_pids(root: int) -> list[int]:
    """The training processes below ``root`` (a launcher): its descendants that run
    ``-m datc.train`` and have no such descendant themselves (torchrun's own command line names
    ``-m datc.train`` too, and it is not a rank)."""
    children, ranks = _children(), []

    def walk(pid: int) -> bool:  # whether a rank is at or below pid
        below = [walk(c) for c in children.get(pid, [])]
        if any(below):
            return True
        if pid != root and _is_rank(pid):
            ranks.append(pid)
            return True
        return False

    walk(root)
    return sorted(ranks)


FORWARDED = ("SIGTERM", "SIGINT", "SIGHUP")  # what a scheduler, a Ctrl-C and a closed terminal send


def _own_group_dying_with_us() -> None:
    """In the launcher's child, before it runs: its own process group (a Ctrl-C in the terminal
    reaches ``datc-launch`` alone, which passes it on once, so DeepSpeed's launcher never turns it
    into a SIGTERM), and Linux ends it with ``datc-launch``."""
    from datc.run.lifeline import set_parent_death_signal

    os.setpgid(0, 0)
    set_parent_death_signal()


def _handles(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has its own handler for ``signum`` (``/proc``'s ``SigCgt``): a rank
    handles SIGTERM once it can stop with a checkpoint (:mod:`datc.run.signals`); before, a
    SIGINT would end it in a ``KeyboardInterrupt`` traceback in the middle of its imports."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return True


def run_forwarding_signals(argv: list[str], env: dict[str, str]) -> int:
    """Run the launcher and wait for it. SIGTERM (what ``timeout``, a scheduler or a parent
    process sends), SIGINT (Ctrl-C: the launcher runs in its own process group, so the terminal's
    reaches ``datc-launch`` alone) and SIGHUP (the terminal closed) to ``datc-launch`` go to the
    training processes themselves, which checkpoint at the next step boundary and stop
    (:mod:`datc.run.signals`); the launchers would kill them at once instead (DeepSpeed's sends
    SIGTERM on top of a Ctrl-C, then SIGKILL). Before any rank runs, the launcher's group is
    ended. Exits with the ranks' status then (128 + the signal). Should ``datc-launch`` itself be
    killed (``kill -9``), its processes end with it (:mod:`datc.run.lifeline`)."""
    import signal

    from datc.run.lifeline import launcher_env

    proc: subprocess.Popen | None = None
    got: list[int] = []
    early: list[int] = []  # signals that came before the processes could stop with a checkpoint

    def forward(signum: int) -> None:
        ranks = rank_pids(proc.pid) or ([proc.pid] if _is_rank(proc.pid) else [])
        if not ranks or not all(_handles(pid, signal.SIGTERM) for pid in ranks):
            # Nothing trains yet (a rank that cannot stop with a checkpoint is still importing), so
            # nothing to save: the launcher and all it started end at once and quietly (a SIGINT
            # would end a rank in a KeyboardInterrupt traceback, a SIGTERM torchrun in its own).
            early.append(signum)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            return
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    def on_signal(signum, frame):
        got.append(signum)
        if proc is not None:
            forward(signum)

    old = {s: signal.signal(s, on_signal) for s in (getattr(signal, n) for n in FORWARDED)}
    try:
        proc = subprocess.Popen(argv, env={**env, **launcher_env()}, preexec_fn=_own_group_dying_with_us)
        for signum in list(got):  # arrived while it started
            forward(signum)
        rc = proc.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if early and rc != 0:
        with contextlib.suppress(OSError, ValueError):
            print(f"datc-launch: {signal.Signals(early[0]).name} while the run was starting: its processes were ended "
                  "before training (nothing to save); run the same command again to start it", file=sys.stderr)
    return 128 + got[0] if got and rc != 0 else rc


if __name__ == "__main__":
    sys.exit(main())
