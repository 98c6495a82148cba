"""Prompt data: testbed tasks generated to local JSONL files, real datasets by hub name or
local files; both loaded through ``datasets``."""

from __future__ import annotations

import codecs
import contextlib
import json
import logging
import os
import random
import sys
from pathlib import Path
from typing import Any

import datasets

from datc.atomic import atomic_dir
from datc.config import ConfigError
from datc.hashing import config_hash

GEN_SEED = 0  # the testbed's prompt sets are the same for every run seed (paired comparisons)


def testbed_data_dir(cache_dir: str, task: str, train_size: int, eval_size: int, norm_len: int) -> Path:
    from datc.tasks import TASKS

    key = config_hash({"task": task, "train": train_size, "eval": eval_size, "norm_len": norm_len, "seed": GEN_SEED, "v": 1})
    out = Path(cache_dir) / "data" / f"{task}-{key}"
    if (out / "eval.jsonl").exists():
        return out
    t = TASKS.get(task)(norm_len)
    rng = random.Random(GEN_SEED)
    with atomic_dir(out) as tmp:
        for split, n in (("train", train_size), ("eval", eval_size)):
            with open(tmp / f"{split}.jsonl", "w") as f:
                for _ in range(n):
                    f.write(json.dumps(t.make_split_example(rng, split)) + "\n")
    return out


def load_prompts(data_cfg, cache_dir: str) -> tuple[datasets.Dataset, datasets.Dataset]:
    """(train, eval) datasets of prompt rows. Testbed tasks are generated once and cached; a
    real dataset is ``data.path`` (a local directory or data file, or a hub dataset name)."""
    if data_cfg.task is not None and data_cfg.path is None:
        d = testbed_data_dir(cache_dir, data_cfg.task, data_cfg.train_size, data_cfg.eval_size, data_cfg.norm_len)
        files = {"train": str(d / "train.jsonl"), "eval": str(d / "eval.jsonl")}
        ds = datasets.load_dataset("json", data_files=files, cache_dir=str(Path(cache_dir) / "hf_datasets"))
        return ds["train"], ds["eval"]
    path = data_cfg.path
    hf_cache = str(Path(cache_dir) / "hf_datasets")  # a local file's Arrow cache: the project's, not ~/.cache
    if os.path.isfile(path):
        check_text_file(path)
    try:
        with _datasets_errors_kept():  # said once, in our line (and never into the run's train.log)
            if os.path.isfile(path):
                ext = "json" if path.endswith((".json", ".jsonl")) else Path(path).suffix.lstrip(".")
                ds = datasets.load_dataset(ext, data_files={data_cfg.train_split: path}, cache_dir=hf_cache)
            else:
                ds = datasets.load_dataset(path)  # a hub dataset: its usual cache (offline presets find it there)
    except Exception as e:  # datasets raises many types for "not found / offline / unreadable"
        cause = _root_cause(e)
        if isinstance(cause, UnicodeDecodeError):
            raise _not_utf8(path, cause) from None
        reason = f"{type(cause).__name__}: {str(cause).splitlines()[0]}" if str(cause) else type(cause).__name__
        if os.path.exists(path):
            raise ConfigError(f"data.path: {path!r} is not a readable dataset ({reason})") from None
        raise FileNotFoundError(
            f"data.path={path!r} could not be loaded ({reason}). "
            "Offline, point data.path at a local copy (a directory saved with datasets, or a .jsonl/.csv/.parquet file)."
        ) from None
    for split in (data_cfg.train_split, data_cfg.eval_split):
        if split not in ds:
            hint = ""
            if os.path.isfile(path):  # one file is one split, named data.train_split
                hint = (f"; a single file is one split: evaluate on it too with data.eval_split={data_cfg.train_split}, "
                        "or give a directory holding one file per split")
            raise ConfigError(f"data.train_split / data.eval_split: split {split!r} is not in {path!r}; "
                              f"splits: {list(ds)}{hint}")
    train, evald = ds[data_cfg.train_split], ds[data_cfg.eval_split]
    if data_cfg.prompt_field not in train.column_names:
        raise ConfigError(f"data.prompt_field: {data_cfg.prompt_field!r} is not a column of {path!r}; columns: {train.column_names}")
    try:
        return check_prompts(train, data_cfg.prompt_field, "train"), check_prompts(evald, data_cfg.prompt_field, "eval")
    except UnicodeDecodeError as e:  # read lazily by Arrow: the first access to the text
        raise _not_utf8(path, e, "of a value") from None


TEXT_SUFFIXES = (".json", ".jsonl", ".csv", ".tsv", ".txt")
_BOMS = ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"), (codecs.BOM_UTF16_LE, "utf-16"),
         (codecs.BOM_UTF16_BE, "utf-16"))


