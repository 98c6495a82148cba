"""A study's protocol (METHOD §6): its seeds, its schemes' defaults and initial grids, its search,
and the manifest (``tuning.json``) that keeps them, merged with the one a setting's folder holds.

A manifest without a ``"search"`` was made by the fixed-grid protocol before ``datc-study``
(``scripts/tuned_sweep.py``): a study asking for the same setting, experiment, task overrides,
seeds and scheme specs continues it under the bracketing rule (``"search"`` and
``"continued_from"`` added; the missing bracket points are then run, nothing finished again);
anything else differing is another protocol, refused in one line before any run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from datc.study.reading import KNOB_FACTORS, LR_FACTORS, MANIFEST, grid, knob_for
from datc.study.search import LEGACY, SEARCH

STAGES = ("lr", "knob", "eval", "kl")
# the run directory's name: the setting, the scheme, the asset draw, the seed, the config's hash
RUN_NAME = "run_name=${data.name}-${policy.name}-${credit.name}-p${prepare_seed}-s${seed}-${datc.config_id:}"
RESERVED = ("seed", "prepare_seed", "credit", "trainer.lr", "policy", "data", "experiment", "run_name", "run_dir")


class Refused(Exception):
    """A study that cannot run as asked: one line, exit 2, before any run starts."""


def seeds(text: str) -> list[int]:
    """``100,101`` or ``200-205``."""
    out: list[int] = []
    for part in text.split(","):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b) + 1)) if b else [int(a)]
    return out


def split_overrides(overrides: list[str]) -> tuple[list[str], list[str]]:
    """(task overrides, launcher overrides): ``hydra...`` and ``hydra/...`` go to the launcher
    (they are not protocol: the same study may run on a laptop and on a cluster)."""
    hydra = [o for o in overrides if o.lstrip("+~").startswith("hydra")]
    return [o for o in overrides if o not in hydra], hydra


def check_seeds_and_overrides(select: list[int], evaluate: list[int], draws: list[int], task: list[str]) -> None:
    """METHOD §6's seeds: at least 2 selection seeds, evaluation seeds distinct, split evenly over
    the draws and never a selection seed; no override sets what the study sets."""
    if len(select) < 2:
        raise Refused("--select-seeds: METHOD §6 selects on at least 2 seeds")
    if len(evaluate) % len(draws) or len(set(evaluate)) != len(evaluate):
        raise Refused(f"--eval-seeds: {len(evaluate)} distinct seeds do not split evenly over draws {draws}")
    if shared := sorted(set(select) & set(evaluate)):
        raise Refused(f"--eval-seeds shares seed(s) {', '.join(map(str, shared))} with --select-seeds "
                      "(METHOD §6: evaluate on fresh seeds)")
    if bad := [o for o in task if "=" not in o or o.split("=")[0].lstrip("+~").startswith(RESERVED)]:
        raise Refused(f"override {bad[0]!r}: not KEY=VALUE, or sets what the study sets ({', '.join(RESERVED)}, hydra.sweep)")


def scheme_spec(cfg: Any) -> dict[str, Any]:
    """A scheme's defaults in this setting, from its composed config, and its initial grids (the
    lattice's ×0.5, ×1, ×2: the same fields the fixed-grid manifests hold)."""
    from datc.credit import CREDIT_SCHEMES

    credit = dict(cfg.credit)
    output = CREDIT_SCHEMES.get(str(credit.get("scheme", credit["name"]))).output
    knob = knob_for(credit, output)
    lr = float(cfg.trainer.lr)
    return {"lr": lr, "lr_grid": grid(lr, LR_FACTORS), "knob": f"credit.{knob}" if knob else None,
            "knob_default": float(credit[knob]) if knob else None,
            "knob_grid": grid(float(credit[knob]), KNOB_FACTORS) if knob else [], "output": output}


def new_manifest(data: str, policy: str, experiment: str, task: list[str], select_draw: int, select: list[int],
                 draws: list[int], evaluate: list[int], specs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    per = len(evaluate) // len(draws)
    return {
        "protocol": "METHOD §6", "setting": {"data": data, "policy": policy}, "experiment": experiment,
        "overrides": list(task), "selection": {"prepare_seed": select_draw, "seeds": list(select)},
        "evaluation": {"seeds": {str(d): evaluate[i * per:(i + 1) * per] for i, d in enumerate(draws)}},
        "schemes": specs, "search": dict(SEARCH),
    }


# Overrides that change how a study's runs are executed, not what they compute (not in a run's
# identity): a study may change them between invocations without being another protocol.
NOT_PROTOCOL = {"trainer.eval_cache"}


def override_key(o: str) -> str:
    """The key an override sets (``+a.b=1``, ``~a.b``: ``a.b``)."""
    return o.split("=", 1)[0].lstrip("+~")


def _protocol(overrides: list[str]) -> list[str]:
    return [o for o in overrides if override_key(o) not in NOT_PROTOCOL]


def merge_manifest(folder: Path, new: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """The protocol the study runs under: ``new`` where the folder holds none, else the folder's,
    with new schemes added (and, for a fixed-grid manifest, the bracketing search added); refuses
    (:class:`Refused`) another protocol. Returns the manifest and a one-line note (or None)."""
    path = folder / MANIFEST
    if not path.exists():
        return new, None
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise Refused(f"{path}: unreadable ({type(e).__name__}: {e}); move it aside or use another --root") from None
    if not isinstance(old, dict) or not isinstance(old.get("schemes"), dict) or not isinstance(old.get("overrides", []), list) \
            or not all(isinstance(o, str) for o in old.get("overrides", [])):
        raise Refused(f"{path}: not a study's manifest (no object with its schemes and overrides); move it aside or "
                      "use another --root")
    old_task = [o for o in old.get("overrides", []) if not o.lstrip("+~").startswith("hydra")]
    for key, a, b in (("setting", old.get("setting"), new["setting"]), ("experiment", old.get("experiment"), new["experiment"]),
                      ("overrides", _protocol(old_task), _protocol(new["overrides"])), ("selection", old.get("selection"), new["selection"]),
                      ("evaluation", old.get("evaluation"), new["evaluation"]),
                      ("search", old.get("search", new["search"]), new["search"])):
        if a != b:
            raise Refused(f"{path} holds another protocol ({key}: {a} there, {b} asked); a study keeps its protocol: "
                          "use another --root")
    for name, spec in new["schemes"].items():
        if name in old.get("schemes", {}) and old["schemes"][name] != spec:
            raise Refused(f"{path}: scheme {name}'s defaults or grids changed since its first batch "
                          f"({old['schemes'][name]} there, {spec} now); use another --root")
    note = None
    merged = {**old, "overrides": new["overrides"], "schemes": {**old["schemes"], **new["schemes"]}}
    if "search" not in old:
        merged |= {"search": new["search"], "continued_from": LEGACY}
        note = (f"{path}: a study of the {LEGACY} protocol, continued under METHOD §6's bracketing and ±5% matched KL: "
                "its missing bracket points are added, nothing finished runs again")
    for name in old["schemes"]:  # a scheme's spec stays as first written (the grids' floats)
        merged["schemes"][name] = old["schemes"][name]
    return merged, note


def write_manifest(folder: Path, m: dict[str, Any]) -> None:
    from datc.atomic import atomic_write_json

    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_json(folder / MANIFEST, m)
