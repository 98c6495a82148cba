"""A run's life cycle around the training loop: open (or refuse) its directory, resume from its
last checkpoint, write checkpoints, and write its summary at the end.

Under DeepSpeed every rank calls these; rank 0 owns the run directory and the summary, every
rank writes its own shards and RNG state into the checkpoints.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from datc.atomic import atomic_write_json
from datc.backends.distributed import Dist
from datc.config import ConfigError, TrainConfig
from datc.errors import note
from datc.math.collapse import collapse_record
from datc.math.metrics import mean_of
from datc.models.build import save_pretrained_dir
from datc.prepare.assets import Assets
from datc.run.checkpoint import latest_checkpoint, latest_loadable_checkpoint
from datc.run.fingerprint import changes, fingerprints
from datc.run.provenance import git_commit
from datc.run.rundir import RunDir, metrics_gaps
from datc.run.shards import latest_loadable_sharded_checkpoint
from datc.training.session import Session
from datc.utils import rng_state, set_rng_state

log = logging.getLogger(__name__)


def resolved_config(cfg: DictConfig | dict) -> dict[str, Any]:
    """The config as plain containers, interpolations resolved, Hydra's own node dropped."""
    node = cfg if isinstance(cfg, DictConfig) else OmegaConf.create(cfg)
    out = OmegaConf.to_container(node, resolve=True)
    out.pop("hydra", None)
    return out


GIT_COMMIT = git_commit()  # read at import (+dirty if the tree had changes): a sweep's later runs report the code they ran


def open_run(dist: Dist, path: str | Path, resolved: dict[str, Any], resume: str) -> tuple[RunDir, dict | None]:
    """Rank 0 opens (or refuses) the run directory; every rank learns the outcome, so a refusal
    stops all of them with the same message. Returns (run, summary if the run already finished)."""
    outcome: tuple = ()
    if dist.is_main:
        try:
            run = RunDir.open(path, resolved, resume)
            outcome = ("ok", run, run.read_summary())
            if outcome[2] is not None:
                run.check_finished_metrics()
        except ConfigError as e:
            dist.broadcast(("error", str(e), None))
            raise
    outcome = dist.broadcast(outcome)
    if outcome[0] == "error":
        raise ConfigError(outcome[1])
    return outcome[1], outcome[2]


INPUTS_FILE = "inputs.json"  # fingerprints of the files the run loads (datc.run.fingerprint)


def check_inputs(dist: Dist, c: TrainConfig, run: RunDir, assets: Assets) -> None:
    """Record the fingerprints of the run's models, tokenizer and prompt data when it starts; on
    a resume, refuse (naming the file) when one changed since, unless
    ``trainer.accept_changed_inputs``. Rank 0 decides; every rank learns the outcome."""
    error = None
    if dist.is_main:
        try:
            _check_inputs(c, run, assets)
        except ConfigError as e:
            error = str(e)
    error = dist.broadcast(error)
    if error is not None:
        raise ConfigError(error)


def input_paths(assets: Assets) -> dict[str, str | None]:
    """The files a run loads, by label, as its ``inputs.json`` fingerprints them (the tokenizer
    only where it is not the policy's own)."""
    tok = assets.tokenizer_path if assets.tokenizer_path != assets.policy_path else None
    return {"policy": assets.policy_path, "reward": assets.reward_path, "tokenizer": tok, "data": assets.data_path}


