"""The step-0 evaluation's cache (``trainer.eval_cache``): runs that start from the same weights
and evaluate the same prompts the same way get the same step-0 evaluation, whatever they train
with afterwards (the scheme, the learning rate, the training seed). A study's runs are such runs:
on the real model every one of its runs had the identical step-0 gold, reward-model score and
entropy, about 60 s of an 11-minute run. With a cache folder set, the first of them evaluates and
stores its metrics and samples; the next ones read them and log the same numbers.

The key is what the evaluation reads, so a run that could evaluate differently misses instead of
reading another's numbers: the weights as loaded (policy, reference and reward model, hashed from
memory, whatever the seed did to them), the evaluation's prompts, the run's recorded input files
(tokenizers, chat templates, data), its whole resolved config less the fields that only training
reads (:data:`TRAINING_ONLY`), the package's own sources (:func:`code_hash`), and the versions,
processor and GPU model the numbers are computed with. A run that read the cache says so in
``<run_dir>/eval_cache.json`` (removed when a run evaluates step 0 itself). Single-process runs only (the
weights of a sharded run are not whole on one rank to hash)."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from datc.atomic import atomic_write_json
from datc.hashing import config_hash
from datc.run.provenance import machine, processor

log = logging.getLogger(__name__)

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # datc/: its sources are part of the key
PACKAGES = ("transformers", "tokenizers", "safetensors", "peft", "numpy", "afinn")  # besides Python and torch
RECORD = "eval_cache.json"  # in a run directory whose step-0 evaluation was read from the cache
VERSION = 2  # of the key's recipe: a change to it makes every old entry a miss

# Fields of the resolved config that only training reads (the step-0 evaluation is before any of
# them acts): left out of the key so that a study's schemes, rates and seeds share one entry.
# Anything not named here is in the key: a field forgotten here costs a miss, never a wrong number.
TRAINING_ONLY = {
    None: {"seed", "credit", "run_name", "run_dir", "results_dir", "cache_dir"},
    "trainer": {"steps", "lr", "weight_decay", "adam_betas", "lr_scheduler", "warmup_steps", "max_grad_norm",
                "scale_rewards", "epsilon_low", "epsilon_high", "loss_agg", "eval_every", "checkpoint_every",
                "keep_checkpoints", "resume", "accept_changed_inputs", "progress", "max_nonfinite_frac",
                "eval_cache"},
    # how the run is reported; logger.log_samples stays (the samples are part of the entry)
    "logger": {"name", "project", "entity", "group", "tags", "mode", "init_timeout_s"},
}


def weights_hash(module: Any) -> str:
    """sha256 over a module's state (names, dtypes, shapes and bytes, in the state dict's order);
    for something that is not a module (a reference that is the policy with its adapters off),
    its type's name."""
    if not hasattr(module, "state_dict"):
        return f"not a module: {type(module).__name__}"
    h = hashlib.sha256()
    for name, t in module.state_dict().items():
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b"")  # its buffer, not a copy
    return h.hexdigest()


def _inputs(recorded: dict[str, Any] | None) -> Any:
    """The run's recorded input files (``inputs.json``) by content: paths and times left out."""
    if not isinstance(recorded, dict):
        return None
    out = {}
    for what, entry in (recorded.get("inputs") or {}).items():
        files = (entry or {}).get("files") if isinstance(entry, dict) else None
        out[what] = {f: {k: v for k, v in info.items() if k in ("sha256", "size", "hashed")}
                     for f, info in (files or {}).items()}
    return out


