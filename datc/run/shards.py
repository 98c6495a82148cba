"""A sharded checkpoint (DeepSpeed's, FSDP2's: :mod:`datc.run.checkpoint`) checked before its
collective load: every file a rank would read opens whole, so a damaged one (a rank's
``rank_XXXXX.pt``, a DeepSpeed shard, DCP's ``.metadata`` or one of its ``.distcp`` files,
truncated, emptied or missing) sets the checkpoint aside as ``step_XXXXXXX.damaged`` on every
rank at once, and the one before is tried, as a single process does
(:func:`datc.run.checkpoint.latest_loadable_checkpoint`). The check reads each zip file's
directory at its end and DCP's metadata (what a truncation cuts), not the tensors."""

from __future__ import annotations

import pickle
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from datc.run.checkpoint import KINDS, checkpoint_dirs, load_checkpoint, set_aside

DCP_DIR = "dcp"  # FSDP2's torch.distributed.checkpoint folder in a checkpoint (datc.backends.fsdp2)


def _first(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:160]}"


def _zip_problem(file: Path, name: str) -> str | None:
    try:
        with zipfile.ZipFile(file) as z:
            size = file.stat().st_size
            if any(i.header_offset + i.compress_size > size for i in z.infolist()):
                return f"{name} is cut short"
    except FileNotFoundError:
        return f"{name} is missing"
    except (zipfile.BadZipFile, OSError, ValueError) as e:
        return f"{name} does not load ({_first(e)})"
    return None


def _dcp_problem(dcp: Path, rel: Callable[[Path], str]) -> str | None:
    """DCP's ``.metadata`` unpickles and every storage item it names lies within its file."""
    try:
        with open(dcp / ".metadata", "rb") as f:
            md = pickle.load(f)
        items = list(md.storage_data.values())
    except FileNotFoundError:
        return f"{rel(dcp / '.metadata')} is missing"
    except Exception as e:  # noqa: BLE001  a truncated pickle: EOFError, UnpicklingError, ...
        return f"{rel(dcp / '.metadata')} does not load ({_first(e)})"
    sizes: dict[str, int] = {}
    for it in items:
        if it.relative_path not in sizes:
            try:
                sizes[it.relative_path] = (dcp / it.relative_path).stat().st_size
            except OSError:
                return f"{rel(dcp / it.relative_path)} is missing"
        if it.offset + it.length > sizes[it.relative_path]:
            return f"{rel(dcp / it.relative_path)} is cut short"
    return None


def shard_problem(path: Path, state: dict[str, Any], rank: int, world_size: int) -> str | None:
    """What is wrong with rank ``rank``'s share of the files of checkpoint ``path`` (its
    ``state.pt`` already loaded: ``state``), or None. A checkpoint of another backend or another
    number of processes is not checked here: its load refuses it in one line."""
    kind = next((k for k in KINDS if state.get(k)), None)
    if kind is None or state.get("world_size") != world_size:
        return None
    def rel(f: Path) -> str:
        return str(f.relative_to(path))

    checks: list[Callable[[], str | None]] = [
        (lambda f=path / f"rank_{r:05d}.pt": _zip_problem(f, rel(f))) for r in range(world_size)]
    shards = sorted(f for f in path.rglob("*.pt") if f.parent != path or not f.name.startswith(("rank_", "state.pt")))
    checks += [(lambda f=f: _zip_problem(f, rel(f))) for f in shards]
    if kind == "deepspeed":
        checks += [(lambda r=r: None if any(path.glob(f"*zero_pp_rank_{r}_*optim_states.pt")) else
                    f"rank {r}'s DeepSpeed optimizer shard is missing") for r in range(world_size)]
    if kind == "fsdp2":
        checks.append(lambda: _dcp_problem(path / DCP_DIR, rel) if (path / DCP_DIR).is_dir() else f"{DCP_DIR}/ is missing")
    for check in checks[rank::world_size]:
        if (problem := check()) is not None:
            return problem
    return None


def latest_loadable_sharded_checkpoint(run_dir: str | Path, rank: int, world_size: int,
                                       gather: Callable[[Any], list[Any]]) -> tuple[Path | None, dict[str, Any] | None]:
    """Every rank calls this: the newest checkpoint whose files all open (each rank checks its
    share, :func:`shard_problem`) and its ``state.pt``. A damaged one is renamed
    ``step_XXXXXXX.damaged`` by rank 0 with one line on stderr naming the file and why, and the
    one before is tried; every rank agrees on each verdict (``gather``: every rank's object)."""
    names = gather([p.name for p in checkpoint_dirs(run_dir)] if rank == 0 else None)[0]
    root = Path(run_dir) / "checkpoints"
    for name in reversed(names):
        path, state, problem = root / name, None, None
        try:
            state = load_checkpoint(path)
        except Exception as e:  # noqa: BLE001  torch raises RuntimeError, EOFError, UnpicklingError, ...
            problem = f"its state.pt does not load ({_first(e)})"
        if problem is None:
            try:
                problem = shard_problem(path, state, rank, world_size)
            except OSError as e:
                problem = f"it cannot be read ({_first(e)})"
        said = gather(problem)
        bad = next((p for p in said if p is not None), None)
        if bad is None:
            return path, state
        if rank == 0:
            set_aside(path, bad)
        gather(None)  # the rename done before any rank goes on
    return None, None
