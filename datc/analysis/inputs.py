"""The inputs of the credit analysis: a session, and one sampled batch with every input any
scheme may declare.

This is the analysis's only module that calls the step's phases (:mod:`datc.step`: ``rollout``,
the frozen passes, ``reward``, ``credit_inputs``) or builds a session: the phases are a run's
own, under the plan :meth:`datc.step.plan.StepPlan.for_analysis`, so the analysed credit is the
credit a run computes. Everything else in
:mod:`datc.analysis` works on what these functions return. Shapes: B responses (prompts × G,
groups contiguous), T response positions (right-padded), V vocabulary, d reward-model hidden size.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from datc.batch import Rollout
from datc.credit import CreditBatch
from datc.credit.base import NEEDS
from datc.paths import CONFIG_DIR

# ---- the analysis calls the step's phases here, nowhere else --------------------------------
from datc.step.credit import credit_inputs as step_credit_inputs
from datc.step.frozen import frozen_passes
from datc.step.reward import reward
from datc.step.sample import rollout
from datc.training.session import Session, build_session, rm_embedding_of


@dataclass
class CreditInputs:
    """One sampled batch with every input any scheme may declare, and its gold when known."""

    rollout: Rollout
    batch: CreditBatch  # every optional field filled; no generator (see generator_seed)
    gold: Tensor | None  # (B,) gold reward of each response; None without a testbed task
    gold_contrib: Tensor | None  # (B, T) per-token gold contribution, 0 on padding; or None
    generator_seed: int  # seeds a fresh generator per scheme, so each draws the same numbers

    @property
    def advantages(self) -> Tensor:
        """(B,) group advantages A_i of the reward-model scores."""
        return self.batch.advantages


def session_for(overrides: list[str]) -> Session:
    """Compose ``configs/train.yaml`` with Hydra overrides, build the session (assets prepared
    or loaded from the cache) and seed torch with the config's seed."""
    from hydra import compose, initialize_config_dir

    from datc.checks import validate

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    session = build_session(validate(cfg))
    # Seeded after the build: preparing missing assets draws random numbers, and the samples
    # must not depend on whether the cache was warm.
    torch.manual_seed(session.c.seed)
    return session


def credit_inputs(
    session: Session, examples: list[dict[str, Any]], generator_seed: int
) -> CreditInputs:
    """Sample ``num_generations`` responses per example with the session's policy and compute
    everything a scheme may read: the reward model's scores and input-embedding gradients
    (B, T, d), its embedding matrix (V, d), group advantages (B,) with the session's
    ``scale_rewards``, and the rollout policy's log-probs (B, T), entropies (B, T, nats) and
    logits (B, T, V), LM-head inputs (B, T, d_policy), the prompt texts (B) and the log-probs
    under other prompts (a function, one policy pass per call); plus the gold reward (B,) and contributions (B, T) on a testbed
    task.

    Advantages come from the reward model's scores alone (no ``reward.scale``, no rules): the
    credit a scheme assigns is judged against the reward model it differentiates. The phases
    are the step's (:mod:`datc.step`), under the plan :meth:`datc.step.plan.StepPlan.for_analysis`,
    with its non-finite guards.
    """
    plan = session.plan.for_analysis()
    ro = rollout(session, examples, plan)
    rw = reward(session, ro, frozen_passes(session, ro, plan), plan, mask=ro.response_mask, shaped=False)
    gold, contrib = rw.gold, rw.gold_contrib
    if gold is not None:  # gold_of works on the CPU; the masks it is compared with live on the session's device
        gold, contrib = gold.to(rw.advantages.device), contrib.to(rw.advantages.device)
    # every input any scheme may declare, from one pass of the rollout policy over the whole batch
    everything = dataclasses.replace(session, rm_embedding=session.rm_embedding if session.rm_embedding is not None
                                     else rm_embedding_of(session.m))
    batch = step_credit_inputs(everything, ro, rw, slice(0, len(ro.examples)), plan, None, needs=NEEDS).batch
    return CreditInputs(ro, batch, gold, contrib, generator_seed)



GROUPS = ("policy", "reward", "credit", "data", "trainer", "logger", "deepspeed", "experiment", "debug")


class RunRefused(ValueError):
    """A run directory the analysis cannot read (the message says why); its command says it in
    one line, exit 2."""


def run_session(run_dir: Path, overrides: list[str]) -> tuple[Session, Path]:
    """The session of a run directory: its own resolved config (``config.yaml``), with plain
    ``key=value`` overrides (not group choices: the run already made those), and the policy's
    weights from its latest checkpoint (a LoRA run's: its adapters, on the base the config
    names). Returns (session, checkpoint directory); :class:`RunRefused` says why not."""
    from omegaconf import OmegaConf

    from datc.checks import validate
    from datc.commands.export import ExportError, checkpoint_state_dict, load_policy_weights
    from datc.config import ConfigError
    from datc.models.lora import load_trained_state
    from datc.run.checkpoint import latest_checkpoint
    from datc.run.rundir import read_run_config

    if not (run_dir / "config.yaml").exists():
        raise RunRefused(f"--run {run_dir}: not a datc run directory (no config.yaml)")
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        raise RunRefused(f"--run {run_dir}: no complete checkpoint under {run_dir / 'checkpoints'}")
    groups = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") in GROUPS]
    if groups:
        raise RunRefused(f"--run: {' '.join(groups)}: the run's own config ({run_dir / 'config.yaml'}) sets its groups; "
                         "only plain fields can be overridden (e.g. cache_dir=...)")
    try:
        own = read_run_config(run_dir)  # checked against run.json
        cfg = OmegaConf.merge(OmegaConf.create(own), OmegaConf.from_dotlist(list(overrides)))
        s = build_session(validate(cfg))
        state = checkpoint_state_dict(ckpt)
        if s.m.adapter is not None:  # a LoRA run's checkpoint holds its adapters alone
            load_trained_state(s.m.policy, state, str(ckpt))
        else:
            load_policy_weights(s.m.policy, state)
    except (ConfigError, ExportError) as e:
        raise RunRefused(f"--run: {e}") from None
    torch.manual_seed(s.c.seed)  # after the build, as session_for: samples never depend on a warm cache
    return s, ckpt
