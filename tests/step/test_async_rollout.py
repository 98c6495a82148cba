"""rollout.max_staleness: the fixed version schedule, the built-in engine's own copy of the
weights on its own thread, determinism, kill -9 and resume, and the config's refusals
(datc.step.stream, datc.engines.own_copy). The vLLM engine's asynchronous runs are in
tests/engines/test_vllm_engine.py."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from datc.checks import validate
from datc.config import ConfigError
from datc.step.stream import version_of
from tests.helpers import cli
from tests.helpers.runs import comparable, kill_at_checkpoint, metric_rows
from tests.helpers.testbed import cfg_for, train_cmd

ASYNC = ["rollout.max_staleness=1", "rollout.correction=token_truncate"]


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_the_schedule_samples_each_batch_with_the_weights_the_trainer_holds_when_it_is_handed_over(k):
    steps = 9
    handed: dict[int, int] = {}  # batch -> the trainer's version when it was handed to the engine
    for n in range(steps):  # at step n the trainer holds version n and hands over batches up to n + k
        for b in range(min(n + k, steps - 1) + 1):
            handed.setdefault(b, n)
    for b in range(steps):
        assert version_of(b, k) == handed[b]  # the weights it needs are the ones held then
        assert 0 <= b - version_of(b, k) <= k  # trained on at step b: never more than k versions old
    assert [version_of(b, 1) for b in range(4)] == [0, 0, 1, 2]


def _run(cache, tmp_path, name, *overrides, steps=6):
    from datc.training.trainer import train

    train(cfg_for(cache, tmp_path / name, f"trainer.steps={steps}", *overrides))
    return metric_rows(tmp_path / name)


def test_a_stale_run_trains_on_the_batch_sampled_k_versions_before_and_measures_the_gap(prepared_cache, tmp_path):
    rows = [r for r in _run(prepared_cache, tmp_path, "k1", *ASYNC) if "loss/total" in r]
    assert [r["rollout/staleness"] for r in rows] == [0.0] + [1.0] * 5  # batch 0 with version 0, then one behind
    # batch b sampled with the weights after b - 1 steps: once the policy has moved, the trained policy and the
    # sampler disagree and the correction's ratios leave 1 (the first update's warm-up rate is 0)
    moved = [r for r in rows if r["step"] >= 3]
    assert all(r["rollout/sampler_logp_diff_mean"] > 1e-4 for r in moved), moved
    assert all(r["rollout/is_ratio_min"] < 1 < r["rollout/is_ratio_max"] <= 2.0 for r in moved)
    assert all(r["perf/rollout_wait_s"] >= 0 and r["perf/engine_wait_s"] >= 0 and r["perf/push_s"] >= 0 for r in rows)
    # the same seed, another pass: the same run, whatever the two threads' timing
    assert comparable(_run(prepared_cache, tmp_path, "k1_again", *ASYNC)) == comparable(metric_rows(tmp_path / "k1"))
    # k = 2: batch b is sampled with the weights after b - 2 steps
    rows2 = [r for r in _run(prepared_cache, tmp_path, "k2", "rollout.max_staleness=2", "rollout.correction=token_truncate",
                             steps=4)
             if "loss/total" in r]
    assert [r["rollout/staleness"] for r in rows2] == [0.0, 1.0, 2.0, 2.0]


def test_the_engine_samples_the_next_batch_on_its_own_thread_while_the_trainer_updates(prepared_cache, tmp_path):
    from datc.step import train_step
    from datc.step.ops import StepOps
    from datc.training.session import build_session

    events = []
    loss = StepOps().loss

    def recorded_sample(*args, **kwargs):
        start = time.perf_counter()
        out = sample(*args, **kwargs)
        events.append(("sample", threading.current_thread().name, start, time.perf_counter()))
        return out

    def recorded_loss(*args, **kwargs):
        events.append(("loss", threading.current_thread().name, time.perf_counter(), None))
        return loss(*args, **kwargs)

    s = build_session(validate(cfg_for(prepared_cache, tmp_path / "run", *ASYNC)), ops=StepOps(loss=recorded_loss))
    sample = s.engine.sample
    s.engine.sample = recorded_sample
    try:
        train_step(s, 0)
        train_step(s, 1)
    finally:
        s.stream.close()
    samples = [e for e in events if e[0] == "sample"]
    assert all(e[1].startswith("datc-rollout") for e in samples)  # never the trainer's thread
    assert all(e[1] == threading.current_thread().name for e in events if e[0] == "loss")
    # batch 1 (the second sampling call) started before step 0's update had finished its last loss
    step0_losses = [e[2] for e in events if e[0] == "loss"][: len([e for e in events if e[0] == "loss"]) // 2]
    assert samples[1][2] < max(step0_losses), events


def test_the_own_copy_reports_the_log_probs_it_sampled_with_and_draws_from_its_own_stream(prepared_cache, tmp_path):
    from datc.engines.own_copy import OwnCopyEngine
    from datc.forward.passes import rollout_policy_pass
    from datc.step.sample import sampling_args
    from datc.training.session import build_session

    s = build_session(validate(cfg_for(prepared_cache, tmp_path / "run", *ASYNC, "trainer.temperature=0.7")))
    s.stream.close()
    eng = s.engine
    assert isinstance(eng, OwnCopyEngine) and eng.model is not s.m.policy
    args = sampling_args(s, s.plan)
    examples = [s.assets.train[i] for i in range(4)]
    before = torch.get_rng_state()
    ro = eng.sample(None, s.m.tok, examples, args, encoder=s.m.encoder, seeds=[5, 6, 7, 8])
    assert torch.equal(torch.get_rng_state(), before)  # torch's global stream untouched
    again = eng.sample(None, s.m.tok, examples, args, encoder=s.m.encoder, seeds=[5, 6, 7, 8])
    assert torch.equal(ro.response_ids, again.response_ids)
    other = eng.sample(None, s.m.tok, examples, args, encoder=s.m.encoder, seeds=[1, 6, 7, 8])
    assert not torch.equal(ro.response_ids, other.response_ids)
    train = rollout_policy_pass(s.m.policy, ro, 0.7, 8, False, with_entropy=False, share=False).logps
    m = ro.response_mask
    assert (ro.sampler_logps[~m] == 0).all() and torch.allclose(ro.sampler_logps[m], train[m], atol=1e-5)
    # the policy moves; the copy keeps its weights until a snapshot is loaded
    with torch.no_grad():
        for p in s.m.policy.parameters():
            p.add_(0.01 * torch.randn_like(p))
    stale = eng.sample(None, s.m.tok, examples, args, encoder=s.m.encoder, seeds=[5, 6, 7, 8])
    assert torch.equal(stale.response_ids, ro.response_ids)
    eng.load(eng.snapshot(s.m.policy))
    assert all(torch.equal(a, b) for a, b in zip(eng.model.state_dict().values(), s.m.policy.state_dict().values(),
                                                strict=True))


def test_an_engine_error_on_its_thread_reaches_the_step_that_trains_on_the_batch(prepared_cache, tmp_path):
    """The engine fails while sampling batch 1 ahead (on its own thread, during step 0): step 0
    trains as usual, step 1 raises the engine's EngineError (what ``datc-train`` says in one line,
    keeping the checkpoints), and the stream closes without waiting on anything."""
    from datc.engines.base import EngineError
    from datc.step import train_step
    from datc.training.session import build_session

    s = build_session(validate(cfg_for(prepared_cache, tmp_path / "run", *ASYNC)))
    sample, calls = s.engine.sample, []

    def failing(*args, **kwargs):
        calls.append(threading.current_thread().name)
        if len(calls) == 2:
            raise EngineError("rollout engine: injected failure")
        return sample(*args, **kwargs)

    s.engine.sample = failing
    try:
        assert "loss/total" in train_step(s, 0).metrics
        with pytest.raises(EngineError, match="injected failure"):
            train_step(s, 1)
    finally:
        t0 = time.perf_counter()
        s.stream.close()
    # the failing call was batch 1's; step 1 may have handed batch 2 to the engine before it read the error
    assert time.perf_counter() - t0 < 5 and all(n.startswith("datc-rollout") for n in calls) and len(calls) in (2, 3)


def test_a_stale_run_killed_at_a_checkpoint_resumes_to_the_uninterrupted_run(prepared_cache, tmp_path):
    overrides = [*ASYNC, "trainer.steps=6", "trainer.checkpoint_every=2", "trainer.eval_every=3"]
    cache = prepared_cache
    full = cli.run(train_cmd(cache, tmp_path / "full", *overrides))
    assert full.returncode == 0, full.stderr[-2000:]
    killed = tmp_path / "killed"
    kill_at_checkpoint(train_cmd(cache, killed, *overrides), killed, 2)
    state = torch.load(killed / "checkpoints" / "step_0000002" / "state.pt", weights_only=False)
    [b] = state["rollout_stream"]["batches"]  # batch 2, sampled with the weights of step 1, kept
    assert b == 2 and state["rollout_stream"]["batches"][2]["versions"].unique().tolist() == [1]
    resumed = cli.run(train_cmd(cache, killed, *overrides))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert comparable(metric_rows(killed)) == comparable(metric_rows(tmp_path / "full"))


def test_max_staleness_settings_that_cannot_run_are_one_line_before_any_model(tmp_path, capsys):
    def check(*overrides):
        return validate(cfg_for(tmp_path / "cache", tmp_path / "run", *overrides))

    with pytest.raises(ConfigError, match=r"^rollout.max_staleness: must be 0 .* got -1$"):
        check("rollout.max_staleness=-1")
    with pytest.raises(ConfigError, match=r"^rollout.max_staleness: 1 samples on the engine's own thread, which runs on "
                                          r"one process with the plain backend \(this run: backend deepspeed"):
        check("rollout.max_staleness=1", "deepspeed=zero2")
    with pytest.raises(ConfigError, match=r"backend fsdp2"):
        check("rollout.max_staleness=1", "backend=fsdp2")
    with pytest.raises(ConfigError, match=r"^rollout.max_staleness: 1 with vllm samples while the update runs, and "
                                          r"vLLM's sampler draws from torch's global random stream, as does the "
                                          r"update.s mini-batch shuffle \(trainer.mini_batch_size=4 < "):
        check("rollout=vllm", "rollout.max_staleness=1", "trainer.mini_batch_size=4", "trainer.micro_batch_size=4")
    with pytest.raises(ConfigError, match=r"adapter dropout \(policy.lora.dropout=0.1\)"):
        check("rollout=vllm", "rollout.max_staleness=1", "policy.lora.r=4", "policy.lora.dropout=0.1")
    check("rollout.max_staleness=1", "trainer.mini_batch_size=4", "trainer.micro_batch_size=4",
          "rollout.correction=token_truncate")  # the own copy draws from its own stream
    with pytest.raises(ConfigError, match=r"^rollout.vllm.sleep_mode: on releases"):
        check("rollout=vllm", "rollout.max_staleness=2", "rollout.vllm.sleep_mode=on")
    with pytest.raises(ConfigError, match=r"^rollout.correction: 'token_truncate' needs an engine with its own sampler"):
        check("rollout.correction=token_truncate")  # the torch engine, synchronous: its sampler is the trainer
    with pytest.raises(ConfigError, match=r"^rollout.correction: 'token_truncate' compares .* trainer.top_p=0.9"):
        check(*ASYNC, "trainer.top_p=0.9")
    capsys.readouterr()
    check("rollout.max_staleness=1")  # correction none: allowed (an ablation), said in one line
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("datc: warning: rollout.max_staleness=1 with rollout.correction=none"), err


def test_max_staleness_0_keeps_a_run_s_identity_and_k_gives_another():
    from datc.run.identity import identity
    from datc.training.lifecycle import resolved_config

    def ident(*overrides):
        return identity(resolved_config(cfg_for("/c", "/r", *overrides)))

    base = ident()
    assert "max_staleness" not in base["rollout"] and ident("rollout.max_staleness=0") == base
    assert ident("rollout.max_staleness=1")["rollout"]["max_staleness"] == 1


def test_the_staleness_table_reads_each_run_s_steps_after_the_first():
    from scripts.results.engine_runs import _staleness, tables

    def run(step_s, gap):
        rows = [{"step": 0, "eval/gold": 0.2}]
        for i in range(1, 4):
            rows.append({"step": i, "loss/total": 0.0, "perf/step_s": 99.0 if i == 1 else step_s, "perf/rollout_s": 1.0,
                         "perf/reward_s": 1.0, "perf/credit_s": 0.0, "perf/update_s": 1.0, "perf/samples_per_s": 32 / step_s,
                         "rollout/sampler_logp_diff_mean": gap, "rollout/is_ratio_min": 0.9, "rollout/is_ratio_mean": 1.0,
                         "rollout/is_ratio_max": 1.1, "reward/gold": 0.3})
        rows.append({"step": 3, "eval/gold": 0.4})
        return {"overrides": [], "wall_s": 1.0, "load": [[1, 1, 1], [1, 1, 1]], **_staleness({"rows": rows})}

    f = {"machine": "m", "staleness": {"0": run(4.0, 1e-5), "1": run(2.0, 0.02)}}
    assert f["staleness"]["1"]["step_s"] == 2.0  # the first step (the engine's warm-up) left out
    text = tables(f)
    assert "| 1 | 2.00 (2.00x) | 16.00 |" in text and "| 0 | 4.00 (1.00x) |" in text
    assert "2.00e-02" in text and "0: 0.200, 3: 0.400" in text


def test_a_resume_without_the_batches_in_flight_is_one_line_not_a_batch_sampled_with_other_weights(prepared_cache,
                                                                                                     tmp_path):
    from datc.training.session import build_session

    s = build_session(validate(cfg_for(prepared_cache, tmp_path / "run", *ASYNC, "trainer.steps=6")))
    try:
        s.stream.restore({}, 3)  # a checkpoint of step 3 that holds no rollout_stream entry
        with pytest.raises(ConfigError, match=r"^rollout.max_staleness: batch 3 is sampled with the weights of step 2, "
                                              r"which this run \(at step 3\) no longer has"):
            s.stream.take(s, 3)
    finally:
        s.stream.close()
