"""Run directories: one per run, never shared by two different runs.

A run directory holds ``run.json`` (the run's identity: the config that determines its
results), ``config.yaml`` (the resolved config), ``metrics.jsonl``, ``summary.json`` and
``checkpoints/``. Opening a directory that holds a different run is refused, so nothing
overwrites another run's results.

One process writes a run directory at a time: :meth:`RunDir.open` takes an exclusive
``flock`` on ``<run_dir>/.lock`` and holds it for the run's life. The kernel releases it when
the process ends, however it ends, so a lock left by a killed run never blocks its resume.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from datc.config import ConfigError
from datc.utils import atomic_write_json, atomic_write_text, config_hash

# Settings that change how a run is executed or reported, not what it computes.
NON_IDENTITY = {"run_dir", "run_name", "results_dir", "cache_dir", "logger"}
# (skip_zero_advantage leaves out only work whose result the loss multiplies by A = 0; the decode
# loop samples the same distribution with the same logits to float rounding, as threads and device)
NON_IDENTITY_TRAINER = {"resume", "progress", "threads", "device", "skip_zero_advantage", "gradient_checkpointing", "decode", "decode_sync_every"}
# Later switches whose default (None) is the behaviour from before they existed: part of the
# identity only when set, so adding them renamed no existing run.
IDENTITY_WHEN_SET_TRAINER = {"lm_head_chunk"}
# How ZeRO-3 gathers the policy's parameters for sampling: the same samples either way.
NON_IDENTITY_DEEPSPEED = {"gather_for_generation"}
LOCK_FILE = ".lock"
IGNORED_FILES = {".hydra", "train.log", "wandb", LOCK_FILE}


def warn(msg: str) -> None:
    """One line on stderr: something was recovered or left out, and the run goes on."""
    print(f"datc: warning: {msg}", file=sys.stderr, flush=True)


class RunBusyError(ConfigError):
    """Another live process holds the run directory."""


class RunLock:
    """An exclusive ``flock`` on ``<run_dir>/.lock`` holding ``"<pid> <host>"`` of its owner."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self.fd = path, fd

    @classmethod
    def acquire(cls, run_dir: Path) -> RunLock:
        path = run_dir / LOCK_FILE
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd)
                os.close(fd)
                who = f"process {holder[0]} on host {holder[1]}" if holder else "another process"
                raise RunBusyError(
                    f"run_dir: {run_dir} is in use by {who}; one process writes a run directory at a time: "
                    "wait for it to end (or stop it), or choose another run_name or run_dir"
                ) from None
            except BaseException:
                os.close(fd)
                raise
            # The file may have been removed by a refused command between our open and flock.
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        me = f"{os.getpid()} {socket.gethostname()}\n".encode()
        os.pwrite(fd, me, 0)
        os.ftruncate(fd, len(me))
        return cls(path, fd)

    def release(self, remove: bool = False) -> None:
        if self.fd < 0:
            return
        if remove:
            with contextlib.suppress(OSError):
                self.path.unlink()
        os.close(self.fd)  # closing the last descriptor releases the flock
        self.fd = -1


def _holder(fd: int, wait_s: float = 2.0) -> tuple[str, str] | None:
    """(pid, host) the lock's holder wrote; the holder writes it just after taking the lock,
    so an empty file, or one naming a process of this host that is gone, is read again."""
    deadline = time.monotonic() + wait_s
    while True:
        parts = os.pread(fd, 200, 0).decode(errors="replace").split()
        if len(parts) >= 2 and parts[0].isdigit():
            pid, host = parts[0], parts[1]
            if host != socket.gethostname() or _alive(int(pid)):
                return pid, host
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_HELD: list[RunLock] = []  # locks this process holds (released by release_run_locks)


def release_run_locks() -> None:
    """Release every run-directory lock this process took (the end of :func:`datc.trainer.train`)."""
    while _HELD:
        _HELD.pop().release()


def remove_stray(path: str | Path) -> None:
    """Remove ``path`` if a refused command left it holding nothing of a run (only an unheld
    ``.lock`` and empty log files): a refused command leaves no directories behind."""
    path = Path(path)
    try:
        names = {p.name: p for p in path.iterdir()}
    except OSError:
        return
    if not set(names) <= {LOCK_FILE, "train.log"} or any(p.stat().st_size for n, p in names.items() if n != LOCK_FILE):
        return
    if LOCK_FILE in names:
        try:
            lock = RunLock.acquire(path)
        except (ConfigError, OSError):
            return
        lock.release(remove=True)
    with contextlib.suppress(OSError):
        (path / "train.log").unlink(missing_ok=True)
        path.rmdir()


