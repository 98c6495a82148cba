"""The training loop: open (or resume) the run, then step, log, evaluate and checkpoint.

``train(cfg)`` is called by the Hydra entry point (:mod:`datc.train`) and directly by tests.
The step itself (rollout → frozen passes → reward → credit → loss and update → metrics) is
:func:`datc.step.train_step`; around the loop: the session (:mod:`datc.training.session`, with the step
plan decided once), evaluation (:mod:`datc.training.evaluation`) and the run's life cycle
(:mod:`datc.training.lifecycle`).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from tqdm.auto import tqdm

from datc.atomic import atomic_write_json
from datc.backends.distributed import Dist
from datc.backends.plugins import init as init_distributed
from datc.checks import validate
from datc.config import TrainConfig
from datc.math.collapse import FLAG_KEY, CollapseWatch
from datc.math.numerics import NonFiniteReport
from datc.memory.micro_batch import RECORD_FILE
from datc.run.logger import RunLogger, send_finished_run
from datc.run.rundir import release_run_locks
from datc.run.runlock import note, warn
from datc.run.signals import stop_if_requested, stop_requested, stop_signals
from datc.step import train_step
from datc.step.ops import StepOps
from datc.training import eval_cache
from datc.training.evaluation import evaluate
from datc.training.lifecycle import (
    INPUTS_FILE,
    NoLogger,
    check_inputs,
    finish,
    open_run,
    read_inputs,
    resolved_config,
    resume,
    save,
    save_final_policy,
)
from datc.training.session import build_session
from datc.utils import deterministic_mode, keep_freed_memory, quiet_libraries, seed_everything

log = logging.getLogger(__name__)


SAMPLER_GAP = "rollout/sampler_logp_diff_mean"  # shown on the step line as sampler_gap


def train(cfg: DictConfig | dict, run_dir: str | Path | None = None, ops: StepOps | None = None) -> dict[str, Any]:
    """Run one experiment; return its summary (also written to ``<run_dir>/summary.json``).

    Under DeepSpeed every process calls this; rank 0 owns the run directory, the metrics, W&B
    and the summary, every rank writes its own shards and RNG state into the checkpoints.
    ``ops``: the step's seams (:class:`datc.step.ops.StepOps`), for tests."""
    c = validate(cfg)  # typed and range-checked before any model loads
    with deterministic_mode(c.trainer.deterministic):  # its settings before CUDA starts; the former ones after the run
        return _run(c, cfg, run_dir, ops)


def _run(c: TrainConfig, cfg: DictConfig | dict, run_dir: str | Path | None, ops: StepOps | None) -> dict[str, Any]:
    dist = init_distributed(c)  # world-size checks, then the process group (DeepSpeed only)
    try:
        with stop_signals():  # SIGTERM / SIGINT: checkpoint at the next step boundary, then stop
            return _train(c, resolved_config(cfg), dist, run_dir, ops)
    finally:
        release_run_locks()
        dist.close()
        gc.collect()  # the run's models go before the next job of a sweep in this process (datc-train -m) builds its own



def _train(c: TrainConfig, resolved: dict[str, Any], dist: Dist, run_dir: str | Path | None,
           ops: StepOps | None) -> dict[str, Any]:
    t = c.trainer
    run, done = open_run(dist, run_dir or c.run_dir, resolved, t.resume)
    if done is not None:  # this run already finished: nothing to redo
        if dist.is_main:
            note(f"{run.path} already holds this run, finished: returning its summary (nothing retrained)")
            if (sent := send_finished_run(run, c.logger, c.run_name, resolved, done)) is not None:
                note(sent)  # e.g. `datc-train logger=tensorboard` after `make demo`
        if dist.is_main and c.results_dir is not None:  # e.g. `make demo-results` after `make demo`
            atomic_write_json(Path(c.results_dir) / f"{c.run_name}.json", done)
        return done
    torch.set_num_threads(t.threads)
    if t.keep_freed_memory and not dist.enabled:  # single-process runs (see the README's speed section)
        keep_freed_memory()
    quiet_libraries()
    if dist.is_main and not run.resumable:  # a fresh run sizes its own micro-batch (datc.memory.micro_batch)
        (run.path / RECORD_FILE).unlink(missing_ok=True)
    try:
        s = build_session(c, dist, ops, on_assets=lambda assets: check_inputs(dist, c, run, assets), run_dir=run.path)
    except BaseException:
        if dist.is_main:
            run.discard()
        raise
    try:
        return _loop(s, run, resolved, dist)
    finally:
        s.stream.close()  # rollout.max_staleness > 0: the engine's thread ends with the run
        s.engine.close()  # vLLM: its teardown as the run ends, not when the collector gets to it (VLLMEngine.close)


