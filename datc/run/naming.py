"""Run names that tell runs apart: readable parts plus a short hash of the whole run identity.

``configs/train.yaml`` names a run ``${data.name}-${policy.name}${datc.lora_mark:...}-${credit.name}-s${seed}-${datc.config_id:}``
(``-lora<r>`` after the policy where it trains LoRA adapters).
The readable parts say what a listing needs at a glance; ``datc.config_id`` is a 6-hex-digit
hash of everything that determines the run's results (:func:`datc.run.identity.identity`: the same
fields as the run's identity in ``run.json``), so two runs whose configs differ anywhere (a
``debug=fast`` sweep and the real one, ``deepspeed=zero2`` and plain PyTorch, another
``trainer.steps``) get different directories, while the same command always gets the same name
and so resumes its own run.

The resolver is registered when :mod:`datc` is imported, before any config is composed.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from datc.hashing import config_hash

CONFIG_ID_LEN = 6  # hex digits: 16.7 M values, plenty for the runs one project holds


def config_id(root: DictConfig) -> str:
    """The hash of the identity of the config ``root`` (a composed config, with or without
    Hydra's node; raw or already merged into the schema: both give the same hash)."""
    from datc.config import TrainConfig
    from datc.run.identity import NON_IDENTITY, identity

    # Only the identity fields are resolved (run_name and run_dir refer to this hash).
    keys = [k for k in root if k not in NON_IDENTITY and k != "hydra"]
    plain: dict[str, Any] = {}
    for k in keys:
        v = root[k]
        plain[k] = OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v
    try:  # through the schema, so defaults and types are the same before and after validation
        merged = OmegaConf.merge(OmegaConf.structured(TrainConfig), plain)
        plain = {k: v for k, v in OmegaConf.to_container(merged, resolve=True).items() if k not in NON_IDENTITY}
    except Exception:  # a config the schema refuses: validation names the field later
        pass
    return config_hash(identity(plain), CONFIG_ID_LEN)


def _resolve_config_id(*, _root_: DictConfig) -> str:
    return config_id(_root_)


def lora_mark(r: Any) -> str:
    """``-lora<r>`` in the name of a run that trains LoRA adapters (``policy.lora.r > 0``), nothing
    for a full-policy run (whose name is as it always was)."""
    try:
        r = int(r or 0)
    except (TypeError, ValueError):
        return ""
    return f"-lora{r}" if r > 0 else ""


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("datc.lora_mark"):
        OmegaConf.register_new_resolver("datc.lora_mark", lora_mark)
    if not OmegaConf.has_resolver("datc.config_id"):
        OmegaConf.register_new_resolver("datc.config_id", _resolve_config_id)
    if not OmegaConf.has_resolver("datc.cache_dir"):
        from datc.paths import default_cache_dir

        OmegaConf.register_new_resolver("datc.cache_dir", default_cache_dir)
