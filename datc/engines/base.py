"""The rollout engine's interface, and the per-prompt seeds an engine with its own sampler uses."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from datc.batch import Rollout


class EngineError(RuntimeError):
    """The rollout engine failed (its worker gone, an error inside it): said in one line by the
    command, the run's last checkpoint kept, so running the command again resumes the run."""


@dataclass(frozen=True)
class SamplingArgs:
    """How one rollout samples (the trainer's settings, fixed for the run)."""

    num_generations: int  # G responses per prompt, contiguous
    max_new_tokens: int  # T, the response budget
    temperature: float
    top_p: float
    prompt_field: str = "prompt"
    synced_gpus: bool = False  # ZeRO-3 across ranks: every rank forwards until all are done (torch engine)
    share_prompts: bool = True  # each prompt's prefill once for its group (torch engine)
    decode: str = "dynamic"  # the torch engine's decode loop (datc.engines.static_decode)
    sync_every: int = 8  # ... and how often it checks for finished rows
    row_draws: bool = False  # trainer.deterministic: each response's draws from its own generator (its prompt's seed)


class RolloutEngine:
    """What samples a rollout. ``keeps_logits``: the engine can hand back the sampler's raw
    logits (B, T, V), which the credit reuses instead of a second policy pass;
    ``own_weights``: the engine samples with its own copy of the policy's weights, which
    :meth:`sync` refreshes, and returns its per-token log-probs (``Rollout.sampler_logps``);
    ``loads_on_its_thread``: weights copied by :meth:`snapshot` may be loaded (:meth:`load`) on
    the thread that samples (:mod:`datc.step.stream`), else they are pushed by :meth:`sync` on
    the trainer's thread while the engine is idle."""

    name = "base"
    keeps_logits = False
    own_weights = False
    loads_on_its_thread = False  # an asynchronous rollout may hand it weights to load on the engine's own thread
    draws_global_rng = False  # its sampling draws from torch's global random stream (whatever its seeds)

    @classmethod
    def declared(cls, c) -> type[RolloutEngine]:
        """The engine class whose declarations (``keeps_logits``, ``own_weights``) a run with
        config ``c`` gets from :meth:`build`, known before any model loads (the memory plan reads
        them through :func:`datc.step.plan.build_plan`)."""
        return cls

    def sample(self, policy, tok, examples: list[dict[str, Any]], args: SamplingArgs, *, keep_logits: bool = False,
               encoder=None, seeds: list[int] | None = None, ops=None) -> Rollout:
        """``args.num_generations`` responses to each of ``examples`` (groups contiguous).
        ``seeds``: one per example, for an engine with its own random streams (:func:`prompt_seeds`);
        ``ops``: the session's seams (:class:`datc.step.ops.StepOps`; the built-in engine samples
        through ``ops.sample``)."""
        raise NotImplementedError

    def sync(self, policy) -> None:
        """Push the policy's current weights to the engine (nothing for an engine that samples
        with the policy itself)."""

    def snapshot(self, policy) -> Any:
        """The policy's current weights, copied, in the form :meth:`load` takes: what an
        asynchronous rollout (``rollout.max_staleness > 0``, :mod:`datc.step.stream`) hands the
        engine at a version boundary, so the trainer can update its own while the engine loads
        these. The trainer waits only for the copy."""
        raise NotImplementedError(f"the {self.name} engine cannot sample with weights other than the policy's")

    def load(self, weights: Any) -> None:
        """Take the weights of :meth:`snapshot` (on the engine's own thread)."""
        raise NotImplementedError(f"the {self.name} engine cannot sample with weights other than the policy's")

    def sleep(self) -> None:
        """Release the engine's memory while the update runs (an engine that can)."""

    def describe(self) -> dict[str, Any]:
        """The engine's settings, for the run's log."""
        return {"name": self.name}

    def close(self) -> None:
        """Free the engine."""


def prompt_seeds(run_seed: int, step: int, indices: list[int], offset: int = 0) -> list[int]:
    """One seed per prompt from (run seed, step, the prompt's position in the step and its
    dataset index): a resumed run draws the same responses, whichever rank samples the prompt.
    31-bit values; vLLM seeds a request's ``n`` children with ``seed + i``, so two prompts'
    streams meet only if their seeds are within G of each other (chance about G / 2^31)."""
    out = []
    for j, idx in enumerate(indices):
        h = hashlib.blake2b(f"{run_seed}:{step}:{offset + j}:{idx}".encode(), digest_size=8).digest()
        out.append(int.from_bytes(h, "little") & 0x7FFF_FFFF)
    return out
