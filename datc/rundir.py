"""Run directories: one per run, never shared by two different runs.

A run directory holds ``run.json`` (the run's identity: the config that determines its
results), ``config.yaml`` (the resolved config), ``metrics.jsonl``, ``summary.json`` and
``checkpoints/``. Opening a directory that holds a different run is refused, so nothing
overwrites another run's results.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from datc.config import ConfigError
from datc.utils import atomic_write_json, atomic_write_text, config_hash

# Settings that change how a run is executed or reported, not what it computes.
NON_IDENTITY = {"run_dir", "run_name", "results_dir", "cache_dir", "logger"}
NON_IDENTITY_TRAINER = {"resume", "progress", "threads", "device"}
IGNORED_FILES = {".hydra", "train.log", "wandb"}


def identity(cfg: dict[str, Any]) -> dict[str, Any]:
    ident = {k: v for k, v in cfg.items() if k not in NON_IDENTITY}
    ident["trainer"] = {k: v for k, v in ident["trainer"].items() if k not in NON_IDENTITY_TRAINER}
    return ident


def _diff(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += _diff(a.get(k), b.get(k), f"{prefix}{k}.")
        return out
    return [prefix.rstrip(".")] if a != b else []


class RunDir:
    def __init__(self, path: Path, run_id: str, resumable: bool, wandb_id: str | None = None) -> None:
        self.path = path
        self.run_id = run_id
        self.resumable = resumable  # the directory already held this run
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
        """Create or reopen ``path`` for the run ``cfg`` (a resolved plain dict)."""
        path = Path(path)
        ident = identity(cfg)
        run_id = config_hash(ident, 16)
        run_json = path / "run.json"
        if run_json.exists():
            prior = json.loads(run_json.read_text())
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
            return cls(path, run_id, True, prior.get("wandb_id"))
        if resume == "must":
            raise ConfigError(f"trainer.resume=must: {path} holds no run to resume")
        if path.exists():
            others = [p.name for p in path.iterdir() if p.name not in IGNORED_FILES]
            if others:
                raise ConfigError(
                    f"run_dir: {path} already holds files that are not a datc run ({', '.join(sorted(others)[:5])}); "
                    "choose another run_name or run_dir"
                )
        path.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path / "config.yaml", OmegaConf.to_yaml(OmegaConf.create(cfg)))
        wandb_id = uuid.uuid4().hex[:16]
        atomic_write_json(run_json, {"run_id": run_id, "wandb_id": wandb_id, "identity": ident})
        return cls(path, run_id, False, wandb_id)

    def discard(self) -> None:
        """Remove what :meth:`open` wrote for a fresh run whose set-up then failed, so the
        name is free again for the corrected command. A resumable run is never touched."""
        if self.resumable:
            return
        for name in ("run.json", "config.yaml", "metrics.jsonl"):
            (self.path / name).unlink(missing_ok=True)

    def truncate_metrics(self, step: int) -> None:
        """Drop metric rows logged after ``step`` (a resumed run redoes them exactly)."""
        if not self.metrics_file.exists():
            return
        keep = [ln for ln in self.metrics_file.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= step]
        atomic_write_text(self.metrics_file, "".join(ln + "\n" for ln in keep))

    def read_metrics(self) -> list[dict[str, Any]]:
        if not self.metrics_file.exists():
            return []
        return [json.loads(ln) for ln in self.metrics_file.read_text().splitlines() if ln.strip()]
