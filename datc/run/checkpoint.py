"""Atomic checkpoints: a checkpoint directory appears complete or not at all.

Each checkpoint is ``<run_dir>/checkpoints/step_XXXXXXX/state.pt`` holding the policy,
optimizer, scheduler, every RNG state and the step. It is written into a temporary sibling
and renamed into place, so a run killed mid-write leaves only a ``.tmp`` directory that is
never loaded. A complete checkpoint whose file was later damaged (a truncated or empty
``state.pt``) is set aside on resume, and the newest one that loads is used.
"""

from __future__ import annotations

import errno
import io
import os
import re
import shutil
import sys
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from datc.atomic import atomic_dir, atomic_write_bytes
from datc.config import ConfigError
from datc.errors import full_disk

_NAME = re.compile(r"^step_(\d{7})$")


def checkpoint_dirs(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _NAME.match(p.name) and (p / "state.pt").exists()]
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    dirs = checkpoint_dirs(run_dir)
    return dirs[-1] if dirs else None


def save_checkpoint(run_dir: str | Path, step: int, state: dict[str, Any], keep: int) -> Path:
    root = Path(run_dir) / "checkpoints"
    # Leftovers of a run killed while writing (.tmp), while replacing or pruning (.old), and an
    # empty step folder (a prune killed by an older version mid-removal): none holds a checkpoint.
    for stale in [*root.glob(".step_*.tmp"), *root.glob(".step_*.old")]:
        shutil.rmtree(stale, ignore_errors=True)
    for empty in root.glob("step_*") if root.is_dir() else ():
        if empty.is_dir() and not any(empty.iterdir()):
            empty.rmdir()
    path = root / f"step_{step:07d}"
    # A damaged checkpoint of this step, set aside or not, is replaced (one writer): ours swaps in whole.
    with atomic_dir(path, exist="replace") as tmp:
        _save({**state, "step": step}, tmp / "state.pt")
    for old in checkpoint_dirs(run_dir)[:-keep]:
        # Renamed aside first, so a kill during the removal leaves a .old folder (removed at the next
        # save), never a step folder that looks like a checkpoint and is not one.
        aside = old.with_name(f".{old.name}.pruned.old")
        try:
            os.rename(old, aside)
        except OSError:
            continue
        shutil.rmtree(aside, ignore_errors=True)
    return path


def _save(obj: Any, file: Any) -> None:
    """``torch.save`` with a full disk said as such: torch reports a short write as
    ``[enforce fail at inline_container.cc] unexpected pos`` or ``file write failed``."""
    try:
        torch.save(obj, file)
    except RuntimeError as e:
        text = str(e)
        if "unexpected pos" in text or "write failed" in text or "No space left" in text:
            first = text.strip().splitlines()[0] if text.strip() else type(e).__name__
            raise OSError(errno.ENOSPC, f"No space left on device (or quota exceeded) while writing a checkpoint "
                                        f"(torch: {first})", str(file)) from None
        raise


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    # Our own file with RNG states (numpy arrays, tuples): not a weights-only pickle.
    return torch.load(Path(path) / "state.pt", map_location="cpu", weights_only=False)


def set_aside(path: Path, why: str) -> Path:
    """Rename the damaged checkpoint ``path`` to ``<name>.damaged`` (never loaded again, kept to look
    at; an earlier one of that name replaced) and say ``why`` in one line; returns the new path."""
    aside = path.with_name(path.name + ".damaged")
    try:
        if aside.exists():
            shutil.rmtree(aside)
        os.replace(path, aside)
    except OSError:
        pass  # another rank set it aside first
    print(f"datc: warning: checkpoint {path.name} skipped: {why}; set aside as {aside.name}, trying the one before",
          file=sys.stderr, flush=True)
    return aside


def latest_loadable_checkpoint(run_dir: str | Path) -> tuple[Path | None, dict[str, Any] | None]:
    """The newest checkpoint whose ``state.pt`` loads, and that state. A damaged one (truncated,
    empty, unreadable) is renamed ``step_XXXXXXX.damaged`` (never loaded again, kept to look
    at) with one line on stderr saying which and why, and the one before is tried."""
    for path in reversed(checkpoint_dirs(run_dir)):
        try:
            return path, load_checkpoint(path)
        except Exception as e:  # noqa: BLE001  torch raises RuntimeError, EOFError, UnpicklingError, ...
            first = (str(e).strip().splitlines() or [""])[0][:160]
            set_aside(path, f"its state.pt does not load ({type(e).__name__}: {first})")
    return None, None


# ---- sharded checkpoints (DeepSpeed, FSDP2) ------------------------------------------------------
#
# Under a backend that shards the policy the same directory holds its own shards (every rank
# writes its part of the parameters and optimizer state: DeepSpeed's files, or FSDP2's
# ``torch.distributed.checkpoint`` folder), one ``rank_XXXXX.pt`` per rank (its RNG state: every
# rank samples its own responses), and ``state.pt`` (step, elapsed time, the backend's name)
# written last by rank 0. A directory without ``state.pt`` is incomplete and never loaded, as above.

KINDS = {"deepspeed": "DeepSpeed", "fsdp2": "FSDP2"}


def _rank_file(path: Path, rank: int) -> Path:
    return path / f"rank_{rank:05d}.pt"


