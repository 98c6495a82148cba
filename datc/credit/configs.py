"""The credit config group (``configs/credit/*.yaml``): every scheme a run can choose by label.

A config's ``name`` is its label (run names, tables, plots, summaries); ``scheme`` names the
registered scheme that computes it (default: ``name``). An ablation that only changes a default
is a few lines over its scheme's config (``configs/credit/datc_unsigned.yaml``: Hydra defaults
``- datc`` then ``_self_``, ``name: datc_unsigned``, ``scheme: datc``, ``direction: unsigned``),
so it is listed here but has no registry entry of its own.

No model, session or trainer code: Hydra composes the YAML files, nothing else.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from datc.paths import CONFIG_DIR

CREDIT_CONFIG_DIR = Path(CONFIG_DIR) / "credit"


def credit_config_names() -> list[str]:
    """The options of the ``credit`` group (``credit=<option>``), sorted."""
    return sorted(p.stem for p in CREDIT_CONFIG_DIR.glob("*.yaml"))


def credit_config(option: str) -> dict[str, Any]:
    """The ``credit`` node that ``credit=<option>`` composes (defaults lists followed), as a
    plain dict: what :func:`datc.credit.resolve_scheme` takes."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    if option not in credit_config_names():
        raise ValueError(f"credit={option}: no such option in credit/; choose one of {', '.join(credit_config_names())}")
    if GlobalHydra.instance().is_initialized():  # inside a Hydra app or an initialize block: compose there
        cfg = compose(config_name=f"credit/{option}")
    else:
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
            cfg = compose(config_name=f"credit/{option}")
    return OmegaConf.to_container(cfg.credit, resolve=True)


def credit_configs(names: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """Label -> ``credit`` node for ``names`` (default :func:`credit_labels`): a credit
    config's composed node, or ``{"name": <registered>}`` (its defaults) for a registered
    scheme without a config file."""
    options = set(credit_config_names())
    return {n: credit_config(n) if n in options else {"name": n} for n in (credit_labels() if names is None else names)}


def credit_labels() -> list[str]:
    """Every scheme label a run can carry: the credit configs' options and the registered
    schemes (a scheme registered in code without a config file is chosen by ``credit.name``),
    sorted. A new config file or registered scheme appears here with no edit."""
    from datc.credit import CREDIT_SCHEMES

    return sorted(set(credit_config_names()) | set(CREDIT_SCHEMES.names()))
