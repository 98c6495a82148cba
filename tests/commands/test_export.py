"""Trained policies as Hugging Face checkpoints: the final one a run leaves, and datc-export's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from datc.commands.export import export_checkpoint
from datc.models.build import load_pretrained
from datc.run.checkpoint import checkpoint_dirs, load_checkpoint
from datc.training.trainer import train
from tests.helpers import cli
from tests.helpers.testbed import cfg_for

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

    from datc.checks import validate
    from datc.prepare.assets import ensure_assets

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
    proc = cli.run([sys.executable, "-m", "datc.commands.export", str(run), "--checkpoint", first.name.split("_")[1].lstrip("0"),
                    "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    exported = AutoModelForCausalLM.from_pretrained(out)
    torch.testing.assert_close(logits_of(exported, ids), logits_of(trained_policy(run, first), ids), rtol=0, atol=0)
    assert not torch.equal(logits_of(exported, ids), logits_of(final, ids))  # it is the earlier policy
    # Both pad prompts on the left, as the policy was trained (the export padded on the right)
    assert AutoTokenizer.from_pretrained(out).padding_side == AutoTokenizer.from_pretrained(run / "final").padding_side == "left"

    # Default output: inside the run directory, never in the checkout.
    assert export_checkpoint(run) == run / "export" / last.name


def test_export_errors_are_one_line(tmp_path):
    proc = cli.run([sys.executable, "-m", "datc.commands.export", str(tmp_path)])
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"datc-export: {tmp_path}: not a datc run directory (no config.yaml)"]


def _weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(next(path.glob("*.safetensors"))))


def test_an_export_writes_what_it_says_or_refuses_and_replaces_only_its_own_run_when_asked(cache_dir, tmp_path):
    from datc.commands.export import ExportError

    run, other = tmp_path / "run", tmp_path / "other"
    train(cfg_for(cache_dir, run, "trainer.steps=4", "trainer.keep_checkpoints=2"))
    train(cfg_for(cache_dir, other, "trainer.steps=2", "seed=1"))
    first, last = (int(p.name.split("_")[1]) for p in checkpoint_dirs(run))
    out = tmp_path / "out"
    export_checkpoint(run, first, out)
    was = _weights(out)
    # Another step to the same place: refused in one line, the earlier weights kept (the old reading kept them and said it wrote)
    proc = cli.run([sys.executable, "-m", "datc.commands.export", str(run), "--checkpoint", str(last), "--out", str(out)])
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "earlier export of this run" in proc.stderr and "--replace" in proc.stderr
    assert all(torch.equal(was[k], v) for k, v in _weights(out).items())
    # Asked for: replaced, and the new weights are the checkpoint's
    export_checkpoint(run, last, out, replace=True)
    now = _weights(out)
    assert any(not torch.equal(was[k], now[k]) for k in now)
    assert json.loads((out / "datc_export.json").read_text())["checkpoint"] == last
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.")] == []  # nothing left aside
    # Never replaced, even with --replace: a file, a folder of the user's, another run's export
    (tmp_path / "a_file").write_text("mine")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    export_checkpoint(other, None, tmp_path / "theirs")
    for target, why in ((tmp_path / "a_file", "is a file"), (tmp_path / "mine", "not an export of this run"),
                        (tmp_path / "theirs", "another run's export")):
        with pytest.raises(ExportError, match=why):
            export_checkpoint(run, last, target, replace=True)
    assert (tmp_path / "a_file").read_text() == "mine" and (tmp_path / "mine" / "notes.txt").read_text() == "mine"
    # An empty folder is free
    (tmp_path / "empty").mkdir()
    assert (export_checkpoint(run, last, tmp_path / "empty") / "config.json").exists()


def test_a_lora_export_then_merge_to_the_default_path_refuses_then_replaces_and_pads_left(cache_dir, tmp_path):
    run = tmp_path / "lora_run"
    train(cfg_for(cache_dir, run, "policy.lora.r=4", "trainer.steps=2"))
    adapter = export_checkpoint(run)
    assert (adapter / "adapter_config.json").exists()
    with pytest.raises(Exception, match="earlier export of this run"):
        export_checkpoint(run, merge=True)  # the adapter stayed where the merged model was said to be
    merged = export_checkpoint(run, merge=True, replace=True)
    assert merged == adapter and (merged / "config.json").exists() and not (merged / "adapter_config.json").exists()
    assert AutoModelForCausalLM.from_pretrained(merged) is not None
    assert AutoTokenizer.from_pretrained(merged).padding_side == "left"
    assert json.loads((merged / "datc_export.json").read_text())["merge"] is True


def test_a_full_disk_is_one_line_and_leaves_no_temporary_folder(cache_dir, tmp_path, monkeypatch, capsys):
    # Before: a SafetensorError (or OSError) traceback; the temporary folder was removed already.
    import errno

    import transformers.modeling_utils as modeling_utils
    from safetensors import SafetensorError

    from datc.commands import export

    run = tmp_path / "run"
    train(cfg_for(cache_dir, run))
    errors = [OSError(errno.ENOSPC, "No space left on device", "model.safetensors"),
              SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")]  # safetensors' own
    for error in errors:
        def full_disk(*args, error=error, **kwargs):
            raise error

        monkeypatch.setattr(modeling_utils, "safe_save_file", full_disk)
        out = tmp_path / "exported"
        assert export.main([str(run), "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("datc-export: no space left on device"), err
        assert not out.exists() and not [p.name for p in tmp_path.iterdir() if p.name.startswith(".exported.")]
    monkeypatch.setattr(modeling_utils, "safe_save_file", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("other")))
    with pytest.raises(RuntimeError, match="other"):  # any other error keeps its traceback
        export.main([str(run), "--out", str(tmp_path / "exported")])