def _check_inputs(c: TrainConfig, run: RunDir, assets: Assets) -> None:
    now = fingerprints(input_paths(assets))
    now["threads"] = c.trainer.threads  # not the run's identity, but its CPU sums depend on it (_threads_change)
    path = run.path / INPUTS_FILE
    if path.is_dir():  # not the file datc writes: nothing of the user's is replaced
        raise ConfigError(f"run_dir: {path} is a directory, not the run's record of its inputs; move it aside and run "
                          "the same command again")
    if run.resumable and latest_checkpoint(run.path) is None:
        # Stopped before its first checkpoint (killed in the prepare step, or before inputs.json was
        # written): nothing to resume and nothing to protect, so the run starts again from step 0.
        note(f"{run.path} holds this run with no checkpoint yet (it stopped before its first): starting it again "
             "from step 0")
        atomic_write_json(path, now)
        return
    if run.resumable:
        before, unverifiable = read_inputs(path)
        diff = None
        if before is not None:
            try:
                diff = changes(before, now)
            except (KeyError, TypeError, AttributeError):
                unverifiable = "is damaged"
        threads = _threads_change(c, run, before)
        if diff is not None and not diff:
            if threads:
                atomic_write_json(path, now)
            return
        if not c.trainer.accept_changed_inputs:
            more = f" (and {len(diff) - 1} more)" if diff and len(diff) > 1 else ""
            why = (f"was started with other inputs: {diff[0]}{more}" if unverifiable is None else
                   f"cannot be checked: its {INPUTS_FILE} {unverifiable}, so nothing says the models, tokenizer and "
                   "data are the ones it started with")
            raise ConfigError(
                f"trainer.accept_changed_inputs: {run.path} {why}; restore them to resume this run, start it under "
                "another run_name, or resume with trainer.accept_changed_inputs=true if the inputs are deliberate "
                "(they are recorded again, and the acceptance in run.json and the summary)")
        said = (f"{INPUTS_FILE} {unverifiable}: the inputs could not be checked" if unverifiable is not None else
                "changed inputs: " + "; ".join(diff[:5]))
        log.warning("trainer.accept_changed_inputs: resuming %s with %s; recorded as they are now", run.path, said)
        run.record_accepted_inputs(said)
    atomic_write_json(path, now)


def _threads_change(c: TrainConfig, run: RunDir, before: dict | None) -> bool:
    """A resume on the CPU with another ``trainer.threads`` than the run was trained with (its
    ``inputs.json``): refused, since the CPU's sums depend on the thread count and the numbers
    would differ from an uninterrupted run's from the first resumed step, unless
    ``trainer.accept_changed_inputs`` (then recorded, as an input change). Returns whether an
    accepted change was recorded."""
    import torch

    was, now = (before or {}).get("threads"), c.trainer.threads
    on_cpu = c.trainer.device == "cpu" or (c.trainer.device == "auto" and not torch.cuda.is_available())
    if not isinstance(was, int) or was == now or not on_cpu:
        return False
    if not c.trainer.accept_changed_inputs:
        raise ConfigError(
            f"trainer.threads: {run.path} was trained with trainer.threads={was} and is resumed with {now}; on the CPU "
            "a step's sums depend on the thread count, so its numbers would differ from an uninterrupted run's from "
            f"the first resumed step: resume with trainer.threads={was} (datc-launch: --threads {was}), or with "
            f"trainer.accept_changed_inputs=true to go on with {now} (recorded in run.json and the summary)")
    said = f"trainer.threads {was} -> {now}"
    log.warning("trainer.accept_changed_inputs: resuming %s with %s; recorded", run.path, said)
    run.record_accepted_inputs(said)
    return True


def read_inputs(path: Path) -> tuple[dict | None, str | None]:
    """A run's recorded fingerprints (``inputs.json``), or None and why they cannot be read: a
    phrase after the file's name (``is missing``, ``is damaged``, ``holds no fingerprints``)."""
    try:
        before = json.loads(path.read_text())
    except FileNotFoundError:
        return None, "is missing"
    except (ValueError, UnicodeDecodeError):
        return None, "is damaged"
    except OSError as e:
        return None, f"cannot be read ({e.strerror})"
    inputs = before.get("inputs") if isinstance(before, dict) else None
    if not isinstance(inputs, dict) or not all(
            isinstance(v, dict) and isinstance(v.get("path"), str) and isinstance(v.get("files"), dict) for v in inputs.values()):
        return None, "holds no fingerprints (not the file datc writes)"
    return before, None


def resume(s: Session, run: RunDir) -> tuple[int, float]:
    """Load the run's last checkpoint into the session (policy, optimizer, scheduler, RNG) when
    it has one, and cut ``metrics.jsonl`` back to it. Returns (first step to run, seconds
    already trained)."""
    dist = s.dist
    start, elapsed = 0, 0.0
    ckpt, state = None, None
    if run.resumable:  # a damaged latest checkpoint is set aside and the one before loaded (every rank agreeing)
        ckpt, state = (latest_loadable_sharded_checkpoint(run.path, dist.rank, dist.world_size, dist.gather)
                       if dist.enabled else latest_loadable_checkpoint(run.path))
    if ckpt is not None:
        state = s.optim.load(ckpt, state)  # policy, optimizer and schedule (the backend's, datc.backends)
        set_rng_state(state["rng"])
        start, elapsed = state["step"], state["elapsed"]
        s.stream.restore(state, start)  # rollout.max_staleness > 0: the batches the engine had sampled ahead
    if dist.is_main:
        run.truncate_metrics(start if ckpt is not None else -1)
    return start, elapsed


