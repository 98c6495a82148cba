"""Trained policies as Hugging Face checkpoints, for other tools to load, serve or evaluate.

At the end of a run the trainer writes the final policy and its tokenizer with
``save_pretrained`` into ``<run_dir>/final/`` (as TRL, verl and OpenRLHF leave a checkpoint),
so ``AutoModelForCausalLM.from_pretrained("<run_dir>/final")`` loads it. ``datc-export``
does the same for any checkpoint of a run, from its ``state.pt`` (plain PyTorch) or from
DeepSpeed's shards (ZeRO-2 and ZeRO-3 consolidated into fp32 weights with DeepSpeed's
``get_fp32_state_dict_from_zero_checkpoint``):

    datc-export runs/<run_name>                          # the last checkpoint -> runs/<run_name>/export/step_N
    datc-export runs/<run_name> --checkpoint 40 --out my_model
    datc-export runs/<run_name> --merge --replace        # replace this run's earlier export there

An export either writes what it says or refuses in one line: ``--out`` a file, a non-empty
folder that is not an export of this run, or another run's export is never touched; an earlier
export of the same run (its ``datc_export.json`` names the run) is replaced only with
``--replace``.

Weights are saved as trained (fp32 master weights), so the exported model's logits equal the
trained policy's.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from datc.models.build import EXPORT_MARKER as MARKER
from datc.models.build import save_pretrained_dir


class ExportError(ValueError):
    """A run or checkpoint that cannot be exported; the message says why."""


# ---- datc-export --------------------------------------------------------------------------------


def _checkpoint_dir(run_dir: Path, step: int | None) -> Path:
    from datc.run.checkpoint import checkpoint_dirs

    ckpts = checkpoint_dirs(run_dir)
    if not ckpts:
        raise ExportError(f"{run_dir}: no complete checkpoint under {run_dir / 'checkpoints'}")
    if step is None:
        return ckpts[-1]
    found = [p for p in ckpts if int(p.name.split("_")[1]) == step]
    if not found:
        steps = ", ".join(str(int(p.name.split("_")[1])) for p in ckpts)
        raise ExportError(f"--checkpoint: {run_dir} has no checkpoint of step {step}; it has {steps}")
    return found[0]


def checkpoint_state_dict(ckpt: Path) -> dict[str, torch.Tensor]:
    """The policy's fp32 weights in a checkpoint directory (``state.pt``, or the shards of the
    backend that wrote it: DeepSpeed's, FSDP2's ``torch.distributed.checkpoint``), in one process."""
    from datc.backends.plugins import checkpoint_weights
    from datc.run.checkpoint import load_checkpoint

    return checkpoint_weights(ckpt, load_checkpoint(ckpt))


def load_policy_weights(model, state: dict[str, torch.Tensor]) -> None:
    """``state`` into ``model``: every key must match, except a tied LM head (the consolidated
    ZeRO weights may hold it once, as the embedding)."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {k for k in missing if k.endswith("lm_head.weight") and model.config.tie_word_embeddings}
    if set(missing) - tied or unexpected:
        raise ExportError(f"the checkpoint does not match the policy's architecture (missing {sorted(set(missing) - tied)[:4]}, "
                          f"unexpected {sorted(unexpected)[:4]})")
    if tied:
        model.tie_weights()


def check_target(out: Path, run_id: str, replace: bool) -> str:
    """How ``out`` may be written (``atomic_dir``'s ``exist``), or an ``ExportError`` saying why
    not, before any model loads: a free path is written; this run's earlier export is replaced
    only with ``replace``; anything else there is never touched."""
    if out.is_symlink() and not out.exists():
        raise ExportError(f"--out: {out} is a broken symbolic link; choose another path (nothing written)")
    if not out.exists():
        return "refuse"
    if not out.is_dir():
        raise ExportError(f"--out: {out} is a file; choose another path (nothing written)")
    if not any(out.iterdir()):
        return "refuse"  # an empty folder is free
    try:
        held = json.loads((out / MARKER).read_text())
    except (OSError, ValueError):
        held = None
    if not isinstance(held, dict) or held.get("run_id") != run_id:
        whose = "another run's export" if isinstance(held, dict) else "a folder that is not an export of this run"
        raise ExportError(f"--out: {out} holds {whose}; it is never replaced: choose another path (nothing written)")
    if not replace:
        raise ExportError(f"--out: {out} holds an earlier export of this run (checkpoint {held.get('checkpoint')}, "
                          f"{'merged' if held.get('merge') else 'as trained'}); pass --replace to replace it (nothing written)")
    return "replace"


