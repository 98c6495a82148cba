"""The numerics' fingerprint: what keeps the demo figure (``results/demo/``) tied to the code.

    python -m scripts.results.numerics_fingerprint --out results/demo/numerics.json   # (make demo-results runs it)

A ``debug=fast`` run from an empty cache (the prepare step's warm start and reward model
included, then 3 GRPO steps and 2 evaluations; about half a minute on one core) leaves a few
figures per step: the loss, the reward model's score, the response length, the gradient norm and
the held-out gold and score. ``make demo-results`` writes them beside the demo's summary, with
the commit that made both; ``tests/e2e/test_train_e2e.py::test_same_command_gives_same_metrics``
computes them on the code under test from its own empty cache and fails when they differ: the
numerics changed since the committed demo figure was made, so the figure must be made again
(``make demo-results``). A change that touches only the demo's own settings changes its run name
instead (``tests/e2e/test_docs.py`` checks that the committed summary is the demo's run name today).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

KEYS = ("loss/total", "loss/grad_norm", "reward/rm_score", "rollout/response_len", "eval/gold", "eval/rm_score")
RTOL = 1e-5  # float rounding of another build of the same kernels; a numerics change moves these by far more


def fingerprint(metrics_file: Path) -> dict[str, dict[str, float]]:
    """``{step: {key: value}}`` of :data:`KEYS` in a run's ``metrics.jsonl``."""
    out: dict[str, dict[str, float]] = {}
    for line in Path(metrics_file).read_text().splitlines():
        row = json.loads(line)
        kept = {k: row[k] for k in KEYS if k in row}
        if kept:
            out.setdefault(str(row["step"]), {}).update(kept)
    return out


def differences(a: dict[str, dict[str, float]], b: dict[str, dict[str, float]]) -> list[str]:
    """Where two fingerprints differ beyond :data:`RTOL` (``step key: a != b``); empty if equal."""
    out = [f"step {s}: only in one" for s in sorted(set(a) ^ set(b))]
    for s in sorted(set(a) & set(b), key=int):
        for k in sorted(set(a[s]) | set(b[s])):
            x, y = a[s].get(k), b[s].get(k)
            if x is None or y is None or not math.isclose(x, y, rel_tol=RTOL, abs_tol=1e-9):
                out.append(f"step {s} {k}: {x} != {y}")
    return out


def measure(work: Path) -> dict[str, dict[str, float]]:
    """The fingerprint of this code: the ``debug=fast`` run from an empty cache in ``work``."""
    from hydra import compose, initialize_config_dir

    from datc.paths import CONFIG_DIR
    from datc.training.trainer import train

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="train", overrides=["debug=fast", f"cache_dir={work / 'cache'}", f"run_dir={work / 'run'}"])
    train(cfg)
    return fingerprint(work / "run" / "metrics.jsonl")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.results.numerics_fingerprint", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="results/demo/numerics.json")
    a = ap.parse_args(argv)
    from datc.atomic import atomic_write_json
    from datc.training.lifecycle import GIT_COMMIT

    with tempfile.TemporaryDirectory() as work:
        figures = measure(Path(work))
    atomic_write_json(Path(a.out), {"command": "python -m scripts.results.numerics_fingerprint " + " ".join(argv or sys.argv[1:]),
                                    "commit": GIT_COMMIT, "run": "debug=fast from an empty cache", "keys": list(KEYS),
                                    "fingerprint": figures})
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
