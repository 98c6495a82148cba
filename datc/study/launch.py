"""Runs a study's jobs through the launcher Hydra is configured with (METHOD §6's runs, dispatched by
Hydra's launchers, not by hand): ``basic`` (one after another, in this process; the default),
``hydra/launcher=joblib hydra.launcher.n_jobs=N`` (N at a time on one machine),
``hydra/launcher=slurm`` (submitit, a cluster) or ``submitit_local`` (a fresh process per job).

The driver composes one *master* config from the launcher arguments (what ``datc-train -m``
composes), instantiates its launcher as Hydra's basic sweeper does (``Plugins.instantiate_launcher``)
and calls ``launcher.launch(job_overrides, initial_job_idx)`` once per batch: the call returns when
the batch's jobs have ended, in every launcher (basic loops; joblib's ``Parallel`` blocks; submitit
waits for each job's result), so a stage that decides waits for its jobs, never for files. Each job
carries every task override; its run directory is composed the way the launcher composes it
(``load_sweep_config``), and a job whose directory holds a finished (``summary.json``) or diverged
(``diverged.json``) run is not launched: a study run again resumes (a cut run resumes from its
checkpoint, ``trainer.resume=auto``).
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from datc.study.protocol import Refused
from datc.study.search import DIVERGED

LOG = "study.jsonl"  # one line per job the driver launched: its outcome and measure (--plan's step time)
PLUGINS = {"joblib": ("joblib", "hydra-joblib-launcher (pip install 'datc[joblib]')"),
           "submitit": ("submitit", "hydra-submitit-launcher (pip install 'datc[slurm]')")}


@dataclass
class Job:
    overrides: list[str]
    label: str  # e.g. "grpo lr ×4 seed 100"
    run_dir: Path | None = None
    error: str | None = None
    measure: dict[str, Any] = field(default_factory=dict)


def state(run_dir: Path) -> str:
    """``finished``, ``diverged`` or ``todo`` (missing, or cut: it resumes)."""
    if (run_dir / "summary.json").is_file():
        return "finished"
    return "diverged" if (run_dir / DIVERGED).is_file() else "todo"


def _line(e: BaseException) -> str:
    text = (str(e).strip().splitlines() or [""])[0][:300]
    return text if type(e).__name__ == "JobFailed" else f"{type(e).__name__}: {text}"


class StudyLauncher:
    """The configured launcher and the composition of the study's jobs. Call inside one
    ``initialize_config_dir`` block (the caller's)."""

    def __init__(self, hydra_overrides: list[str], folder: Path, batch_size: int | None = None,
                 keep_checkpoints: bool = False) -> None:
        from hydra._internal.callbacks import Callbacks
        from hydra.core.global_hydra import GlobalHydra
        from hydra.core.plugins import Plugins
        from hydra.errors import HydraException
        from hydra.types import HydraContext, RunMode

        from datc.study.job import study_job
        from datc.training.job import hydra_error_line

        self.loader = GlobalHydra.instance().config_loader()
        try:
            self.master = self.loader.load_configuration(
                config_name="train", run_mode=RunMode.MULTIRUN,
                overrides=[*hydra_overrides, f"hydra.sweep.dir={folder}", "hydra.mode=MULTIRUN"])
        except HydraException as e:
            line = hydra_error_line(e)
            hint = "; hydra/launcher=joblib needs hydra-joblib-launcher, slurm and submitit_local hydra-submitit-launcher"
            raise Refused(line + (hint if "hydra/launcher" in line else "")) from None
        target = str(self.master.hydra.launcher.get("_target_", ""))
        self.name = target.rsplit(".", 1)[-1]
        for key, (module, package) in PLUGINS.items():
            if key in target.lower() and importlib.util.find_spec(module) is None:
                raise Refused(f"{self.name} needs the Python package {module!r}, not installed: install {package}")
        try:
            ctx = HydraContext(config_loader=self.loader, callbacks=Callbacks(self.master))
            self.launcher = Plugins.instance().instantiate_launcher(hydra_context=ctx, task_function=study_job,
                                                                    config=self.master)
        except Exception as e:  # "IS THE PLUGIN INSTALLED?": one line
            raise Refused(f"the launcher {target or '?'} cannot be set up: {_line(e)}") from None
        self.folder, self.batch_size, self.next_idx = folder, batch_size, 0
        self.keep_checkpoints = keep_checkpoints
        launcher_cfg = self.master.hydra.launcher
        self.parallel = int(batch_size or launcher_cfg.get("n_jobs") or launcher_cfg.get("array_parallelism") or 1)
        if "BasicLauncher" in target:
            self.parallel = 1

    def compose(self, overrides: list[str]) -> Any:
        """A job's whole config, composed as the launcher will compose it."""
        return self.loader.load_sweep_config(self.master, list(overrides))

    def run_dir(self, job: Job) -> Path:
        if job.run_dir is None:
            c = self.compose(job.overrides)
            job.run_dir = Path(str(c.hydra.sweep.dir)) / str(c.hydra.sweep.subdir)
        return job.run_dir

    def todo(self, jobs: list[Job]) -> list[Job]:
        """The jobs whose run is neither finished nor diverged (deduplicated by run directory)."""
        seen, out = set(), []
        for j in jobs:
            d = self.run_dir(j)
            if d not in seen and state(d) == "todo":
                seen.add(d)
                out.append(j)
        return out

    def _time_limit_hint(self, e: Exception) -> str:
        """submitit ends a job at its launcher's ``timeout_min`` (60 by default, the local executor's
        too) and then reports it uncompleted: say which setting, since a real model's run under load
        can take longer."""
        minutes = self.master.hydra.launcher.get("timeout_min")
        if minutes is None or type(e).__name__ != "UncompletedJobError":
            return ""
        return (f" (submitit ends a job after hydra.launcher.timeout_min={minutes} minutes: if the job's log says it "
                "timed out, raise it; the run resumes from its last checkpoint)")

    def launch(self, jobs: list[Job]) -> list[Job]:
        """Runs ``jobs`` (in chunks of ``batch_size``) and returns those that failed, each with its
        one-line error. The disk is the truth of what finished; the launcher's returns give messages."""
        failed = []
        size = self.batch_size or len(jobs) or 1
        for i in range(0, len(jobs), size):
            chunk = jobs[i:i + size]
            try:
                rets = list(self.launcher.launch([j.overrides for j in chunk], self.next_idx))
            except Exception as e:  # a worker killed (out of memory), a Slurm job lost, a job past its time limit
                rets = [None] * len(chunk)
                for j in chunk:
                    j.error = f"the launcher failed: {_line(e)}{self._time_limit_hint(e)}"
            self.next_idx += len(chunk)
            for j, r in zip(chunk, rets, strict=False):
                if r is not None:
                    self._read(j, r)
                if state(self.run_dir(j)) == "todo":
                    j.error = j.error or "the job ended without a finished run"
                    failed.append(j)
                elif not self.keep_checkpoints:  # after each chunk, not each round: a real run's weights are GBs
                    prune_run(self.run_dir(j))
            self._log(chunk)
        return failed

    def _read(self, job: Job, ret: Any) -> None:
        from hydra.core.utils import JobStatus

        job.measure["job_id"] = str(ret.hydra_cfg.hydra.job.id) if ret.hydra_cfg is not None else None
        if ret.status is JobStatus.FAILED:
            job.error = _line(ret._return_value)  # not .return_value: it raises again
        elif isinstance(ret._return_value, dict):
            job.measure.update(ret._return_value)

    def _log(self, jobs: list[Job]) -> None:
        with open(self.folder / LOG, "a") as f:
            for j in jobs:
                f.write(json.dumps({"label": j.label, "run_dir": str(j.run_dir), "error": j.error, **j.measure}) + "\n")


WEIGHTS = ("checkpoints", "final")  # what a study removes from a finished run (--keep-checkpoints keeps them)


def prune_run(run: Path) -> bool:
    """Removes a finished run's weights, its ``checkpoints/`` and ``final/`` policy (at the real
    scale about 3 GB and 0.6 GB; a study of a hundred runs would fill a disk): a finished run never
    resumes, and the tables read only its ``summary.json``, ``run.json``, ``inputs.json`` and
    ``metrics.jsonl``. False where the run has not finished or holds no weights."""
    if not (run / "summary.json").is_file():
        return False
    found = [run / w for w in WEIGHTS if (run / w).is_dir()]
    for w in found:
        shutil.rmtree(w, ignore_errors=True)
    return bool(found)


def prune_checkpoints(folder: Path, dirs: tuple[str, ...]) -> int:
    """:func:`prune_run` on every run below ``folder/<dirs>`` (runs finished by an earlier
    invocation, or before a driver was stopped). Returns how many held weights."""
    return sum(prune_run(run) for d in dirs for run in sorted((folder / d).glob("*/")))


def measured_seconds(folder: Path, scheme: str | None = None) -> float | None:
    """The median wall time of the jobs this study finished (``study.jsonl``), of ``scheme`` if it has any."""
    try:
        rows = [json.loads(x) for x in (folder / LOG).read_text().splitlines() if x.strip()]
    except (OSError, ValueError):
        return None
    rows = [r for r in rows if r.get("state") == "finished" and isinstance(r.get("wall_s"), (int, float))]
    own = [r["wall_s"] for r in rows if scheme and r.get("label", "").split(" ")[0] == scheme] or [r["wall_s"] for r in rows]
    return sorted(own)[len(own) // 2] if own else None


class StudyLock:
    """One driver a setting: a non-blocking lock on ``<folder>/.study.lock``."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(folder / ".study.lock", os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise Refused(f"{folder}: another datc-study is running on this setting (its lock .study.lock is held)") from None

    def close(self) -> None:
        os.close(self.fd)


def say(text: str) -> None:
    print(f"datc-study: {text}", file=sys.stderr, flush=True)