def export_checkpoint(run_dir: str | Path, step: int | None = None, out: str | Path | None = None,
                      merge: bool = False, replace: bool = False) -> Path:
    """Export checkpoint ``step`` (default: the last) of the run in ``run_dir`` as a Hugging
    Face checkpoint in ``out`` (default ``<run_dir>/export/step_N``). The architecture and
    tokenizer are the run's own (its ``config.yaml``; the testbed's come from the cache,
    rebuilt deterministically if it was cleared). A LoRA run exports its adapter, or with
    ``merge`` the base with the adapter folded in (:func:`datc.models.lora.save_adapter`); a full
    policy is the same either way. ``out`` is checked first (:func:`check_target`): an earlier
    export of this run there is replaced only with ``replace``; anything else there is refused."""
    from omegaconf import OmegaConf

    from datc.checks import validate
    from datc.models.build import load_pretrained
    from datc.models.tokenizer import load_tokenizer
    from datc.prepare.assets import ensure_assets
    from datc.run.rundir import read_run_config, read_run_id

    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").exists():
        raise ExportError(f"{run_dir}: not a datc run directory (no config.yaml)")
    ckpt = _checkpoint_dir(run_dir, step)
    c = validate(OmegaConf.create(read_run_config(run_dir)))  # checked against run.json
    given = Path(out) if out is not None else run_dir / "export" / ckpt.name
    # a link to a folder is written through (the link stays the user's), as datc-compare does
    out = Path(os.path.realpath(given)) if given.is_symlink() and given.is_dir() else given
    run_id = read_run_id(run_dir)
    with _one_writer(out, given):
        exist = check_target(out, run_id, replace)
        marker = {"run_id": run_id, "run_dir": str(run_dir.resolve()), "checkpoint": int(ckpt.name.split("_")[1]),
                  "merge": merge and c.policy.lora.r > 0, "lora": c.policy.lora.r > 0}
        if c.policy.path is not None:  # a given model: no data or cache needed
            policy_path, tok_path = c.policy.path, c.policy.tokenizer or c.policy.path
        else:
            assets = ensure_assets(c)
            policy_path, tok_path = assets.policy_path, assets.tokenizer_path
        model = load_pretrained("causal_lm", policy_path, "policy.path")  # the architecture; weights replaced
        if c.policy.lora.r > 0:
            from datc.models.lora import add_adapters, load_trained_state, save_adapter

            pm = add_adapters(model, c.policy.lora)
            load_trained_state(model, checkpoint_state_dict(ckpt), str(ckpt))
            save_adapter(pm, load_tokenizer(tok_path), out, model.state_dict(), merge=merge, exist=exist, marker=marker,
                         base=None if merge else policy_path)  # the base travels with the adapter
        else:
            load_policy_weights(model, checkpoint_state_dict(ckpt))
            save_pretrained_dir(model, load_tokenizer(tok_path), out, exist=exist, marker=marker)
    return given


@contextlib.contextmanager
def _one_writer(out: Path, given: Path) -> Iterator[None]:
    """One ``datc-export`` writes ``out`` at a time: an exclusive lock on ``.<name>.export.lock``
    beside it, from the check of what ``out`` holds to the rename that puts the export there (two
    exports racing to one fresh ``--out`` each passed the check, and the loser printed the path
    holding the other's export). The loser is refused at once; the lock file goes with the
    export, and the folders made for it go again if nothing was written."""
    from datc.atomic import held_lock

    made = [d for d in [out.parent, *out.parent.parents] if not d.exists()]
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        with held_lock(out.parent / f".{out.name}.export.lock", wait=False):
            yield
    except BlockingIOError:
        raise ExportError(f"--out: {given} is being written by another datc-export now; one export writes a path at "
                          "a time: wait for it to end and look at what it wrote, or choose another path "
                          "(nothing written)") from None
    finally:
        if not out.exists():
            for d in made:  # innermost first, while empty
                with contextlib.suppress(OSError):
                    d.rmdir()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="datc-export", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path, help="the run directory (runs/<run_name>)")
    ap.add_argument("--checkpoint", type=int, default=None, help="the step to export (default: the last checkpoint)")
    ap.add_argument("--out", type=Path, default=None, help="output directory (default: <run_dir>/export/step_N)")
    ap.add_argument("--merge", action="store_true",
                    help="a LoRA run: write the base with the adapter merged in, not the adapter (a full policy: no change)")
    ap.add_argument("--replace", action="store_true",
                    help="replace an earlier export of this same run at the output path (anything else there is never replaced)")
    a = ap.parse_args(argv)
    from datc.config import ConfigError
    from datc.models.build import ModelLoadError
    from datc.utils import quiet_libraries

    quiet_libraries()
    try:
        out = export_checkpoint(a.run_dir, a.checkpoint, a.out, merge=a.merge, replace=a.replace)
    except (ExportError, ConfigError, ModelLoadError, FileNotFoundError) as e:
        print(f"datc-export: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the export's temporary folder is removed (datc.atomic.atomic_dir)
        print("datc-export: interrupted (SIGINT); nothing was written (what --out held is as it was)", file=sys.stderr)
        return 130
    except Exception as e:
        if not _disk_full(e):
            if isinstance(e, OSError) and e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                print(f"datc-export: --out: cannot write {e.filename or a.out} ({e.strerror}); choose a writable path "
                      "(nothing written)", file=sys.stderr)
                return 2
            raise
        # the export's temporary folder is already removed (datc.atomic.atomic_dir)
        print(f"datc-export: no space left on device (or quota exceeded) writing the export"
              f"{f' ({e.filename})' if getattr(e, 'filename', None) else ''}; nothing was written: "
              "free space and run the same command again", file=sys.stderr)
        return 2
    print(out)
    return 0


# How a full disk reads: an OSError's errno, or the text of a library's own error (safetensors:
# "I/O error: No space left on device (os error 28)"; torch: "unexpected pos" / "write failed").
_FULL = ("No space left on device", "Disk quota exceeded", "os error 28", "os error 122")


def _disk_full(e: BaseException) -> bool:
    import errno

    for _ in range(8):  # the error and what caused it
        if e is None:
            return False
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(t in str(e) for t in _FULL):
            return True
        e = e.__cause__ or e.__context__
    return False


if __name__ == "__main__":
    sys.exit(main())
