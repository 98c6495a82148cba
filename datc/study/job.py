"""``datc-study``'s task function: one ``datc-train`` job run by whichever Hydra launcher the study
uses (in the driver's process, in a joblib worker, in a submitit job). It never lets ``SystemExit``
out (Hydra's ``run_job`` catches only ``Exception``: an exit would end the launcher's whole batch).
A run that diverges (a non-finite value, METHOD §6: the next point "diverges") is a result, not a
failure: ``diverged.json`` is written beside its ``run.json`` and the job returns normally."""

from __future__ import annotations

import os
import socket
import time
import traceback
from pathlib import Path
from typing import Any

from datc.study.search import DIVERGED


class JobFailed(RuntimeError):
    """A job that failed: one line (picklable: one argument), for the driver to print."""


def study_job(cfg: Any) -> dict[str, Any]:
    """Runs the job; returns ``{"state": "finished"|"diverged", "wall_s", "cpu_s", "pid", "host"}``."""
    from hydra.core.hydra_config import HydraConfig

    from datc.math.numerics import NonFiniteError
    from datc.run.signals import Interrupted
    from datc.training.job import JobRefused, train_job

    run_dir = HydraConfig.get().runtime.output_dir
    t0, c0 = time.time(), time.process_time()
    try:
        train_job(cfg, run_dir)
        state = "finished"
    except JobRefused as e:
        if isinstance(e.__cause__, Interrupted):  # checkpointed: the whole study stops, a rerun resumes
            raise KeyboardInterrupt(e.line) from None
        if not isinstance(e.__cause__, NonFiniteError):
            raise JobFailed(e.line) from None
        from datc.atomic import atomic_write_json

        Path(run_dir).mkdir(parents=True, exist_ok=True)
        atomic_write_json(Path(run_dir) / DIVERGED, {
            "message": str(e.__cause__), "credit": str(cfg.credit.name), "lr": float(cfg.trainer.lr),
            "credit_fields": {k: v for k, v in dict(cfg.credit).items() if isinstance(v, (int, float, str, bool))},
            "seed": int(cfg.seed), "prepare_seed": int(cfg.prepare_seed)})
        state = "diverged"
    except Exception as e:  # the traceback to the job's own stderr or log, one line back to the driver
        traceback.print_exc()
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise JobFailed(f"{type(e).__name__}: {first}") from None
    return {"state": state, "wall_s": time.time() - t0, "cpu_s": time.process_time() - c0, "pid": os.getpid(),
            "host": socket.gethostname()}
