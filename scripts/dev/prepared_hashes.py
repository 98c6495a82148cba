"""The real preset's prepared files against their pinned sha256 (``results/real_model/prepared.json``).
The reduced prepare of ``tests/prepare/test_prepare_hash.py`` checks the same code path in the
suite; this checks the full-size files a study's runs train on (about 15 s to prepare from the committed
delta, nothing when the cache holds them).

    python -m scripts.dev.prepared_hashes                    # prepare if needed, compare; exit 1 on a difference
    python -m scripts.dev.prepared_hashes --write            # pin what this machine prepared (after a change
                                                            # of the procedure or of torch/MKL)
    python -m scripts.dev.prepared_hashes experiment=real_smollm2 cache_dir=CACHE   # the overrides (default: the preset)

Pinned: the data files, the policy's and the reward model's weights and configs. Not pinned: the
reward model's ``rm_report.json`` (it records the prepare's seconds); its held-out figures are
copied into the pin file beside the hashes. Beside each pinned sha256 the pin also keeps the hash a
run records of the same file in its ``inputs.json`` (``run_hashes``; ``datc/run/fingerprint.py``
hashes a file over 64 MiB by its first and last 4 MiB only, so the reward model's weights appear
there, and in the study tables, under that other hash): a table's reward model is found in the pin
by either. The check compares both.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from datc.run.fingerprint import sha256_file
from datc.run.provenance import machine, processor

ROOT = Path(__file__).resolve().parents[2]
PINNED = ROOT / "results" / "real_model" / "prepared.json"
PINNED_FILES = {"data": ("train.jsonl", "eval.jsonl"), "policy": ("model.safetensors", "config.json"),
                "reward": ("model.safetensors", "config.json")}
REPORT_KEYS = ("heldout_within_group_corr", "heldout_corr", "heldout_gold_mean", "final_train_loss", "train_pool")


def prepared(overrides: list[str]) -> dict[str, Any]:
    """Prepare (or find in the cache) the assets of ``overrides`` and hash the pinned files."""
    from hydra import compose, initialize_config_dir

    from datc.checks import validate
    from datc.paths import CONFIG_DIR
    from datc.prepare.assets import ensure_assets

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = validate(compose(config_name="train", overrides=overrides))
    a = ensure_assets(cfg)
    dirs = {"data": Path(a.data_path), "policy": Path(a.policy_path), "reward": Path(a.reward_path)}
    from datc.run.fingerprint import file_fingerprint

    report = json.loads((dirs["reward"] / "rm_report.json").read_text())
    names = [(k, name) for k, names in PINNED_FILES.items() for name in names]
    return {"overrides": overrides,
            "files": {f"{k}/{name}": sha256_file(dirs[k] / name) for k, name in names},
            "run_hashes": {f"{k}/{name}": {key: fp[key] for key in ("sha256", "hashed")}
                           for k, name in names for fp in [file_fingerprint(dirs[k] / name)]},
            "rm_report": {k: report.get(k) for k in REPORT_KEYS}}


def differences(pinned: dict[str, Any], got: dict[str, Any]) -> list[str]:
    """One line per pinned file whose hash differs or that is missing (its sha256, then the hash a
    run records of it, where the pin has one)."""
    out = [f"{name}: {got['files'].get(name, 'missing')} != pinned {sha}" for name, sha in pinned["files"].items()
           if got["files"].get(name) != sha]
    for name, rec in pinned.get("run_hashes", {}).items():
        if (mine := got["run_hashes"].get(name, {}).get("sha256", "missing")) != rec["sha256"]:
            out.append(f"{name}: run-record hash ({rec['hashed']}) {mine} != pinned {rec['sha256']}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.dev.prepared_hashes", description=__doc__.split("\n\n")[0])
    p.add_argument("--write", action="store_true", help="pin this machine's files")
    p.add_argument("--pinned", default=str(PINNED))
    p.add_argument("overrides", nargs="*", default=["experiment=real_smollm2"])
    a = p.parse_args(argv)
    got = prepared(list(a.overrides))
    path = Path(a.pinned)
    if a.write:
        from datc.atomic import atomic_write_json
        kept = [o for o in got["overrides"] if not o.startswith("cache_dir=")]  # where the cache is changes no file
        atomic_write_json(path, {**got, "overrides": kept, "machine": {**machine(), **processor()}})
        print(f"pinned {len(got['files'])} files in {path}")
        return 0
    pinned = json.loads(path.read_text())
    if bad := differences(pinned, got):
        here, there = processor(), {k: pinned.get("machine", {}).get(k) for k in ("cpu_vendor", "cpu_model")}
        print("prepared files differ from the pinned ones:\n  " + "\n  ".join(bad) + f"\n(this machine: {here}; the pin's: "
              f"{there}; two machine kinds build two reward models: docs/real-models.md)", file=sys.stderr)
        return 1
    print(f"{len(got['files'])} prepared files equal the pinned ones ({path.relative_to(ROOT) if path.is_relative_to(ROOT) else path})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
