"""Which runs may be compared: only runs whose configs differ in nothing but the credit scheme
and the seed. Runs of one ``(data, policy)`` whose configs differ elsewhere (other step counts,
learning rates, ...) are split into separate settings, each labelled with the values that tell
it apart (``tiny_gpt2 [trainer.steps=20]``), and every split is said.

A run's config is the identity in its ``run.json`` (beside ``summary.json``) or its W&B config;
a summary without either is compared by data, policy and step count only, and said. Settings
that change no number a run trains to (checkpoint and evaluation cadence:
:data:`datc.report.loading.CADENCE_KEYS`) do not split a setting; runs evaluated at different
steps are compared over the steps all of them evaluated (:func:`align_curves`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from typing import Any

from datc.report.loading import LoadResult, Run, gold_auc


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix.rstrip("."): d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}."))
    return out


def _key(run: Run) -> str:
    return json.dumps(run.config if run.config is not None else {"steps (config unknown)": run.steps},
                      sort_keys=True, default=str)


def _without(config: dict[str, Any] | None, keys: Iterable[str]) -> dict[str, Any] | None:
    """``config`` less the (dotted) ``keys``."""
    if config is None:
        return None
    out = json.loads(json.dumps(config, default=str))
    for key in keys:
        *path, last = key.split(".")
        d = out
        for p in path:
            d = d.get(p) if isinstance(d, dict) else None
        if isinstance(d, dict):
            d.pop(last, None)
    return out


def adopt_configs(tabled: Iterable[Run], runs: Iterable[Run], pool: Iterable[str] = ()) -> LoadResult:
    """``tabled`` runs (read from a ``runs.csv``: no config recorded) each given the config that
    the ``runs`` of its data, policy and step count share (less the ``pool`` keys), where they
    share exactly one; the others keep none (and are split from runs of known configs). Said."""
    pool = list(pool)
    known: dict[tuple[str, str, int | None], set[str]] = {}
    for r in runs:
        if r.config is not None:
            known.setdefault((r.data, r.policy, r.steps), set()).add(json.dumps(_without(r.config, pool),
                                                                                sort_keys=True, default=str))
    out, adopted, left = [], 0, []
    for r in tabled:
        configs = known.get((r.data, r.policy, r.steps), set())
        if r.config is None and len(configs) == 1:
            out.append(dataclasses.replace(r, config=json.loads(next(iter(configs)))))
            adopted += 1
        else:
            out.append(r)
            left.append(r.run_name)
    warns = [f"{adopted} run(s) read from a runs.csv were given the config of the run directories of their "
             "data, policy and steps (a table records none)"] if adopted else []
    if left:
        warns.append(f"{len(left)} run(s) read from a runs.csv matched no single config of the run directories "
                     f"(e.g. {left[0]}): compared by data, policy and steps only")
    return LoadResult(out, warns)


def _schema_default(dotted: str) -> Any:
    """The typed schema's default for a field a run's recorded config leaves out (an identity
    drops a block at its defaults: a full-policy run has no ``policy.lora``), so a label reads
    ``policy.lora.r=0``, not ``None``; ``(unset)`` for a key the schema does not know."""
    from datc.config import TrainConfig

    node: Any = TrainConfig()
    for part in dotted.split("."):
        if not dataclasses.is_dataclass(node) or part not in {f.name for f in dataclasses.fields(node)}:
            return "(unset)"
        node = getattr(node, part)
    return node


def split_by_config(runs: Iterable[Run], pool: Iterable[str] = ()) -> LoadResult:
    """``runs`` with a ``variant`` set wherever one ``(data, policy)`` holds runs of different
    configs, and one line per setting saying what was grouped (and per split, how). ``pool``:
    config keys (dotted, e.g. ``prepare_seed``) whose values may differ within a setting too."""
    pool = list(pool)
    runs = [dataclasses.replace(r, config=_without(r.config, pool)) if pool else r for r in runs]
    by_setting: dict[tuple[str, str], dict[str, list[Run]]] = {}
    for r in runs:
        by_setting.setdefault((r.data, r.policy), {}).setdefault(_key(r), []).append(r)
    out, warns = [], []
    unknown = [r for r in runs if r.config is None]
    if unknown:
        warns.append(f"{len(unknown)} run(s) without run.json beside their summary (e.g. {unknown[0].source}): "
                     "their configs are unknown, so they are compared by data, policy and steps only")
    for (data, policy), configs in sorted(by_setting.items()):
        if len(configs) == 1:
            group = next(iter(configs.values()))
            out += group
            continue
        flats = {k: _flat(json.loads(k)) for k in configs}
        keys = sorted({f for fl in flats.values() for f in fl})
        differing = [f for f in keys if len({json.dumps(fl.get(f), sort_keys=True, default=str) for fl in flats.values()}) > 1]
        labels = []
        for k, group in configs.items():
            shown = [f"{f}={flats[k][f] if f in flats[k] else _schema_default(f)}" for f in differing[:3]]
            shown += ["..."] if len(differing) > 3 else []
            variant = ", ".join(shown)
            labels.append(f"[{variant}] {len(group)} run(s)")
            out += [dataclasses.replace(r, variant=variant) for r in group]
        warns.append(f"{data} / {policy}: runs whose configs differ in more than the scheme and the seed "
                     f"(at {', '.join(differing[:6])}) are split into {len(configs)} settings: {'; '.join(labels)}")
    return LoadResult(out, warns)


def align_curves(runs: Iterable[Run]) -> LoadResult:
    """Where the runs of one setting were evaluated at different steps (another
    ``trainer.eval_every``), each run's gold curve cut to the steps all of them evaluated, and its
    gold AUC computed again over those, so paired AUCs and curve bands compare like with like;
    said once per setting. Runs without a curve (read from a ``runs.csv``) are left as they are."""
    runs = list(runs)
    steps: dict[str, list[frozenset[int]]] = {}
    for r in runs:
        if r.curve:
            steps.setdefault(r.setting, []).append(frozenset(p.step for p in r.curve))
    common = {s: frozenset.intersection(*sets) for s, sets in steps.items() if len(set(sets)) > 1}
    out = []
    for r in runs:
        if r.setting not in common or not r.curve:
            out.append(r)
            continue
        curve = tuple(p for p in r.curve if p.step in common[r.setting])
        out.append(dataclasses.replace(r, curve=curve, gold_auc=gold_auc([(p.step, p.gold) for p in curve])))
    warns = [f"{s}: runs evaluated at different steps (another trainer.eval_every): gold AUC and the curves are "
             f"taken over the {len(c)} step(s) all of them evaluated ({_steps(c)})" for s, c in sorted(common.items())]
    return LoadResult(out, warns)


def _steps(steps: frozenset[int]) -> str:
    shown = sorted(steps)
    return ", ".join(map(str, shown)) if len(shown) <= 6 else f"{', '.join(map(str, shown[:3]))}, ..., {shown[-1]}"


def grouped(runs: Iterable[Run]) -> str:
    """One line saying what is compared: per setting, the schemes and their seeds."""
    settings: dict[str, dict[str, list]] = {}
    for r in runs:
        settings.setdefault(r.setting, {}).setdefault(r.credit, []).append(r.seed)
    parts = []
    for setting, schemes in sorted(settings.items()):
        shown = ", ".join(f"{c} (seeds {', '.join(str(s) for s in sorted(x for x in seeds if x is not None)) or 'none'})"
                          for c, seeds in sorted(schemes.items()))
        parts.append(f"{setting}: {shown}")
    return "compared " + "; ".join(parts)
