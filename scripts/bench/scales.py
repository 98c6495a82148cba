"""The benchmark's scales (testbed, real model), its targets and constants, and the notes of
each scale's markdown, read from the template notes.md next to this file."""

from __future__ import annotations

import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "results" / "bench"
PHASES = ("rollout", "reward", "prep", "update")  # prep: TRL's reference pass and advantages; this project's credit (its reference pass is timed in reward, perf/reward_s)
CONTESTANTS = ("trl", "grpo", "datc")
SAME_LOSS = ("loss", "grad_norm", "reward_mean", "advantage_abs", "kl", "tokens")  # the check's figures, in table order
NOTES_TEMPLATE = Path(__file__).with_name("notes.md")
NOTE_VALUES = {"rm_reward": "`RMReward` in scripts/bench/trl_side.py"}  # notes.md's placeholders


def read_notes(path: Path = NOTES_TEMPLATE, values: dict[str, str] = NOTE_VALUES) -> dict[str, tuple[str, ...]]:
    """The template's notes by scale: under each ``## <scale>`` heading, one note per list item
    (``- `` at the start of a line), its lines joined with single spaces, placeholders filled
    (:class:`string.Template`; anything before the first heading, e.g. a comment, is left out)."""
    notes: dict[str, list[str]] = {}
    scale = None
    for line in string.Template(path.read_text()).substitute(values).splitlines():
        if line.startswith("## "):
            scale = line[3:].strip()
            notes[scale] = []
        elif scale is None or not line.strip():
            continue
        elif line.startswith("- "):
            notes[scale].append(line.rstrip())
        elif line.startswith("  ") and notes[scale]:
            notes[scale][-1] += " " + line.strip()
        else:
            raise ValueError(f"{path}: not a list item or its continuation under ## {scale}: {line!r}")
    return {k: tuple(v) for k, v in notes.items()}


NOTES = read_notes()


@dataclass(frozen=True)
class Scale:
    """One scale of the benchmark: its Hydra overrides, output files, work and targets."""

    name: str
    title: str  # for the side-by-side table
    overrides: tuple[str, ...]  # before the command line's
    stem: str  # results/bench/<stem>.json, <stem>.md, <stem>_profile.txt
    max_new_tokens: int | None  # set on both sides after the session is built (None: the config's)
    force_length: bool  # responses forced to the budget with min_new_tokens on both sides
    perturb: float  # noise scale of the same-loss check's perturbation (moves the policy off its reference)
    datc_target: float  # the target for credit=datc / credit=grpo step time
    defaults: dict[str, Any]  # command-line defaults
    notes: tuple[str, ...]  # the markdown's notes


GRPO_TARGET = 1.5  # the target for credit=grpo / TRL samples per second, at both scales
SCALES = {
    "testbed": Scale("testbed", "testbed (tiny GPT-2, keywords)", (), "trl", None, False, 0.02, 1.10,
                     {"steps": 10, "warmup": 2, "repeats": 5, "memory_steps": 4, "profile_steps": 5, "scaling": True,
                      "lengths": [8, 16, 32], "groups": [4, 8, 16]}, NOTES["testbed"]),
    "real": Scale("real", "real model (SmolLM2-135M-Instruct, reviews)", ("experiment=real_smollm2",), "trl_real", 48,
                  True, 0.002, 1.05,
                  {"steps": 2, "warmup": 1, "repeats": 3, "memory_steps": 1, "profile_steps": 1, "scaling": False,
                   "lengths": [32, 48, 64], "groups": [4, 8]}, NOTES["real"]),
}
TESTBED_TARGETS = {"grpo_over_trl_samples_per_s": GRPO_TARGET, "datc_over_grpo_step_s": SCALES["testbed"].datc_target}