def _write_hydra_files(path: Path, cfg: dict[str, Any]) -> None:
    """What Hydra writes into ``.hydra/`` (``hydra.output_subdir: null`` leaves it to us, so a
    refused command never rewrites an existing run's files): the resolved config, Hydra's own
    config and the command's overrides."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return
    hc = HydraConfig.get()
    if Path(hc.runtime.output_dir).resolve() != path.resolve():
        return
    out = path / ".hydra"
    atomic_write_text(out / "config.yaml", OmegaConf.to_yaml(OmegaConf.create(cfg)))
    atomic_write_text(out / "hydra.yaml", OmegaConf.to_yaml(OmegaConf.create({"hydra": hc})))
    atomic_write_text(out / "overrides.yaml", OmegaConf.to_yaml(hc.overrides.task))



def identity(cfg: dict[str, Any]) -> dict[str, Any]:
    ident = {k: v for k, v in cfg.items() if k not in NON_IDENTITY}
    ident["trainer"] = {k: v for k, v in ident["trainer"].items()
                        if k not in NON_IDENTITY_TRAINER and not (k in IDENTITY_WHEN_SET_TRAINER and v is None)}
    if isinstance(ident.get("deepspeed"), dict):
        ident["deepspeed"] = {k: v for k, v in ident["deepspeed"].items() if k not in NON_IDENTITY_DEEPSPEED}
    if isinstance(ident.get("policy"), dict) and not (ident["policy"].get("lora") or {}).get("r"):
        # LoRA off (policy.lora.r: 0): a full-policy run keeps the identity it had before the option
        ident["policy"] = {k: v for k, v in ident["policy"].items() if k != "lora"}
    return ident


def _diff(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += _diff(a.get(k), b.get(k), f"{prefix}{k}.")
        return out
    return [prefix.rstrip(".")] if a != b else []


class RunDir:
    def __init__(self, path: Path, run_id: str, resumable: bool, lock: RunLock | None = None,
                 wandb_id: str | None = None) -> None:
        self.path = path
        self.run_id = run_id
        self.resumable = resumable  # the directory already held this run
        self.lock = lock  # None: opened read-only (a finished run in a directory we cannot write)
        # W&B's run id: drawn once per directory (two directories of one config are two W&B runs)
        self.wandb_id = wandb_id or run_id

    @property
    def metrics_file(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def summary_file(self) -> Path:
        return self.path / "summary.json"

    @classmethod
    def open(cls, path: str | Path, cfg: dict[str, Any], resume: str) -> RunDir:
        """Create or reopen ``path`` for the run ``cfg`` (a resolved plain dict), holding its
        lock until :func:`release_run_locks` (or the process's end)."""
        path = Path(path)
        ident = identity(cfg)
        run_id = config_hash(ident, 16)
        try:
            path.mkdir(parents=True, exist_ok=True)
            lock = RunLock.acquire(path)
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise
            return cls._read_only(path, run_id, resume, e)
        try:
            run = cls._open_locked(path, cfg, ident, run_id, resume, lock)
        except BaseException:
            lock.release(remove=not (path / "run.json").exists())  # a refusal leaves no lock file in a non-run
            raise
        _HELD.append(lock)
        return run

    @classmethod
    def _read_only(cls, path: Path, run_id: str, resume: str, e: OSError) -> RunDir:
        """A directory we cannot write: a finished run's summary can still be returned."""
        run = cls(path, run_id, True)
        prior = _read_run_json(path / "run.json") if (path / "run.json").exists() else None
        if prior is not None and prior["run_id"] == run_id and resume != "never" and run.read_summary() is not None:
            return run
        raise ConfigError(f"run_dir: {path} is not writable ({e.strerror}); make it writable or choose another run_dir") from None

    @classmethod
    def _open_locked(cls, path: Path, cfg: dict[str, Any], ident: dict[str, Any], run_id: str, resume: str,
                     lock: RunLock) -> RunDir:
        run_json = path / "run.json"
        if run_json.exists():
            prior = _read_run_json(run_json)
            if prior["run_id"] != run_id:
                keys = _diff(prior["identity"], ident)
                raise ConfigError(
                    f"run_dir: {path} holds another run (its config differs at {', '.join(keys[:6])}); "
                    "choose another run_name or run_dir, nothing was overwritten"
                )
            if resume == "never":
                raise ConfigError(
                    f"trainer.resume: {path} already holds this run; use trainer.resume=auto to continue it "
                    "or another run_name for a fresh run"
                )
            _write_hydra_files(path, cfg)
            return cls(path, run_id, True, lock, prior.get("wandb_id"))
        if resume == "must":
            raise ConfigError(f"trainer.resume=must: {path} holds no run to resume")
        others = [p.name for p in path.iterdir() if p.name not in IGNORED_FILES]
        if others:
            raise ConfigError(
                f"run_dir: {path} already holds files that are not a datc run ({', '.join(sorted(others)[:5])}); "
                "choose another run_name or run_dir"
            )
        atomic_write_text(path / "config.yaml", OmegaConf.to_yaml(OmegaConf.create(cfg)))
        wandb_id = uuid.uuid4().hex[:16]
        atomic_write_json(run_json, {"run_id": run_id, "wandb_id": wandb_id, "identity": ident})
        _write_hydra_files(path, cfg)
        return cls(path, run_id, False, lock, wandb_id)

    def discard(self) -> None:
        """Remove what :meth:`open` wrote for a fresh run whose set-up then failed, so the
        name is free again for the corrected command. A resumable run is never touched."""
        if self.resumable:
            return
        for name in ("run.json", "config.yaml", "metrics.jsonl"):
            (self.path / name).unlink(missing_ok=True)
        for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
            (self.path / ".hydra" / name).unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            (self.path / ".hydra").rmdir()

    def read_summary(self) -> dict[str, Any] | None:
        """The finished run's summary; None if there is none, or if it is damaged (then it is
        recomputed from the run's files when the run is reopened)."""
        if not self.summary_file.exists():
            return None
        try:
            summary = json.loads(self.summary_file.read_text())
            if isinstance(summary, dict) and isinstance(summary.get("eval"), dict):
                return summary
            reason = "not a datc summary"
        except (ValueError, UnicodeDecodeError) as e:
            reason = f"{type(e).__name__}: {e}"
        warn(f"{self.summary_file} is damaged ({reason}); recomputing it from the run's metrics and last checkpoint")
        return None

    def _rows(self) -> tuple[list[dict[str, Any]], list[int], bool]:
        """(rows, numbers of unreadable lines, whether the file ended in a torn last line)."""
        if not self.metrics_file.exists():
            return [], [], False
        text = self.metrics_file.read_bytes().decode(errors="replace")
        lines = text.split("\n")
        torn_last = lines[-1] != ""  # a row is only complete with its newline
        rows, bad = [], []
        for i, ln in enumerate(lines, 1):
            if not ln.strip():
                continue
            try:
                row = json.loads(ln)
                if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                    raise ValueError("not a metrics row")
            except ValueError:
                bad.append(i)
                continue
            if i == len(lines) and torn_last:
                bad.append(i)  # parses, but was cut before its newline: not trusted
                continue
            rows.append(row)
        return rows, bad, torn_last

    def truncate_metrics(self, step: int) -> None:
        """Drop metric rows logged after ``step`` (a resumed run redoes them exactly), and any
        torn or unreadable line (a run killed or a disk filled mid-append), saying so."""
        if not self.metrics_file.exists():
            if step >= 0:
                warn(f"{self.metrics_file} is missing; training continues from step {step}, and the summary will "
                     "leave out what it no longer holds (initial eval, gold_auc, train_mean)")
            return
        rows, bad, torn_last = self._rows()
        if bad:
            n_lines = self.metrics_file.read_bytes().count(b"\n") + torn_last
            what = "its torn last line" if bad == [n_lines] else f"unreadable line(s) {', '.join(map(str, bad[:5]))}"
            warn(f"{self.metrics_file}: dropped {what} (a run stopped or a disk filled mid-write)")
        keep = [r for r in rows if r["step"] <= step]
        atomic_write_text(self.metrics_file, "".join(json.dumps(r) + "\n" for r in keep))
        missing = metrics_gaps(keep, step)
        if missing:
            warn(f"{self.metrics_file} holds no rows for {missing}; training continues, and the summary will leave "
                 "out what it no longer holds (initial eval, gold_auc, train_mean)")

    def read_metrics(self) -> list[dict[str, Any]]:
        rows, bad, _ = self._rows()
        if bad:
            warn(f"{self.metrics_file}: skipped unreadable line(s) {', '.join(map(str, bad[:5]))}")
        return rows


def _read_run_json(path: Path) -> dict[str, Any]:
    try:
        prior = json.loads(path.read_text())
        if isinstance(prior, dict) and isinstance(prior.get("run_id"), str) and isinstance(prior.get("identity"), dict):
            return prior
        reason = "no run_id and identity"
    except (ValueError, UnicodeDecodeError) as e:
        reason = f"{type(e).__name__}: {e}"
    raise ConfigError(f"run_dir: {path} is damaged ({reason}), so it no longer says which run this directory holds; "
                      "restore it, or move the directory aside and start the run again") from None


def metrics_gaps(rows: list[dict[str, Any]], step: int) -> str | None:
    """What a run's metric rows up to ``step`` lack: the step-0 eval, or some training steps
    (say ``"the initial eval (step 0), steps 1-10"``); None if they are complete."""
    if step < 0:
        return None
    out = []
    if not any(r["step"] == 0 and "eval/rm_score" in r for r in rows):
        out.append("the initial eval (step 0)")
    have = {r["step"] for r in rows if "perf/step_s" in r}
    lost = [s for s in range(1, step + 1) if s not in have]
    if lost:
        runs, first = [], lost[0]
        for a, b in zip(lost, lost[1:] + [None], strict=False):
            if b != a + 1:
                runs.append(f"{first}" if first == a else f"{first}-{a}")
                first = b
        out.append("step" + ("s " if len(lost) > 1 else " ") + ", ".join(runs))
    return ", ".join(out) or None
