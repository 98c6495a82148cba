"""Run directories: one per run, never shared by two different runs.

A run directory holds ``run.json`` (the run's identity: the config that determines its
results), ``config.yaml`` (the resolved config), ``metrics.jsonl``, ``summary.json`` and
``checkpoints/``. Opening a directory that holds a different run is refused, so nothing
overwrites another run's results.

One process writes a run directory at a time: :meth:`RunDir.open` takes an exclusive
``flock`` on ``<run_dir>/.lock`` (:mod:`datc.run.runlock`) and holds it for the run's life.
"""

from __future__ import annotations

import contextlib
import errno
import json
import uuid
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from datc.atomic import atomic_write_json, atomic_write_text
from datc.config import ConfigError
from datc.hashing import config_hash
from datc.run.identity import _diff, identity
from datc.run.runlock import (  # noqa: F401
    LOCK_FILE,
    RunBusyError,
    RunLock,
    hold,
    release_run_locks,
    remove_stray,
    warn,
)

IGNORED_FILES = {".hydra", "train.log", "wandb", LOCK_FILE}


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
        hold(lock)
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
            edited = config_file_edits(path, prior)
            if edited is not None:
                warn(f"{path / 'config.yaml'} {edited}; rewritten from this run's config (run.json confirms it)")
                atomic_write_text(path / "config.yaml", OmegaConf.to_yaml(OmegaConf.create(cfg)))
            _write_hydra_files(path, cfg)
            return cls(path, run_id, True, lock, prior.get("wandb_id"))
        if (path / "config.yaml").exists():
            rebuilt = _rebuild_run_json(path, ident, run_id)
            if rebuilt is not None:
                return cls._open_locked(path, cfg, ident, run_id, resume, lock)
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
        atomic_write_json(run_json, {"run_id": run_id, "wandb_id": wandb_id, "identity": ident, "trackers": []})
        _write_hydra_files(path, cfg)
        return cls(path, run_id, False, lock, wandb_id)

    def discard(self) -> None:
        """Remove what :meth:`open` wrote for a fresh run whose set-up then failed, so the
        name is free again for the corrected command. A resumable run is never touched."""
        if self.resumable:
            return
        for name in ("run.json", "config.yaml", "metrics.jsonl", "inputs.json", "micro_batch.json"):
            (self.path / name).unlink(missing_ok=True)
        for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
            (self.path / ".hydra" / name).unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            (self.path / ".hydra").rmdir()

    def record_accepted_inputs(self, what: str) -> None:
        """Add one accepted input change (``trainer.accept_changed_inputs``) to ``run.json``."""
        run_json = self.path / "run.json"
        data = json.loads(run_json.read_text())
        data.setdefault("accepted_input_changes", []).append(what)
        atomic_write_json(run_json, data)

    def accepted_inputs(self) -> list[str]:
        """The input changes this run was resumed with (``run.json``), oldest first."""
        try:
            return list(json.loads((self.path / "run.json").read_text()).get("accepted_input_changes", []))
        except (OSError, ValueError):
            return []

    def trackers(self) -> list[str]:
        """The trackers this run was sent to (``run.json``'s ``trackers``, see :mod:`datc.run.trackers`);
        a run from before that record: the logger its ``config.yaml`` names."""
        try:
            data = json.loads((self.path / "run.json").read_text())
            if "trackers" in data:
                return list(data["trackers"])
            name = OmegaConf.load(self.path / "config.yaml").logger.name
        except Exception:  # unreadable: said where the run's own files are read
            return []
        return [] if name in (None, "none") else [str(name)]

    def record_tracker(self, name: str) -> None:
        """Add ``name`` to the trackers this run was sent to (``run.json``)."""
        run_json = self.path / "run.json"
        data = json.loads(run_json.read_text())
        data["trackers"] = sorted({*self.trackers(), name})
        atomic_write_json(run_json, data)

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

    def check_finished_metrics(self) -> None:
        """A finished run's ``metrics.jsonl`` is only read, never rewritten: unreadable lines
        (appended or damaged after the run finished) are said, so nobody plots them unaware."""
        _, bad, _ = self._rows()
        if bad:
            warn(f"{self.metrics_file}: unreadable line(s) {', '.join(map(str, bad[:5]))} in a finished run (its "
                 "summary.json, written at the end, is unaffected); remove them, or read the file skipping them")

    def read_metrics(self) -> list[dict[str, Any]]:
        rows, bad, _ = self._rows()
        if bad:
            warn(f"{self.metrics_file}: skipped unreadable line(s) {', '.join(map(str, bad[:5]))}")
        return rows


def _rebuild_run_json(path: Path, ident: dict[str, Any], run_id: str) -> Path | None:
    """A run directory whose ``run.json`` was deleted, but whose ``config.yaml`` is this run's
    (the same identity): ``run.json`` written again from it, said in a warning (W&B gets a new
    run id). A ``config.yaml`` of another run is a refusal naming where it differs."""
    f = path / "config.yaml"
    try:
        theirs = identity(OmegaConf.to_container(OmegaConf.load(f), resolve=True))
    except Exception:
        return None  # not readable as a run's config: said as files that are not a datc run
    if config_hash(theirs, 16) != run_id:
        keys = _diff(theirs, ident)
        raise ConfigError(
            f"run_dir: {path} has no run.json, and its config.yaml is another run's (it differs at {', '.join(keys[:6])}); "
            "run that run's own command to rebuild run.json, or choose another run_name or run_dir"
        )
    warn(f"{path / 'run.json'} was missing; rebuilt from config.yaml, which is this run's config "
         "(its checkpoints and metrics are kept; W&B, if used, logs it as a new run)")
    atomic_write_json(path / "run.json", {"run_id": run_id, "wandb_id": uuid.uuid4().hex[:16], "identity": ident})
    return path / "run.json"


def config_file_edits(path: Path, prior: dict[str, Any]) -> str | None:
    """How ``<path>/config.yaml`` disagrees with the identity in ``run.json`` (``prior``), as a
    phrase ("is missing", "was edited: it differs at trainer.steps"), or None if it agrees."""
    f = path / "config.yaml"
    if not f.exists():
        return "is missing"
    try:
        loaded = OmegaConf.to_container(OmegaConf.load(f), resolve=True)
        ident = identity(loaded)
    except Exception as e:  # unparsable YAML, an interpolation that no longer resolves, no trainer node
        return f"is unreadable ({type(e).__name__})"
    if config_hash(ident, 16) == prior["run_id"]:
        return None
    keys = _diff(prior["identity"], ident)
    return f"was edited: it differs from run.json at {', '.join(keys[:6]) or 'its types'}"


def read_run_config(path: str | Path) -> dict[str, Any]:
    """A run directory's ``config.yaml``, checked against its ``run.json`` (the identity the run
    was trained with): a ``ConfigError`` if it is missing, damaged or edited since, so no
    command reads a config the run did not have."""
    path = Path(path)
    if not (path / "run.json").exists():
        raise ConfigError(f"{path}: not a datc run directory (no run.json)")
    prior = _read_run_json(path / "run.json")
    edited = config_file_edits(path, prior)
    if edited is not None:
        raise ConfigError(f"{path / 'config.yaml'} {edited}, so it is not the config this run was trained with; "
                          "restore it (running the run's own datc-train command again rewrites it)")
    return OmegaConf.to_container(OmegaConf.load(path / "config.yaml"), resolve=True)


def read_run_id(path: str | Path) -> str:
    """The run id a run directory's ``run.json`` records (a ``ConfigError`` if it is damaged)."""
    return _read_run_json(Path(path) / "run.json")["run_id"]


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