def _loop(s, run, resolved: dict[str, Any], dist: Dist) -> dict[str, Any]:
    c, t = s.c, s.c.trainer  # trainer.micro_batch_size: auto resolved by the session
    # Seeded after the set-up: a cold cache (prepare draws random numbers) and a warm one must
    # give the same run. Rank r samples its own responses (rank 0's stream is a lone run's).
    seed_everything(c.seed + 1_000_003 * dist.rank)
    eval_rows = list(s.assets.eval)[: t.eval_size]
    start, elapsed = resume(s, run)
    logger = RunLogger(run, c.logger, c.run_name, resolved, start) if dist.is_main else NoLogger()
    if dist.is_main:
        # the paths this run's step takes (datc.step.plan), for a reader: in the run directory, not the console
        atomic_write_json(run.path / "step_plan.json", s.plan.describe())
        log.debug("step plan: %s", s.plan.describe())
        if start > 0:
            note(f"resumed {run.path} from its checkpoint of step {start} of {t.steps}")
    completions = None  # of the last step before an eval (the tracker's completions table)
    prior = run.read_metrics() if start > 0 and dist.is_main else []  # a resumed run's step 0 (rank 0 logs)
    if (n := logger.catch_up(prior)) and dist.is_main:  # resumed with a tracker it was not sent to before
        note(f"sent the {n} metric rows this run logged before its resume to {logger.label} ({logger.where()})")
    collapse = CollapseWatch.from_rows(r for r in prior if r.get("step", 0) <= start)  # METHOD §6's length collapse

    def evaluation() -> tuple[dict[str, float], list[dict]]:
        with s.autocast():  # every rank evaluates (ZeRO-3 gathers need all of them); rank 0 logs
            return evaluate(c, s.m, eval_rows, s.assets.task, s.device, s.plan, s.optim.generation)

    def do_eval(step: int) -> None:
        s.stream.pause()  # rollout.max_staleness > 0 with vLLM: its thread leaves torch's global stream to the eval
        if step == 0 and dist.is_main:  # an earlier attempt's record (a run restarted from step 0) says nothing now
            (run.path / eval_cache.RECORD).unlink(missing_ok=True)
        if step == 0 and t.eval_cache and not dist.enabled:  # shared by runs that start alike (datc.training.eval_cache)
            parts = eval_cache.key_parts(dataclasses.asdict(c), s.m, eval_rows, read_inputs(run.path / INPUTS_FILE)[0], s.device)
            metrics, samples = eval_cache.evaluate_cached(t.eval_cache, parts, run.path, c.run_name, evaluation)
        else:
            metrics, samples = evaluation()
        logger.log(metrics, step)
        logger.log_samples(samples, step)
        logger.log_completions(completions, step)

    stop_if_requested(stop_requested(dist), start, saved=False)  # a signal during the set-up
    if start == 0:
        do_eval(0)
    bar = tqdm(range(start, t.steps), initial=start, total=t.steps, disable=not (t.progress and dist.is_main), desc=c.run_name)
    for it in bar:
        result = train_step(s, it)
        metrics = result.metrics
        if result.completions is not None:
            completions = result.completions
        step = it + 1
        elapsed += metrics["perf/step_s"]
        metrics[FLAG_KEY], first_collapse = collapse.update(step, metrics)
        if first_collapse and dist.is_main:
            warn(collapse.warning(step))  # on a line of its own, off the progress bar's
        logger.log(metrics, step)
        _merged_nonfinite(dist, result.nonfinite).check(t.max_nonfinite_frac, step)  # after the step is logged
        if step % t.eval_every == 0 or step == t.steps:
            do_eval(step)
        stopping = stop_requested(dist)
        if step % t.checkpoint_every == 0 or step == t.steps or stopping:
            save(s, run, step, elapsed)
        shown = {k.split("/")[1]: f"{metrics[k]:.3f}" for k in ("reward/gold", "reward/rm_score", "loss/kl") if k in metrics}
        if SAMPLER_GAP in metrics:  # an engine with its own sampler: its gap to the trainer, in nats
            shown["sampler_gap"] = f"{metrics[SAMPLER_GAP]:.2g}"
        bar.set_postfix(shown)
        if dist.is_main and not t.progress:  # no bar: one log line per step (train.log and stderr)
            log.info("step %d/%d: %s, %.2fs", step, t.steps, ", ".join(f"{k} {v}" for k, v in shown.items()),
                     metrics["perf/step_s"])
        stop_if_requested(stopping and step < t.steps, step)  # the last step finishes the run instead

    save_final_policy(s.optim.module, s.m.tok, run.path / "final", dist, s.m.adapter)  # a Hugging Face checkpoint
    summary = None
    if dist.is_main:
        summary = finish(c, run, s.assets, elapsed)
        logger.finish(dict(summary["eval"]["final"]))
    summary = dist.broadcast(summary)
    # The ranks meet before they leave the process group, so none tears its side down while another
    # is still in its last collective (a rank of a resumed FSDP2 run aborted now and then with
    # "terminate called without an active exception"). Only here, on the way out of a whole run:
    # after a lost rank, a barrier could wait for the collective timeout.
    dist.barrier()
    return summary


def _merged_nonfinite(dist: Dist, report: NonFiniteReport) -> NonFiniteReport:
    """The step's non-finite hits over all ranks, so every rank stops (or not) together."""
    if dist.world_size == 1:
        return report
    parts = dist.gather(report)
    merged = NonFiniteReport(sum(p.batch_size for p in parts))
    for src in {k for p in parts for k in p.hits}:
        merged.add(src, torch.cat([p.hits.get(src, torch.zeros(p.batch_size, dtype=torch.bool)) for p in parts]))
    merged.nonfinite_micro_batches = sum(p.nonfinite_micro_batches for p in parts)
    return merged
