"""Rollout engines: what samples the step's responses (``rollout=torch|vllm``, configs/rollout/).

Every engine returns the same :class:`datc.batch.Rollout` (left-padded prompts, right-padded
responses, masks, truncation); an engine that samples with its own copy of the weights also
returns its per-token log-probs (``Rollout.sampler_logps``) and has the policy's weights pushed
to it before each rollout (:meth:`RolloutEngine.sync`). The step calls the engine the session
built and never asks which one it is: the differences (whether the sampler's logits can be
reused by the credit, whether the importance-sampling correction applies) are decided once in
the step plan from the engine's declarations.

| engine | module | logits kept | own weights | correction default |
|---|---|---|---|---|
| ``torch`` | :mod:`datc.engines.builtin` | yes | no (samples with the trainer's policy) | none |
| ``vllm`` | :mod:`datc.engines.vllm_engine` | no | yes (pushed before each rollout) | ``token_truncate``, C = 2 |
"""

from __future__ import annotations

from datc.engines.base import RolloutEngine, SamplingArgs, prompt_seeds
from datc.registry import Registry

ENGINES: Registry[type[RolloutEngine]] = Registry("rollout engine")


def _register() -> None:
    from datc.engines.builtin import TorchEngine
    from datc.engines.vllm_engine import VLLMEngine

    ENGINES.register("torch")(TorchEngine)
    ENGINES.register("vllm")(VLLMEngine)


_register()

__all__ = ["ENGINES", "RolloutEngine", "SamplingArgs", "prompt_seeds"]