def check_text_file(path: str, head: int = 1 << 20) -> None:
    """A local text data file (JSON lines, CSV, ...) refused in one line before ``datasets``
    reads it when it holds no rows (empty or blank: ``datasets`` said only ``StopIteration``), or
    when its first ``head`` bytes are not UTF-8 (a UTF-16 file's byte-order mark included)."""
    if not path.endswith(TEXT_SUFFIXES):
        return
    with open(path, "rb") as f:
        data = f.read(head)
        more = bool(f.read(1))
    if not data.strip() and not more:
        raise ConfigError(f"data.path: {path!r} is empty: it holds no rows (a JSON lines file holds one JSON "
                          "object per line, e.g. {\"prompt\": \"...\"})")
    for bom, encoding in _BOMS:
        if data.startswith(bom):
            raise _not_utf8(path, UnicodeDecodeError("utf-8", data, 0, len(bom), f"a {encoding.upper()} byte-order mark"),
                            encoding=encoding)
    if b"\x00" in data[:4096]:  # valid UTF-8, but no text file holds NULs: UTF-16 without a byte-order mark
        at = data.index(b"\x00")
        raise _not_utf8(path, UnicodeDecodeError("utf-8", data, at, at + 1, "a NUL byte, as in UTF-16,"),
                        encoding="utf-16le" if at % 2 else "utf-16be")
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        if not (more and e.start >= len(data) - 3):  # not a character cut by the end of what was read
            raise _not_utf8(path, e) from None


def _not_utf8(path: str, e: UnicodeDecodeError, where: str = "", encoding: str = "latin1") -> ConfigError:
    """The one line for a data file that is not UTF-8, with the command that converts it."""
    return ConfigError(f"data.path: {path!r} is not UTF-8 text ({e.reason} at byte {e.start}{' ' + where if where else ''}: "
                       f"{e.object[max(0, e.start - 8):e.start + 8]!r}); convert it, e.g. "
                       f"iconv -f {encoding} -t utf-8 {path} > {Path(path).stem}.utf8{Path(path).suffix}")


def _root_cause(e: BaseException) -> BaseException:
    """What ``datasets``' generic ``DatasetGenerationError`` wraps: the first error below it that
    says something (Arrow's ``JSON parse error ... in row 0``), or a ``UnicodeDecodeError`` at any depth."""
    chain, seen = [], set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        chain.append(e)
        e = e.__cause__ or e.__context__
    for x in chain:
        if isinstance(x, UnicodeDecodeError):
            return x
    said = [x for x in chain if str(x) and type(x).__name__ != "DatasetGenerationError"]
    return said[0] if said else chain[0]


@contextlib.contextmanager
def _datasets_errors_kept():
    """``datasets``' own log lines (an ERROR line per unreadable file) held back for the block:
    the error it raises is said once, by the caller."""
    log = logging.getLogger("datasets")  # its modules' loggers take their level from it
    level = log.level
    log.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        log.setLevel(level)


def _prompt_problem(value: Any) -> str | None:
    """Why a prompt value cannot be used ("empty", or what it is instead of text or chat
    messages), or None."""
    if isinstance(value, str):
        return None if value.strip() else "empty"
    if isinstance(value, list) and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                       and isinstance(m.get("content"), str) for m in value):
        return None if any(m["content"].strip() for m in value) else "empty"
    if isinstance(value, list):
        return "a list that is not chat messages ({'role': ..., 'content': ...} dicts)"
    return f"a {type(value).__name__}, not text"


def check_prompts(ds: datasets.Dataset, field: str, split: str) -> datasets.Dataset:
    """Prompts must be text or chat messages: anything else is a one-line error naming the
    field and the first bad row; empty prompts are dropped with a warning (an error if every
    prompt is empty)."""
    if field not in ds.column_names:
        return ds  # said by the caller, with the columns
    problems = [(i, _prompt_problem(v)) for i, v in enumerate(ds[field])]
    wrong = [(i, p) for i, p in problems if p not in (None, "empty")]
    if wrong:
        i, why = wrong[0]
        raise ConfigError(f"data.prompt_field: {field!r} in the {split} split holds {why} (row {i}, {len(wrong)} such rows); "
                          "a prompt is a string or a list of chat messages")
    empty = [i for i, p in problems if p == "empty"]
    if empty and len(empty) == len(ds):
        raise ConfigError(f"data.prompt_field: every {split} prompt in {field!r} is empty")
    if empty:
        print(f"datc: warning: data.prompt_field: dropped {len(empty)} of {len(ds)} {split} prompts that are empty "
              f"(first: row {empty[0]})", file=sys.stderr, flush=True)
        drop = set(empty)
        ds = ds.select([i for i in range(len(ds)) if i not in drop])
    return ds


def rows(ds: datasets.Dataset, indices) -> list[dict[str, Any]]:
    return [ds[int(i)] for i in indices]
