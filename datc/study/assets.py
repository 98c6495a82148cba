"""Before a study starts a run: the files this machine prepares for the setting are the files the
study's finished runs trained on. A study folder moves between machines (``python -m
scripts.results.land_study --restore``), and a prepare that computes other bits there (another
machine kind, torch or MKL version: docs/real-models.md) makes another reward model: every run
started on it would be another study's, refused by the tables only after hours of compute. So the
driver prepares (or finds in the cache) the assets of each draw (``prepare_seed``) its finished runs
used, as a run does, and compares their hashes with those runs' ``inputs.json``: a difference is
refused (exit 2) before any run starts, with the files named. So is a cache folder other than the
one the finished runs' names were made with, where their identity holds a path inside it (the real
preset's ``policy.path``): every run would be named anew and run again."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from datc.run.fingerprint import file_hashes, fingerprints
from datc.study.launch import state
from datc.study.matched import MATCHED_DIR
from datc.study.protocol import Refused
from datc.study.reading import EVAL_DIR, SELECT_DIR

RUN_DIRS = (SELECT_DIR, EVAL_DIR, MATCHED_DIR)


def finished_assets(folder: Path) -> dict[int, tuple[str, dict[str, str]]]:
    """Per draw, the first finished (or diverged) run that recorded its inputs: (its name, its files'
    hashes). Runs without a readable ``run.json`` or ``inputs.json`` are passed over."""
    out: dict[int, tuple[str, dict[str, str]]] = {}
    for d in RUN_DIRS:
        for run in sorted((folder / d).glob("*/")):
            if state(run) == "todo":  # neither finished nor diverged
                continue
            try:
                draw = int(json.loads((run / "run.json").read_text())["identity"]["prepare_seed"])
                hashes = file_hashes(json.loads((run / "inputs.json").read_text())["inputs"])
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                continue
            if hashes and draw not in out:
                out[draw] = (f"{d}/{run.name}", hashes)
    return out


def cache_in_names(folder: Path) -> tuple[str, str, str] | None:
    """The first finished run whose identity (so its name) holds a path inside its own cache folder:
    (its name, that folder, the field), or None."""
    from omegaconf import OmegaConf

    for d in RUN_DIRS:
        for run in sorted((folder / d).glob("*/")):
            if state(run) == "todo":
                continue
            try:
                ident = json.loads((run / "run.json").read_text())["identity"]
                cache = str(OmegaConf.load(run / "config.yaml").get("cache_dir") or "")
            except Exception:  # no readable record: passed over
                continue
            if cache and (field := _path_inside(ident, cache.rstrip("/") + "/")):
                return f"{d}/{run.name}", cache, field
    return None


def _path_inside(x: Any, prefix: str, at: str = "") -> str | None:
    if isinstance(x, dict):
        return next((f for k, v in x.items() if (f := _path_inside(v, prefix, f"{at}{k}."))), None)
    return at.rstrip(".") if isinstance(x, str) and x.startswith(prefix) else None


def prepared_assets(cfg: Any) -> dict[str, str]:
    """The hashes of the files a run of ``cfg`` loads, prepared here (or found in the cache), as the
    run records them."""
    from datc.prepare.assets import ensure_assets
    from datc.training.lifecycle import input_paths

    return file_hashes(fingerprints(input_paths(ensure_assets(cfg)))["inputs"])


def check_assets(folder: Path, compose: Callable[[int], Any], prepare: Callable[[Any], dict[str, str]] | None = None,
                 say: Callable[[str], None] = print) -> None:
    """Refuses (:class:`Refused`) a study whose finished runs trained on other files than this machine
    prepares for them. ``compose(draw)``: the validated config of a run of that draw; ``prepare``:
    :func:`prepared_assets` unless given."""
    prepare = prepare or prepared_assets
    held = cache_in_names(folder)
    for draw, (name, landed) in sorted(finished_assets(folder).items()):
        cfg = compose(draw)
        here = getattr(cfg, "cache_dir", None)
        if held and here and Path(str(here)).absolute() != Path(held[1]).absolute():
            raise Refused(
                f"{folder}: the finished runs' names hold a path inside their cache folder {held[1]} ({held[2]} in "
                f"{held[0]}'s identity) and this study's cache folder is {here}: every run would be named anew and "
                f"run again. Set DATC_CACHE={held[1]} (or pass cache_dir={held[1]}) to continue this study, or start "
                "another root")
        mine = prepare(cfg)
        differ = sorted(k for k in landed.keys() & mine.keys() if landed[k] != mine[k])
        if differ:
            raise Refused(
                f"{folder}: this machine prepares other files than the study's finished runs trained on (draw {draw}, "
                f"e.g. {name}): {', '.join(f'{k} {mine[k][:12]} != {landed[k][:12]}' for k in differ[:3])}; runs "
                "started here would be another study's. Prepare the same files (results/real_model/prepared.json, "
                "python -m scripts.dev.prepared_hashes), or start another root")
        say(f"draw {draw}: the prepared files are the ones the finished runs trained on "
            f"({len(landed.keys() & mine.keys())} compared)")
