"""Fingerprints of the files a run loads (policy, reward model, tokenizer, prompt data), so a
resume can tell when one was replaced under its feet.

A run records them in ``<run_dir>/inputs.json`` when it starts; a resume compares and refuses,
naming the file, when one changed (``trainer.accept_changed_inputs=true`` resumes anyway and
records the new ones). What is recorded per file, and why:

- size and modification time (``mtime_ns``): free;
- a SHA-256 of the whole file up to ``WHOLE_HASH_BYTES`` (64 MiB: configs, tokenizers, prompt
  files, the testbed's models; well under a second), of its first and last ``EDGE_BYTES``
  (4 MiB each) above that: a real model's multi-GB weights are not re-read at every resume.

A file is *changed* when its size or hash differs. A wholly hashed file whose hash is the same
is unchanged even if its time moved (a copy, a rebuilt cache entry); an edge-hashed one whose
time moved is counted as changed, since its middle was not read. Files and directories are
compared by name within each input, not by absolute path, so a cache reached by another path
(or moved) still matches. Hub ids are not fingerprinted (a hub revision's files do not change);
neither are the records a cache entry keeps of how it was made (``NOT_READ``).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

WHOLE_HASH_BYTES = 64 * 2**20
EDGE_BYTES = 4 * 2**20
NOT_READ = {"warm_start.json", "rm_report.json", "source.json"}  # how a cache entry was made, with its timing
VERSION = 1


def sha256_file(path: str | Path) -> str:
    """The SHA-256 of the whole file, however large (about a second for 540 MB)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(2**20), b""):
            h.update(block)
    return h.hexdigest()


def file_fingerprint(path: str | Path) -> dict[str, Any]:
    """``{"size", "mtime_ns", "sha256", "hashed": "whole" | "edges"}`` of one file."""
    st = os.stat(path)
    if st.st_size <= WHOLE_HASH_BYTES:
        return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256_file(path), "hashed": "whole"}
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(EDGE_BYTES))
        f.seek(st.st_size - EDGE_BYTES)
        h.update(f.read(EDGE_BYTES))
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": h.hexdigest(), "hashed": "edges"}


def path_fingerprint(path: str | Path) -> dict[str, dict[str, Any]]:
    """Fingerprints of a file (keyed by its name) or of every file below a directory (keyed by
    its path relative to it; hidden entries, e.g. a download tool's ``.cache/``, skipped)."""
    path = Path(path)
    if path.is_file():
        return {path.name: file_fingerprint(path)}
    out = {}
    for root, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            if name.startswith(".") or name in NOT_READ:
                continue
            full = Path(root) / name
            out[str(full.relative_to(path))] = file_fingerprint(full)
    return out


def fingerprints(inputs: dict[str, str | None]) -> dict[str, Any]:
    """``{label: {"path", "files"}}`` for each input that is a local file or directory (hub ids
    and unset inputs are left out). ``inputs``: label (``policy``, ``reward``, ``tokenizer``,
    ``data``) -> the path the run loads it from."""
    out = {}
    for label, path in inputs.items():
        if path is not None and os.path.exists(path):
            out[label] = {"path": str(path), "files": path_fingerprint(path)}
    return {"version": VERSION, "inputs": out}


def file_hashes(inputs: dict[str, Any]) -> dict[str, str]:
    """``{"reward/model.safetensors": sha256, ...}`` of :func:`fingerprints`' ``inputs`` (as a
    run's ``inputs.json`` holds them; entries of another shape are left out)."""
    return {f"{kind}/{name}": meta["sha256"] for kind, v in inputs.items() if isinstance(v, dict)
            for name, meta in (v.get("files") or {}).items() if isinstance(meta, dict) and "sha256" in meta}


def changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What changed between two :func:`fingerprints`, one phrase per file (empty: nothing)."""
    out = []
    was, now = old.get("inputs", {}), new.get("inputs", {})
    for label in sorted(set(was) | set(now)):
        if label not in now:
            out.append(f"{label} ({was[label]['path']}) is no longer a local file")
            continue
        if label not in was:
            out.append(f"{label} ({now[label]['path']}) was not a local file when the run started")
            continue
        a, b = was[label]["files"], now[label]["files"]
        base = Path(now[label]["path"])
        for name in sorted(set(a) | set(b)):
            shown = base if base.is_file() else base / name
            if name not in b:
                out.append(f"{label}: {shown} was removed")
            elif name not in a:
                out.append(f"{label}: {shown} is new")
            elif (why := _file_change(a[name], b[name])) is not None:
                out.append(f"{label}: {shown} {why}")
    return out


def _file_change(a: dict[str, Any], b: dict[str, Any]) -> str | None:
    if a["size"] != b["size"]:
        return f"changed size ({a['size']} -> {b['size']} bytes)"
    if a["sha256"] != b["sha256"]:
        return "changed content (same size, another hash)"
    if b["hashed"] == "edges" and a["mtime_ns"] != b["mtime_ns"]:
        return "was modified (its time changed; only its first and last 4 MiB are hashed)"
    return None