def key_parts(config: dict[str, Any], models: Any, rows: list[dict], inputs: dict[str, Any] | None,
              device: torch.device) -> dict[str, Any]:
    """What the step-0 evaluation reads, as plain data (hashed by :func:`key`)."""
    cfg = {k: v for k, v in config.items() if k not in TRAINING_ONLY[None]}
    for section, fields in TRAINING_ONLY.items():
        if section is not None and isinstance(cfg.get(section), dict):
            cfg[section] = {k: v for k, v in cfg[section].items() if k not in fields}
    return {
        "recipe": VERSION,
        "config": cfg,
        "weights": {"policy": weights_hash(models.policy),
                    "ref": None if models.ref is None else weights_hash(models.ref),
                    "reward": weights_hash(models.rm)},
        "tokenizer": tokenizer_hash(models.tok),
        "prompts": config_hash(rows, 64),
        "inputs": _inputs(inputs),
        "code": code_hash(),
        "machine": {**machine(*PACKAGES), "processor": processor()["cpu_model"], "device": str(device),
                    "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                    "torch_threads": torch.get_num_threads()},
    }


def tokenizer_hash(tok: Any) -> str:
    """sha256 over a tokenizer's vocabulary, special tokens and chat template (a tokenizer loaded by
    a hub id has no recorded files to fingerprint)."""
    parts = {"vocab": sorted(tok.get_vocab().items()) if hasattr(tok, "get_vocab") else None,
             "special": getattr(tok, "special_tokens_map", None), "template": getattr(tok, "chat_template", None),
             "type": type(tok).__name__}
    return config_hash(parts, 64)


def code_hash() -> str:
    """sha256 over the package's own Python sources (paths and bytes): a change to any of them (the
    evaluation, a task's gold, the sampler, the reward model's inputs) makes every entry a miss."""
    h = hashlib.sha256()
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        h.update(path.relative_to(PACKAGE_DIR).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def key(parts: dict[str, Any]) -> str:
    return config_hash(parts, 64)


def entry_path(folder: str | Path, k: str) -> Path:
    return Path(folder) / f"step0-{k[:24]}.json"


def read(folder: str | Path, k: str) -> dict[str, Any] | None:
    """The entry stored under ``k``, or None (none there, or unreadable: the run evaluates)."""
    path = entry_path(folder, k)
    try:
        entry = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:  # a damaged entry: evaluate and write it again
        log.warning("trainer.eval_cache: %s unreadable (%s): evaluating", path, e)
        return None
    if not isinstance(entry, dict) or entry.get("key") != k or not isinstance(entry.get("metrics"), list) \
            or not isinstance(entry.get("samples"), list):
        log.warning("trainer.eval_cache: %s is not an entry of this key: evaluating", path)
        return None
    return entry


def evaluate_cached(folder: str | Path, parts: dict[str, Any], run_dir: Path, made_by: str,
                    evaluate: Callable[[], tuple[dict[str, float], list[dict]]]) -> tuple[dict[str, float], list[dict]]:
    """The step-0 evaluation: read from ``folder`` where an entry has this key (recorded in the run
    directory's ``eval_cache.json``), else ``evaluate()`` and stored there."""
    k = key(parts)
    if (entry := read(folder, k)) is not None:
        path = entry_path(folder, k)
        atomic_write_json(Path(run_dir) / RECORD, {"step": 0, "entry": path.name, "key": k, "made_by": entry.get("made_by")})
        log.info("step-0 evaluation read from %s (evaluated by %s)", path, entry.get("made_by"))
        return {name: value for name, value in entry["metrics"]}, entry["samples"]  # in the order they were logged
    metrics, samples = evaluate()
    try:
        write(folder, k, parts, metrics, samples, made_by)
    except OSError as e:  # the cache only saves time: the run goes on with its own evaluation
        log.warning("trainer.eval_cache: the step-0 evaluation could not be stored in %s (%s); the run goes on",
                    folder, e)
    return metrics, samples


def write(folder: str | Path, k: str, parts: dict[str, Any], metrics: dict[str, float], samples: list[dict],
          made_by: str) -> Path:
    """Store an evaluation under ``k`` (atomically: two runs that write the same entry at once
    leave one whole file)."""
    path = entry_path(folder, k)
    # the metrics as [name, value] pairs: a hit logs them in the order the evaluation gave them
    atomic_write_json(path, {"key": k, "made_by": made_by, "metrics": [[n, v] for n, v in metrics.items()],
                             "samples": samples, "parts": parts})
    return path
