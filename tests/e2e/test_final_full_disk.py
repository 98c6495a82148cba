"""A full disk while a one-process run writes its ``final/`` policy is one line, exit 2, with no
half-written ``final/`` left, and the same command then finishes the run (issue 57): safetensors
says a full disk in its own error, which was a traceback."""

from __future__ import annotations

import pytest
from transformers import PreTrainedModel

from datc.training.job import JobRefused, train_job
from tests.helpers.testbed import cfg_for


class SafetensorError(Exception):  # what safetensors raises (its Rust error, not an OSError)
    pass


@pytest.mark.slow
def test_a_full_disk_while_final_is_written_is_one_line_and_the_run_finishes_after(prepared_cache, tmp_path, monkeypatch):
    run = tmp_path / "run"
    overrides = ["credit=grpo", "trainer.steps=2", "trainer.checkpoint_every=2"]
    real = PreTrainedModel.save_pretrained

    def full(self, out, *args, **kwargs):
        (out / "model.safetensors").write_bytes(b"partial")
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", full)
    with pytest.raises(JobRefused) as e:
        train_job(cfg_for(prepared_cache, run, *overrides), str(run))
    assert e.value.code == 2 and "\n" not in e.value.line, e.value.line
    assert e.value.line.startswith("datc-train: no space left on device writing") and "final" in e.value.line
    assert "step_0000002 is kept" in e.value.line and "run the same command again" in e.value.line
    assert not (run / "final").exists() and not list(run.glob(".final*")) and not (run / "summary.json").exists()

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", real)
    summary = train_job(cfg_for(prepared_cache, run, *overrides), str(run))  # space is back
    assert summary["steps"] == 2 and (run / "final" / "model.safetensors").is_file()
