"""Trained policies as Hugging Face checkpoints: the final one a run leaves, and datc-export's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from datc.models.build import load_pretrained
from datc.run.checkpoint import checkpoint_dirs, load_checkpoint
from datc.run.export import export_checkpoint
from datc.training.trainer import train
from tests.conftest import cfg_for

pytestmark = pytest.mark.slow


def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


def trained_policy(run: Path, ckpt: Path):
    """The policy as the trainer holds it at ``ckpt``: the warm start with the checkpoint's weights."""
    policy = load_pretrained("causal_lm", _policy_path(run), "policy.path")
    policy.load_state_dict(load_checkpoint(ckpt)["policy"])
    return policy


def _policy_path(run: Path) -> str:
    from omegaconf import OmegaConf

    from datc.config import validate
    from datc.data.prepare import ensure_assets

    return ensure_assets(validate(OmegaConf.load(run / "config.yaml"))).policy_path


@pytest.mark.parametrize("policy", ["tiny_gpt2", "tiny_llama"])
def test_a_run_leaves_a_hugging_face_checkpoint_and_any_checkpoint_exports(cache_dir, tmp_path, policy):  # noqa: F811
    run = tmp_path / "run"
    train(cfg_for(cache_dir, run, f"policy={policy}", "trainer.keep_checkpoints=3"))
    first, last = checkpoint_dirs(run)[0], checkpoint_dirs(run)[-1]
    ids = torch.randint(4, 100, (3, 12), generator=torch.Generator().manual_seed(0))

    final = AutoModelForCausalLM.from_pretrained(run / "final")  # loads with plain transformers
    assert AutoTokenizer.from_pretrained(run / "final").get_vocab() == AutoTokenizer.from_pretrained(_policy_path(run)).get_vocab()
    torch.testing.assert_close(logits_of(final, ids), logits_of(trained_policy(run, last), ids), rtol=0, atol=0)

    # An earlier checkpoint, through the command line.
    out = tmp_path / "exported"
    proc = subprocess.run([sys.executable, "-m", "datc.run.export", str(run), "--checkpoint", first.name.split("_")[1].lstrip("0"),
                           "--out", str(out)], capture_output=True, text=True, timeout=300, env=os.environ)
    assert proc.returncode == 0, proc.stderr[-2000:]
    exported = AutoModelForCausalLM.from_pretrained(out)
    torch.testing.assert_close(logits_of(exported, ids), logits_of(trained_policy(run, first), ids), rtol=0, atol=0)
    assert not torch.equal(logits_of(exported, ids), logits_of(final, ids))  # it is the earlier policy
    # Both pad prompts on the left, as the policy was trained (the export padded on the right)
    assert AutoTokenizer.from_pretrained(out).padding_side == AutoTokenizer.from_pretrained(run / "final").padding_side == "left"

    # Default output: inside the run directory, never in the checkout.
    assert export_checkpoint(run) == run / "export" / last.name


def test_export_errors_are_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "datc.run.export", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"datc-export: {tmp_path}: not a datc run directory (no config.yaml)"]
