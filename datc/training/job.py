"""One ``datc-train`` job as a function: validate, train, and every failure as one line with its exit
status (:class:`JobRefused`). ``datc-train`` (:mod:`datc.train`) prints that line and exits with it;
``datc-study``'s task function (:mod:`datc.study.job`) runs the same function under Hydra's
launchers, where a ``sys.exit`` would end the launcher's whole batch (its ``run_job`` catches
only ``Exception``)."""

from __future__ import annotations

import difflib
import errno
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from datc.checks import validate
from datc.config import MOVED_KEYS, ConfigError, valid_keys
from datc.paths import CONFIG_DIR
from datc.run.runlock import remove_new_dirs


class JobRefused(Exception):
    """A job that ended with one line to print and an exit status (2: refused or diverged, 1: the
    engine or another rank failed mid-run, 130/143: interrupted); the original error is its
    ``__cause__``. Picklable (its two arguments), so a launcher's worker can send it back."""

    def __init__(self, line: str, code: int = 2) -> None:
        super().__init__(line, code)
        self.line, self.code = line, code

    def __str__(self) -> str:
        return self.line


def train_job(cfg: Any, run_dir: str, note: Callable[[], str | None] | None = None) -> dict[str, Any]:
    """``datc-train``'s job: the config checked (before the heavy imports: a bad value is said in
    about a second), ``note()``'s warning if any, then the run; returns its summary. A refused
    command leaves no directory behind."""
    try:
        validate(cfg)
    except ConfigError as e:
        remove_new_dirs(run_dir)
        raise JobRefused(f"datc-train: {e}", 2) from e
    from datc.engines.base import EngineError
    from datc.math.numerics import NonFiniteError
    from datc.models.build import ModelLoadError
    from datc.run.signals import Interrupted
    from datc.training.trainer import train

    if note is not None and (line := note()) is not None:
        from datc.errors import warn

        warn(line)
    try:
        return train(cfg, run_dir=run_dir)
    except (ConfigError, ModelLoadError, FileNotFoundError, NonFiniteError) as e:
        remove_new_dirs(run_dir)  # a refused command leaves no directory behind
        raise JobRefused(f"datc-train: {e}", 2) from e
    except Interrupted as e:
        remove_new_dirs(run_dir)  # stopped in the set-up of a fresh run: nothing of it stays
        raise JobRefused(f"datc-train: {e}", e.exit_code) from e
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            remove_new_dirs(run_dir)
            raise
        from datc.run.checkpoint import latest_checkpoint

        last = latest_checkpoint(run_dir)
        raise JobRefused(f"datc-train: no space left on device writing {e.filename or run_dir} ({e.strerror}); "
                         f"{'the last good checkpoint ' + last.name + ' is kept' if last else 'no checkpoint was written yet'}: "
                         "free space and run the same command again to resume", 2) from e
    except EngineError as e:  # mid-run: the checkpoints stay, the same command resumes
        from datc.run.checkpoint import latest_checkpoint

        last = latest_checkpoint(run_dir)
        raise JobRefused(f"datc-train: {e}; {'the last checkpoint ' + last.name + ' is kept' if last else 'no checkpoint was written yet'}: "
                         "run the same command again to resume", 1) from e
    except Exception as e:
        if (lost := lost_peer_line(e, run_dir)) is not None:  # another rank of this run ended: one line
            raise JobRefused(lost, 1) from e
        remove_new_dirs(run_dir)  # an unexpected error: its traceback follows, and no stray directory
        raise


# What gloo, NCCL and torch's stores say when the other end of a collective is gone or silent
_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "timed out", "Timed out",
         "NCCL communicator was aborted", "failed to recv", "Socket closed")


def lost_peer_line(e: BaseException, run_dir) -> str | None:
    """One line for a collective that failed because another rank of a multi-process run ended
    (killed, out of memory, its node lost) or stopped answering within the collective timeout
    (``backend.timeout_s``); None for any other error (its traceback follows)."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    text = str(e)
    if world < 2 or not any(s in text for s in _LOST):
        return None
    from datc.run.checkpoint import latest_checkpoint

    last = latest_checkpoint(run_dir)
    first = text.strip().splitlines()[0][:160] if text.strip() else type(e).__name__
    return (f"datc-train: rank {os.environ.get('RANK', '?')} of {world}: another process of this run ended or stopped "
            f"answering (killed, out of memory, or its node lost), so this one stops too ({type(e).__name__}: {first}); "
            f"{'its last checkpoint is ' + last.name if last else 'no checkpoint was written yet'}: run the same "
            "command again to resume")


def hydra_error_line(e: Exception) -> str:
    """One line for Hydra's own composition errors (an unknown option of a config group, an
    unknown key, a malformed override), naming the group or key and the valid choices."""
    options = getattr(e, "options", None)
    missing = getattr(e, "missing_cfg_file", None)
    if options is not None and missing:
        group, _, choice = str(missing).rpartition("/")
        lower = {str(o).lower(): o for o in options}  # credit=dact, credit=DATC: datc
        close = [lower[m] for m in difflib.get_close_matches(choice.lower(), list(lower), n=1, cutoff=0.6)]
        mean = f"did you mean {group}={close[0]}? " if close else ""
        return f"{group}={choice}: no such option in {group}/; {mean}choose one of {', '.join(options)}"
    key = getattr(e.__cause__, "full_key", None)
    if key in MOVED_KEYS:
        return f"{key}: moved to {MOVED_KEYS[key]} (the vLLM engine's own settings are rollout.vllm.*)"
    if key:
        parent, _, last = key.rpartition(".")
        valid = valid_keys(parent)
        hint = f"; valid keys{' of ' + parent if parent else ''}: {', '.join(valid)}" if valid else ""
        close = difflib.get_close_matches(last, valid + (_groups() if not parent else []), n=1, cutoff=0.75)
        if close:  # a typo of a key or a config group (crdit=datc): say which, not how to add a new key
            valid_line = f" Valid keys{' of ' + parent if parent else ''}: {', '.join(valid)}" if valid else ""
            return f"{key}: not a config key; did you mean `{parent + '.' if parent else ''}{close[0]}`?{valid_line}"
        return f"{key}: not a config key{hint} (add one with +{key}=...)"
    lines = [ln.strip() for ln in str(e).split("Config search path")[0].splitlines() if ln.strip()]
    line = " ".join(lines) or type(e).__name__
    if "LexerNoViableAltException" in line or "mismatched input" in line or "extraneous input" in line:
        found = re.search(r"([\w.+~]+)=", line)
        key = found.group(1) if found else "key"
        line += (f"; a value with spaces, quotes or non-ASCII characters must be quoted for Hydra, inside the shell's "
                 f"quotes: '{key}=\"...\"' (with an apostrophe in the value: \"{key}=\\\"...\\\"\")")
    return line


def _groups() -> list[str]:
    """The config groups (``configs/<group>/``), experiment and debug included."""
    return sorted(p.name for p in Path(CONFIG_DIR).iterdir() if p.is_dir() and p.name != "hydra")