def save(s: Session, run: RunDir, step: int, elapsed: float) -> None:
    """Checkpoint the run after ``step``: policy, optimizer, scheduler, RNG, trained seconds and
    the batches sampled ahead (``rollout.max_staleness > 0``, :mod:`datc.step.stream`)."""
    s.optim.save(run.path, step, rng_state(), elapsed, s.c.trainer.keep_checkpoints, extra=s.stream.state())


def finish(c: TrainConfig, run: RunDir, assets: Assets, elapsed: float) -> dict[str, Any]:
    """Rank 0, after the last step: write the run's summary (and its copy under ``results_dir``)."""
    summary = summarize(c, run, assets, elapsed)
    atomic_write_json(run.summary_file, summary)
    if c.results_dir is not None:
        atomic_write_json(Path(c.results_dir) / f"{c.run_name}.json", summary)
    return summary


def summarize(c: TrainConfig, run: RunDir, assets: Assets, elapsed: float) -> dict[str, Any]:
    """The run's summary from its ``metrics.jsonl``: first and last evaluation, the gold curve
    and its normalized area, mean ``perf/`` and ``credit/`` figures, the reward model's report."""
    rows = run.read_metrics()
    evals = [r for r in rows if "eval/rm_score" in r]
    trains = [r for r in rows if "perf/step_s" in r]
    gaps = metrics_gaps(rows, c.trainer.steps)  # never invent what metrics.jsonl does not hold
    out: dict[str, Any] = {
        "run_name": c.run_name, "run_id": run.run_id, "seed": c.seed,
        "credit": c.credit.get("name", c.credit.get("_target_")), "policy": c.policy.name, "data": c.data.name,
        "steps": c.trainer.steps, "wall_time_s": round(elapsed, 2), "git_commit": GIT_COMMIT,
        "eval": {"initial": {k: v for k, v in evals[0].items() if k != "step"} if evals and evals[0]["step"] == 0 else {},
                 "final": {k: v for k, v in evals[-1].items() if k != "step"} if evals else {},
                 "curve": [{"step": r["step"], "gold": r.get("eval/gold"), "rm_score": r["eval/rm_score"]} for r in evals]},
        "rm_report": assets.rm_report,
    }
    golds = [(r["step"], r["eval/gold"]) for r in evals if r.get("eval/gold") is not None]
    if gaps:
        out["metrics_missing"] = gaps
    if accepted := run.accepted_inputs():  # resumed with trainer.accept_changed_inputs=true
        out["accepted_input_changes"] = accepted
    if len(golds) > 1 and not gaps:  # normalized area under the gold curve (trapezoid rule, per step)
        area = sum((s1 - s0) * (g0 + g1) / 2 for (s0, g0), (s1, g1) in zip(golds, golds[1:], strict=False))
        out["eval"]["gold_auc"] = area / (golds[-1][0] - golds[0][0])
    if trains and not gaps:
        keys = [k for k in trains[0] if k.startswith(("perf/", "credit/"))]
        out["train_mean"] = {k: mean_of([r.get(k) for r in trains]) for k in keys}
    if trains:  # METHOD §6: the first step whose batch collapsed in length (None: never), for the tables
        out["length_collapse"] = collapse_record(trains)
    return out


class NoLogger:
    """Ranks other than 0 log nothing."""

    def log(self, *args: Any) -> None: ...

    def log_samples(self, *args: Any) -> None: ...

    def log_completions(self, *args: Any) -> None: ...

    def catch_up(self, *args: Any) -> int:
        return 0

    def finish(self, *args: Any) -> None: ...


def save_final_policy(policy, tok, out: str | Path, dist=None, adapter=None) -> Path | None:
    """The trained policy (a module or a DeepSpeed engine) and its tokenizer as a Hugging Face
    checkpoint in ``out``; a LoRA policy (``adapter``: its ``PeftModel``) as its adapter
    (:func:`datc.models.lora.save_adapter`). In a process group every rank calls this (ZeRO-3 and
    FSDP2 gather the parameters); rank 0 writes."""
    from datc.backends.plugins import full_state_dict

    module = getattr(policy, "module", policy)
    state = full_state_dict(module)  # collective where a backend partitions it
    if dist is not None and not dist.is_main:
        return None
    if adapter is not None:
        from datc.models.lora import save_adapter

        return save_adapter(adapter, tok, Path(out), state, exist="replace")
    return save_pretrained_dir(module, tok, out, state, exist="replace")  # the run's own final/, rewritten at each finish
