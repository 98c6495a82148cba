"""The rollout stream: which prompts each step trains on, and which weights sampled them.

``rollout.max_staleness`` k (``configs/rollout/``):

- **k = 0** (:class:`SyncRollouts`, the default): step n samples its batch with the policy as it
  is, then trains on it: the synchronous step, bit for bit as before the option.
- **k > 0** (:class:`AsyncRollouts`): batch b is sampled with **policy version**
  ``v(b) = max(0, b − k)``, the weights after ``v(b)`` training steps, on the engine's own
  thread, while the trainer updates: when step n starts, batch ``n + k`` is handed to the engine
  with the weights of version n, and step n trains on batch n, sampled ``min(n, k)`` versions ago.
  The schedule is fixed by (n, k), never by the threads' timing, so a run is deterministic given
  its seed; a batch never waits for weights that are gone (each batch's version is the one the
  trainer holds when it is handed over), so none is trained on more than k versions after it was
  sampled. This is the bounded staleness of TRL's ``AsyncGRPOTrainer`` (``max_staleness``),
  prime-rl's ``max_async_level`` and AReaL's ``max_head_offpolicyness``; k = 1 is verl's
  one-step off-policy trainer.

The engine samples with its own copy of the weights (vLLM's, or the built-in sampler's own copy,
:mod:`datc.engines.own_copy`) and returns its log-probs, which are the behaviour policy: the
update's ``π_old`` is the trained policy's log-prob at the step (AReaL's decoupled PPO: the
proximal policy is the current one), and ``rollout.correction`` re-weights each token by
``π_train / π_sampler`` across the versions (TIS, :mod:`datc.math.correction`), with the gap's
figures every step. The credit is computed on the trained policy's distribution (the step plan
recomputes the logits). At a version boundary the weights are copied on the trainer's thread and
loaded on the engine's (the built-in engine's own copy), or, for an engine that must take them
on the trainer's thread (vLLM: ``RolloutEngine.loads_on_its_thread``), pushed there once the
engine has finished the batches it holds (``perf/push_s``); ``perf/rollout_wait_s`` is the time
the trainer waited for the engine, ``perf/engine_wait_s`` the time the engine waited for work
since the last step. A checkpoint holds the batches already handed to the engine (sampled with weights a resumed
run no longer has), so kill -9 and resume equals the uninterrupted run.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from datc.batch import Rollout
from datc.config import ConfigError
from datc.engines import prompt_seeds
from datc.step.sample import rollout, sample_calls, sampling_args

STATE_KEY = "rollout_stream"  # the checkpoint's entry for the batches in flight


@dataclass(frozen=True)
class Batch:
    """One step's prompts on this rank (whole groups) and their per-prompt seeds."""

    examples: list[dict]
    seeds: list[int]


def batch_for(s, it: int) -> Batch:
    """Step ``it``'s prompts on this rank: a pure function of (seed, step), so a resumed run and
    an engine sampling ahead draw the ones the step trains on."""
    indices = s.sampler.indices(it)
    shard = s.dist.shard(len(indices))
    # per-prompt seeds for an engine with its own sampler: (run seed, step, position, prompt)
    return Batch([s.assets.train[i] for i in indices[shard]], prompt_seeds(s.c.seed, it, indices)[shard])


def version_of(batch: int, k: int) -> int:
    """The policy version (training steps taken) whose weights sample batch ``batch`` at staleness bound ``k``."""
    return max(0, batch - k)


class SyncRollouts:
    """``max_staleness: 0``: each step samples with the policy as it is."""

    staleness = 0

    def take(self, s, it: int) -> Rollout:
        b = batch_for(s, it)
        return rollout(s, b.examples, seeds=b.seeds)

    def figures(self) -> dict[str, float]:
        return {}

    def pause(self) -> None:
        pass

    def state(self) -> dict[str, Any]:
        return {}

    def restore(self, state: dict[str, Any], start: int) -> None:
        pass

    def close(self) -> None:
        pass