def save_sharded_checkpoint(run_dir: str | Path, step: int, write: Callable[[Path], None], state: dict[str, Any],
                            rank_state: dict[str, Any], rank: int, world_size: int, gather: Callable[[Any], list[Any]],
                            keep: int, kind: str) -> Path:
    """Every rank calls this at the same step; ``write(path)`` writes this rank's shards into the
    step's directory. Returns the checkpoint directory. ``gather``: every rank's object on every
    rank (:meth:`datc.backends.distributed.Dist.gather`), also the barrier between the parts: a
    part that fails on any rank (a full disk) fails on every rank with the same error, and the
    half-written directory is removed."""
    root = Path(run_dir) / "checkpoints"
    path = root / f"step_{step:07d}"
    if rank == 0 and path.exists():  # an incomplete write of a killed run at this very step
        shutil.rmtree(path)
    gather(None)

    def shards() -> None:
        write(path)
        buf = io.BytesIO()
        torch.save(rank_state, buf)
        atomic_write_bytes(_rank_file(path, rank), buf.getvalue())

    def last() -> None:
        if rank != 0:
            return
        buf = io.BytesIO()
        _save({**state, "step": step, "world_size": world_size, kind: True}, buf)
        atomic_write_bytes(path / "state.pt", buf.getvalue())
        for old in checkpoint_dirs(run_dir)[:-keep]:
            aside = old.with_name(f".{old.name}.pruned.old")  # as save_checkpoint: never a half-removed step folder
            try:
                os.rename(old, aside)
            except OSError:
                continue
            shutil.rmtree(aside, ignore_errors=True)

    for part in (shards, last):
        _together(part, path, rank, gather)
    return path


def _together(part: Callable[[], None], path: Path, rank: int, gather: Callable[[Any], list[Any]]) -> None:
    """Run ``part`` on every rank, then agree: if it failed on any rank, rank 0 removes ``path``
    (half-written) and every rank raises; a full disk as ``OSError(ENOSPC)`` (one line at the
    top: :func:`datc.training.job.train_job`), anything else as the failing rank's error."""
    mine: BaseException | None = None
    try:
        part()
    except BaseException as e:  # noqa: BLE001  DCP raises CheckpointException, a BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        mine = e
    said = None if mine is None else (full_disk(mine), f"{type(mine).__name__}: {(str(mine).strip().splitlines() or [''])[0][:160]}")
    outcomes = gather(said)
    failed = [(r, o) for r, o in enumerate(outcomes) if o is not None]
    if not failed:
        return
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    r, (disk, text) = failed[0]
    if any(o[0] for _, o in failed):
        raise OSError(errno.ENOSPC, f"No space left on device (or quota exceeded) while writing a checkpoint "
                                    f"(rank {r}: {text}); its half-written directory was removed", str(path)) from None
    if mine is not None:
        raise mine
    raise RuntimeError(f"rank {r} failed writing the checkpoint {path} ({text})")


def load_sharded_checkpoint(path: str | Path, rank: int, world_size: int, kind: str) -> dict[str, Any]:
    """``state.pt`` of a sharded checkpoint written by backend ``kind`` with this rank's ``rng``;
    refused, in one line, for another backend or another number of processes."""
    path = Path(path)
    state = load_checkpoint(path)
    if not state.get(kind):
        other = next((KINDS[k] for k in KINDS if state.get(k)), "the plain backend")
        raise ConfigError(f"backend: {path} was written by {other}; resume it with the backend that wrote it")
    if state["world_size"] != world_size:
        raise ConfigError(f"backend: {path} was written by {state['world_size']} processes, this run has "
                          f"{world_size}; resume with the same number of processes")
    rank_state = torch.load(_rank_file(path, rank), map_location="cpu", weights_only=False)
    return {**state, **rank_state}


def save_engine_checkpoint(run_dir: str | Path, step: int, engine, state: dict[str, Any], rank_state: dict[str, Any],
                           rank: int, world_size: int, gather: Callable[[Any], list[Any]], keep: int) -> Path:
    """A DeepSpeed engine's checkpoint (:func:`save_sharded_checkpoint`)."""
    def write(path: Path) -> None:
        # frozen parameters (a LoRA policy's base) are not the run's to save: the base is reloaded
        with _frozen_ties_excluded(engine):
            engine.save_checkpoint(str(path.parent), tag=path.name, save_latest=False, exclude_frozen_parameters=True)

    return save_sharded_checkpoint(run_dir, step, write, state, rank_state, rank, world_size, gather, keep, "deepspeed")


@contextmanager
def _frozen_ties_excluded(engine):
    """DeepSpeed leaves frozen parameters out of its module state by ``named_parameters()``,
    which names a tied weight once: a frozen tied LM head (V, d) would still be written. Its
    other names are left out as well while the checkpoint is written."""
    names = {n for n, p in engine.module.named_parameters(remove_duplicate=False) if not p.requires_grad}
    if not names:
        yield
        return
    own = engine.module_state_dict

    def module_state_dict(*args, **kwargs):
        sd = own(*args, **kwargs)
        if kwargs.get("exclude_frozen_parameters"):
            for n in names & set(sd):
                del sd[n]
        return sd

    engine.module_state_dict = module_state_dict
    try:
        yield
    finally:
        del engine.module_state_dict  # the class's method again


def load_engine_checkpoint(path: str | Path, engine, rank: int, world_size: int) -> dict[str, Any]:
    """Restore the engine (parameters, optimizer, LR schedule) and this rank's state; returns
    ``state.pt`` with this rank's ``rng``."""
    path = Path(path)
    state = load_sharded_checkpoint(path, rank, world_size, "deepspeed")
    frozen = any(not p.requires_grad for p in engine.module.parameters())
    load_path, _ = engine.load_checkpoint(str(path.parent), tag=path.name, load_optimizer_states=True,
                                          load_lr_scheduler_states=True, load_module_strict=not frozen)
    if load_path is None:
        raise ConfigError(f"backend: DeepSpeed could not load the checkpoint in {path}")
    return state
