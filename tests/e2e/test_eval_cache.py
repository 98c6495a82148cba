"""``trainer.eval_cache``: runs that start alike share one step-0 evaluation, the same numbers as
their own would be; a run that could evaluate differently misses."""

from __future__ import annotations

import copy
import json

import torch

from datc.training import eval_cache
from datc.training.eval_cache import RECORD, weights_hash
from datc.training.trainer import train
from tests.helpers.runs import comparable, metric_rows
from tests.helpers.testbed import cfg_for

ONE_STEP = ("trainer.steps=1", "trainer.eval_every=1", "trainer.checkpoint_every=1", "trainer.warmup_steps=0")


def _step0(run_dir) -> dict:
    return comparable([r for r in metric_rows(run_dir) if r["step"] == 0])[0]


def test_a_run_reads_the_step0_evaluation_another_stored_and_logs_the_same_numbers(prepared_cache, tmp_path):
    cache = tmp_path / "evalcache"
    plain = tmp_path / "plain"
    train(cfg_for(prepared_cache, plain, *ONE_STEP, "credit=datc", "seed=3"))  # no cache: its own evaluation
    first, second = tmp_path / "first", tmp_path / "second"
    train(cfg_for(prepared_cache, first, *ONE_STEP, f"trainer.eval_cache={cache}"))
    entries = sorted(cache.glob("step0-*.json"))
    assert len(entries) == 1 and not (first / RECORD).exists()  # evaluated and stored, not read
    # another scheme, rate and seed: training-only fields, so the same entry, and the run says it read it
    train(cfg_for(prepared_cache, second, *ONE_STEP, f"trainer.eval_cache={cache}", "credit=datc", "seed=3",
                  "trainer.lr=1e-3"))
    assert sorted(cache.glob("step0-*.json")) == entries
    record = json.loads((second / RECORD).read_text())
    assert record["entry"] == entries[0].name and record["made_by"].startswith("keywords-tiny_gpt2-grpo-s0-")
    # the numbers logged from the cache are the ones the run computes without it, to the bit, in its order
    assert _step0(second) == _step0(plain) == _step0(first)
    assert list(_step0(second)) == list(_step0(plain))
    assert len(json.loads(entries[0].read_text())["samples"]) == 8  # logger.log_samples' rows, for the tracker
    # the cache folder is not part of what a run computes: the same identity with or without it
    ident = json.loads((second / "run.json").read_text())["identity"]
    assert "eval_cache" not in ident["trainer"] and ident["trainer"]["lr"] == 1e-3


def test_a_run_that_evaluates_otherwise_misses(prepared_cache, tmp_path):
    cache = tmp_path / "evalcache"
    train(cfg_for(prepared_cache, tmp_path / "a", *ONE_STEP, f"trainer.eval_cache={cache}"))
    train(cfg_for(prepared_cache, tmp_path / "b", *ONE_STEP, f"trainer.eval_cache={cache}", "trainer.eval_seed=7"))
    train(cfg_for(prepared_cache, tmp_path / "c", *ONE_STEP, f"trainer.eval_cache={cache}", "trainer.temperature=0.7"))
    assert len(list(cache.glob("step0-*.json"))) == 3
    assert not any((tmp_path / r / RECORD).exists() for r in "abc")


def test_the_weights_hash_sees_one_changed_value():
    m = torch.nn.Linear(4, 3)
    before = weights_hash(m)
    assert weights_hash(m) == before
    with torch.no_grad():
        m.weight[1, 2] = torch.nextafter(m.weight[1, 2], torch.tensor(2.0))
    assert weights_hash(m) != before
    assert weights_hash(copy.deepcopy(m).to(torch.bfloat16)) != weights_hash(m)


def test_the_tokenizer_hash_sees_its_vocabulary_special_tokens_and_chat_template(tok):
    before = eval_cache.tokenizer_hash(tok)  # the session's tokenizer is shared: changed on copies only
    other = copy.deepcopy(tok)
    assert eval_cache.tokenizer_hash(other) == before
    other.chat_template = (other.chat_template or "") + "{# another template #}"
    assert eval_cache.tokenizer_hash(other) != before
    other = copy.deepcopy(tok)
    other.add_special_tokens({"additional_special_tokens": ["<|other|>"]})  # a new token, a new special token
    assert eval_cache.tokenizer_hash(other) != before


def test_the_code_hash_sees_a_changed_added_or_renamed_source(tmp_path, monkeypatch):
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    (tmp_path / "pkg" / "sub" / "b.py").write_text("y = 2\n")
    (tmp_path / "pkg" / "notes.txt").write_text("not a source")
    monkeypatch.setattr(eval_cache, "PACKAGE_DIR", tmp_path / "pkg")
    before = eval_cache.code_hash()
    (tmp_path / "pkg" / "notes.txt").write_text("another note")  # not a Python source: the same
    assert eval_cache.code_hash() == before
    (tmp_path / "pkg" / "sub" / "b.py").write_text("y = 3\n")
    changed = eval_cache.code_hash()
    assert changed != before
    (tmp_path / "pkg" / "sub" / "c.py").write_text("")
    added = eval_cache.code_hash()
    assert added != changed
    (tmp_path / "pkg" / "sub" / "c.py").rename(tmp_path / "pkg" / "c.py")  # the same bytes elsewhere
    assert eval_cache.code_hash() not in (added, changed)


def test_a_cache_that_cannot_be_written_costs_the_run_nothing(prepared_cache, tmp_path, caplog):
    blocked = tmp_path / "a_file"
    blocked.write_text("not a folder")
    summary = train(cfg_for(prepared_cache, tmp_path / "r", *ONE_STEP, f"trainer.eval_cache={blocked}"))
    assert summary["eval"]["final"] and blocked.read_text() == "not a folder"
    assert any("could not be stored" in r.getMessage() for r in caplog.records)


def test_a_damaged_entry_is_evaluated_again_and_stored_whole(prepared_cache, tmp_path):
    cache = tmp_path / "evalcache"
    train(cfg_for(prepared_cache, tmp_path / "a", *ONE_STEP, f"trainer.eval_cache={cache}"))
    (entry,) = cache.glob("step0-*.json")
    good = json.loads(entry.read_text())
    for i, damaged in enumerate(("[1, 2]", json.dumps({k: v for k, v in good.items() if k != "samples"}), "{not json")):
        entry.write_text(damaged)
        run = tmp_path / f"r{i}"
        train(cfg_for(prepared_cache, run, *ONE_STEP, f"trainer.eval_cache={cache}"))
        assert not (run / RECORD).exists()  # it evaluated step 0 itself
        assert _step0(run) == _step0(tmp_path / "a")
        assert json.loads(entry.read_text())["metrics"] == good["metrics"]  # and stored it again, whole


def test_a_run_started_again_from_step0_without_the_cache_keeps_no_record_of_it(prepared_cache, tmp_path):
    import shutil

    cache = tmp_path / "evalcache"
    train(cfg_for(prepared_cache, tmp_path / "a", *ONE_STEP, f"trainer.eval_cache={cache}"))
    run = tmp_path / "b"
    train(cfg_for(prepared_cache, run, *ONE_STEP, f"trainer.eval_cache={cache}"))
    assert (run / RECORD).is_file()
    # as a kill before its first checkpoint leaves it: the same command (here without the cache) starts it again
    for name in ("summary.json", "metrics.jsonl"):
        (run / name).unlink()
    for name in ("checkpoints", "final"):
        shutil.rmtree(run / name)
    train(cfg_for(prepared_cache, run, *ONE_STEP))
    assert not (run / RECORD).exists() and _step0(run) == _step0(tmp_path / "a")