class AsyncRollouts:
    """``max_staleness: k > 0``: the engine samples batches ``n + 1 .. n + k`` on its own thread
    while the trainer updates on batch n (the schedule of this module's docstring)."""

    def __init__(self, s, k: int) -> None:
        self.s, self.k, self.steps = s, k, s.c.trainer.steps
        self.engine = s.engine
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="datc-rollout")
        self.pending: dict[int, Future] = {}
        self.handed = -1  # the last batch handed to the engine
        self.loaded: int | None = None  # the version whose weights the engine was last given
        self._lock = threading.Lock()
        self._idle = 0.0  # the engine's time without work since the last step's figures
        self._last_end: float | None = None
        self._figures: dict[str, float] = {}

    def take(self, s, it: int) -> Rollout:
        """Batch ``it``, after handing the engine every batch up to ``it + k`` that it lacks."""
        push = wait = 0.0
        for b in range(self.handed + 1, min(it + self.k, self.steps - 1) + 1):
            v = version_of(b, self.k)
            if v != it:  # only after a resume whose checkpoint lacks the batches in flight
                raise ConfigError(f"rollout.max_staleness: batch {b} is sampled with the weights of step {v}, which "
                                  f"this run (at step {it}) no longer has; its checkpoint holds no batches in flight: "
                                  "resume it with the max_staleness it was started with")
            weights = None
            if self.loaded != v:
                if not self.engine.loads_on_its_thread:  # the engine idle first: the push on this thread
                    t0 = time.perf_counter()
                    for fut in self.pending.values():
                        fut.result()
                    wait += time.perf_counter() - t0
                t0 = time.perf_counter()
                if self.engine.loads_on_its_thread:
                    weights = self.engine.snapshot(s.m.policy)  # copied here, loaded on the engine's thread
                else:
                    self.engine.sync(s.m.policy)
                push += time.perf_counter() - t0
                self.loaded = v
            self.pending[b] = self.pool.submit(self._sample, batch_for(s, b), v, weights)
            self.handed = b
        t0 = time.perf_counter()
        ro = self.pending.pop(it).result()  # the engine's error, if any, raised here
        wait += time.perf_counter() - t0
        stale = it - ro.versions
        if int(stale.max()) > self.k:  # never: the schedule above keeps every batch within k
            raise RuntimeError(f"batch {it} was sampled {int(stale.max())} versions ago, more than max_staleness={self.k}")
        with self._lock:
            idle, self._idle = self._idle, 0.0
        self._figures = {"rollout/staleness": float(stale.float().mean()), "perf/rollout_wait_s": wait,
                         "perf/engine_wait_s": idle, "perf/push_s": push}
        s.ops.observe("rollout", ro)
        return ro

    def _sample(self, batch: Batch, version: int, weights) -> Rollout:
        """On the engine's thread: load the version's weights if given, sample the batch."""
        start = time.perf_counter()
        with self._lock:
            if self._last_end is not None:
                self._idle += start - self._last_end
        try:
            if weights is not None:
                self.engine.load(weights)
            s = self.s
            with s.autocast():  # autocast is per thread
                ro = sample_calls(s, self.engine, batch.examples, sampling_args(s, s.plan), False, batch.seeds)
            ro.versions = torch.full((ro.response_ids.shape[0],), version, dtype=torch.long)
            return ro
        finally:
            with self._lock:
                self._last_end = time.perf_counter()

    def figures(self) -> dict[str, float]:
        """The last batch's staleness (versions between its sampling and its training step) and
        the waiting times; read once by the step's metrics."""
        out, self._figures = self._figures, {}
        return out

    def pause(self) -> None:
        """Before the trainer's thread draws from torch's global random stream (the evaluation's
        sampling): an engine whose sampling draws from it too (vLLM) finishes the batches it
        holds first, so neither moves the other's numbers."""
        if self.engine.draws_global_rng:
            for fut in self.pending.values():
                fut.result()

    def state(self) -> dict[str, Any]:
        """The batches handed to the engine and not yet trained on (waited for), for the checkpoint."""
        batches = {b: {f.name: getattr(fut.result(), f.name) for f in dataclasses.fields(Rollout)}
                   for b, fut in sorted(self.pending.items())}
        return {STATE_KEY: {"max_staleness": self.k, "batches": batches}}

    def restore(self, state: dict[str, Any], start: int) -> None:
        """A resumed run's batches in flight at its checkpoint of step ``start``."""
        saved = state.get(STATE_KEY)
        self.handed = start - 1
        if saved is None:
            return  # the schedule's first batch after start then names what is missing
        for b, fields in saved["batches"].items():
            fut: Future = Future()
            fut.set_result(Rollout(**fields))
            self.pending[int(b)] = fut
        self.handed = max(self.pending, default=start - 1)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def build_stream(s) -> SyncRollouts | AsyncRollouts:
    """The session's rollout stream for ``rollout.max_staleness``."""
    k = s.c.rollout.max_staleness
    return AsyncRollouts(s, k) if k > 0 else SyncRollouts()
