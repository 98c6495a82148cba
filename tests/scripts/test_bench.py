"""Pure helpers of scripts/bench/ (the comparison with TRL, ``python -m scripts.bench``); none of
them needs trl. The same-loss check against TRL itself runs at the start of every benchmark,
which stops if it fails."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from datc.batch import encode_prompts
from datc.engines.generate import sample_groups
from datc.models.chat import PromptEncoder, RewardInputs
from datc.models.rm_inputs import build_rm_inputs
from datc.rewards.model import score
from scripts.bench.render import load_results, render, side_by_side, write_markdown
from scripts.bench.same_loss import perturb_
from scripts.bench.scales import OUT, PHASES, SCALES, read_notes
from scripts.bench.stats import block_summary, close, rotated_order, spread
from scripts.bench.trl_side import RMReward, pad_completions, trl_prompt, unpadded
from tests.helpers.chat import chat_tokenizer

ROOT = Path(__file__).resolve().parents[2]


def test_spread_of_a_few_figures():
    s = spread([3.0, 1.0, 2.0, 4.0, 5.0])
    assert (s["median"], s["min"], s["max"], s["n"]) == (3.0, 1.0, 5.0, 5)
    assert (s["q1"], s["q3"]) == (2.0, 4.0)  # inclusive quartiles of 1..5
    one = spread([2.5])
    assert one["median"] == one["q1"] == one["q3"] == 2.5


def test_block_summary_uses_totals_for_throughput_and_medians_for_phases():
    rows = [{"step_s": 0.1, "tokens": 100.0, **{f"{p}_s": 0.02 for p in PHASES}},
            {"step_s": 0.3, "tokens": 300.0, **{f"{p}_s": 0.04 for p in PHASES}}]
    b = block_summary(rows, batch_size=10)
    assert b["samples_per_s"] == pytest.approx(20 / 0.4)
    assert b["tokens_per_s"] == pytest.approx(400 / 0.4)
    assert b["step_s"] == pytest.approx(0.2)
    assert b["rollout_s"] == pytest.approx(0.03)
    assert b["other_s"] == pytest.approx(0.2 - 4 * 0.03)
    assert b["response_len"] == pytest.approx(20.0)


def test_rotated_order_puts_each_contestant_in_each_place():
    names = ("a", "b", "c")
    orders = [rotated_order(names, r) for r in range(6)]
    for pos in range(3):
        assert sorted(o[pos] for o in orders) == ["a", "a", "b", "b", "c", "c"]
    assert orders[0] == ["a", "b", "c"] and orders[3] == ["c", "b", "a"]


def test_pad_completions_right_pads_and_masks():
    ids, mask = pad_completions([[5, 6, 2], [7], [8, 2]], pad_id=0)
    assert ids.tolist() == [[5, 6, 2], [7, 0, 0], [8, 2, 0]]
    assert mask.tolist() == [[True, True, True], [True, False, False], [True, True, False]]


def test_close_is_relative_with_a_small_absolute_floor():
    assert close(1.0, 1.00005, 1e-4)
    assert not close(1.0, 1.001, 1e-4)
    assert close(0.0, 5e-8, 1e-4)
    assert not close(-0.0260, -0.0259, 1e-4)


def test_perturb_gives_two_copies_the_same_weights(policy):
    import copy

    other = copy.deepcopy(policy)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    perturb_(policy, 0.01, 3)
    perturb_(other, 0.01, 3)
    for (k, a), (_, b) in zip(policy.state_dict().items(), other.state_dict().items(), strict=True):
        assert torch.equal(a, b), k
    assert any(not torch.equal(before[k], v) for k, v in policy.state_dict().items())


def test_trl_reward_function_scores_what_the_trainer_scores(tok, policy, reward_model):
    """TRL hands the reward function prompt texts and completion id lists (up to and including
    EOS); the wrapper must give the scores this project's reward phase gives the same rollout."""
    torch.manual_seed(0)
    examples = [{"prompt": "write about music :"}, {"prompt": "write about the ocean and the city :"}]
    ro = sample_groups(policy, tok, examples, 3, 6)
    inp = build_rm_inputs(ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask, tok.pad_token_id)
    expected = score(reward_model, inp, ro.response_mask).scores
    lists = [ro.response_ids[i, : int(ro.response_mask[i].sum())].tolist() for i in range(len(ro.examples))]
    got = RMReward(reward_model, tok, 4)([ex["prompt"] for ex in ro.examples], None, lists)
    torch.testing.assert_close(torch.tensor(got), expected, rtol=1e-5, atol=1e-6)
    # the prompts are re-encoded exactly as the rollout encoded them (BOS, left padding)
    ids, _ = encode_prompts(tok, ro.examples, "prompt", torch.device("cpu"))
    assert torch.equal(ids, ro.prompt_ids)


def test_trl_reward_function_scores_chat_prompts_as_the_trainer_does(tmp_path):
    """With a chat template TRL hands the reward function each prompt as its messages; the
    wrapper renders them as the rollout did and splices the sampled ids after them."""
    from datc.models.build import build_causal_lm, build_reward_model
    from tests.helpers.testbed import ARCHS

    tok = chat_tokenizer(tmp_path, "chatml")
    policy = build_causal_lm(ARCHS["llama"], tok, 0).eval()
    rm = build_reward_model(ARCHS["llama"], tok, 1).eval()
    enc = PromptEncoder(tok, "prompt", "text", chat_template=True)
    torch.manual_seed(0)
    examples = [{"prompt": "write about music"}, {"prompt": "write about the ocean and the city"}]
    ro = sample_groups(policy, tok, examples, 2, 5, encoder=enc)
    expected = score(rm, RewardInputs(tok, enc)(ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask,
                                                ro.examples), ro.response_mask).scores
    lists = [ro.response_ids[i, : int(ro.response_mask[i].sum())].tolist() for i in range(len(ro.examples))]
    prompts = [trl_prompt(enc, ex) for ex in ro.examples]
    assert prompts[0] == [{"role": "user", "content": "write about music"}]
    got = RMReward(rm, tok, 3, enc)(prompts, None, lists)
    torch.testing.assert_close(torch.tensor(got), expected, rtol=1e-5, atol=1e-6)
    # TRL renders the conversation with the same template and generation prompt
    trl_ids = tok.apply_chat_template(prompts, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert [list(x) for x in trl_ids] == unpadded(ro.prompt_ids, ro.prompt_mask)


def test_trl_prompt_is_the_text_without_a_chat_template(tok):
    enc = PromptEncoder(tok, "prompt", "text")
    assert trl_prompt(enc, {"prompt": "write about music :"}) == "write about music :"


def test_unpadded_drops_left_and_right_padding():
    ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 0]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 0]])
    assert unpadded(ids, mask) == [[5, 6], [7, 8, 9]]


# ---- the results files: rendering and the side-by-side section ----------------------------------


def fake_results(scale: str, grpo_ms: float, trl_ms: float, datc_ms: float) -> dict:
    """A results dict of the shape main() writes, with given median step times (phases 1/4 each)."""
    def block(ms):
        s = ms / 1000
        return {"samples_per_s": 32 / s, "tokens_per_s": 32 * 48 / s, "step_s": s, "response_len": 48.0,
                **{f"{p}_s": s / 4 for p in PHASES}, "other_s": 0.0}

    med = {"trl": block(trl_ms), "grpo": block(grpo_ms), "datc": block(datc_ms)}
    one = {"q1": 0, "q3": 0, "min": 0, "max": 0, "n": 1}
    sc = SCALES[scale]
    return {
        "command": f"python -m scripts.bench --scale {scale}", "commit": "abc1234", "date": "2026-12-01", "threads": 1,
        "machine": {"torch": "2", "transformers": "5", "trl": "1.16.0", "cpus": 2},
        "load_average_1_5_15min": {"start": [1.0, 1, 1], "end": [1.0, 1, 1]},
        "work": "8 prompts x 4 responses, 48 tokens each (forced with min_new_tokens on both sides), temperature 1.0",
        "work_batch": 32, "scale": scale, "policy_params": 134_515_008,
        "targets": {"grpo_over_trl_samples_per_s": 1.5, "datc_over_grpo_step_s": sc.datc_target},
        "throughput": {"batch_size": 32, "steps": 2, "warmup": 1, "repeats": 1, "median_over_repeats": med,
                       "grpo_over_trl_samples_per_s": {**one, "median": trl_ms / grpo_ms},
                       "datc_over_trl_samples_per_s": {**one, "median": trl_ms / datc_ms},
                       "datc_over_grpo_step_s": {**one, "median": datc_ms / grpo_ms}},
        "same_loss": {"tolerance": 1e-4, "trl": dict.fromkeys(("loss", "grad_norm", "reward_mean", "advantage_abs", "kl",
                                                               "tokens"), 1.0),
                      "datc": dict.fromkeys(("loss", "grad_norm", "reward_mean", "advantage_abs", "kl", "tokens"), 1.0),
                      "agree": dict.fromkeys(("loss", "grad_norm", "reward_mean", "advantage_abs", "kl", "tokens"), True),
                      "same_prompt_ids": True, "prompt_tokens": 42.0, "perturb": 0.002},
        "notes": list(sc.notes),
    }


def test_side_by_side_puts_each_scales_ratios_and_verdicts_in_a_column():
    tb = fake_results("testbed", 100.0, 160.0, 105.0)  # grpo 1.6x TRL, datc 1.05x grpo: both testbed targets met
    rl = fake_results("real", 1000.0, 1200.0, 1100.0)  # 1.2x (0.30 short), 1.10x (0.05 over the real 1.05)
    cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in side_by_side(tb, rl) if line.startswith("| ")]
    rows = {c[0]: c[1:] for c in cells}
    assert rows["**datc (credit=grpo) / TRL samples/s**"] == ["1.60 (0.00 to 0.00)", "1.20 (0.00 to 0.00)"]
    assert rows["step, TRL (ms)"] == ["160.0", "1200.0"]
    assert rows["TRL / datc time: update"] == ["1.60", "1.20"]
    assert rows["credit=grpo step share: rollout"] == ["25%", "25%"]
    assert rows["credit=datc adds: reward"] == ["+1.2%", "+2.5%"]
    assert rows["policy parameters"] == ["134.5M", "134.5M"]
    assert rows["target: credit=grpo / TRL samples/s"] == ["met (1.60 against 1.50)",
                                                           "**not met** (1.20 against 1.50: 0.30 short)"]
    assert rows["target: credit=datc / credit=grpo step"] == ["met (1.05 against 1.10)",
                                                              "**not met** (1.10 against 1.05: 0.05 over)"]


def test_each_scales_markdown_gets_the_side_by_side_section_once_both_have_run(tmp_path):
    tb, rl = fake_results("testbed", 100.0, 160.0, 105.0), fake_results("real", 1000.0, 1200.0, 1100.0)
    (tmp_path / "trl.json").write_text(json.dumps(tb))
    assert write_markdown(tmp_path) == [tmp_path / "trl.md"]
    assert "Scaling: the testbed to a real model" not in (tmp_path / "trl.md").read_text()
    (tmp_path / "trl_real.json").write_text(json.dumps(rl))
    assert write_markdown(tmp_path) == [tmp_path / "trl.md", tmp_path / "trl_real.md"]
    for name, title in (("trl.md", "# This project's GRPO against TRL's GRPOTrainer\n"),
                        ("trl_real.md", "# This project's GRPO against TRL's GRPOTrainer: real model")):
        md = (tmp_path / name).read_text()
        assert md.startswith(title) and md.count("## Scaling: the testbed to a real model") == 1
    real_md = (tmp_path / "trl_real.md").read_text()
    assert "credit=datc at most 1.05x the step time of credit=grpo: **not met** (1.10x; 0.05 over)" in real_md
    assert "credit=grpo at least 1.5x TRL's samples/s: **not met** (1.20x; 0.30 short)" in real_md
    assert "Prompt ids after the chat template: the same on both sides" in real_md


def test_committed_markdown_is_what_its_results_file_renders():
    """results/bench/*.md are rendered from the JSON next to them (the testbed's as it always
    was, plus the side-by-side section once the real model has results)."""
    res = {k: load_results(OUT, k) for k in SCALES}
    assert all(r is not None for r in res.values()), "results/bench lacks a scale's results file"
    for k, other in (("testbed", "real"), ("real", "testbed")):
        assert render(res[k], res[other]) == (OUT / f"{SCALES[k].stem}.md").read_text(), k



def test_notes_template_gives_the_notes_of_the_committed_runs():
    """notes.md, read with the reward callable's place as it was (scripts/bench.py) or as it is now,
    gives each scale's notes exactly as the committed results files hold them; a new run gets its place now."""
    old, now = read_notes(values={"rm_reward": "`RMReward` in scripts/bench.py"}), read_notes()
    for k in SCALES:  # each committed file from before the move or after it
        assert load_results(OUT, k)["notes"] in (list(old[k]), list(now[k])), k
    assert all("`RMReward` in scripts/bench/trl_side.py" in " ".join(SCALES[k].notes) for k in SCALES)

# ---- this project's side: its step with a forced length, and with a given rollout -----------------


@pytest.mark.slow
def test_datc_side_steps_are_the_trainers_own(cache_dir, tmp_path):
    """``datc_side.step`` with ``min_new_tokens`` is ``train_step`` with every sampling call given
    ``min_new_tokens`` (here two calls per step), and ``datc_side.learn`` on a rollout is
    ``train_step`` with that rollout as its sample: the same metrics, timings aside."""
    import functools

    from datc.checks import validate
    from datc.step import train_step
    from datc.step.ops import StepOps
    from datc.training.session import build_session
    from scripts.bench.datc_side import learn, step
    from tests.helpers.testbed import cfg_for

    def session(credit, *overrides, ops=None):
        return build_session(validate(cfg_for(cache_dir, tmp_path / "unused", f"credit={credit}", *overrides)),
                             ops=ops)

    def timeless(m):
        return {k: v for k, v in m.items() if not k.startswith("perf/")}

    T = session("grpo").c.trainer.max_new_tokens
    torch.manual_seed(3)
    assert train_step(session("grpo"), 0).metrics["rollout/response_len"] < T  # unforced, some responses end early
    for credit in ("grpo", "datc"):
        split = "trainer.generation_batch_size=4"  # one group per sampling call: two calls per step
        torch.manual_seed(3)
        ours = timeless(step(session(credit, split), 0, T))
        forced = StepOps(sample=functools.partial(sample_groups, min_new_tokens=T))
        torch.manual_seed(3)
        theirs = timeless(train_step(session(credit, split, ops=forced), 0).metrics)
        assert ours == theirs, credit
        assert ours["rollout/response_len"] == T
    s = session("grpo")
    t = s.c.trainer
    torch.manual_seed(5)
    ro = sample_groups(s.m.policy, s.m.tok, [s.assets.train[i] for i in s.sampler.indices(0)], t.num_generations,
                       t.max_new_tokens, encoder=s.m.encoder)
    ours = timeless(learn(s, 0, ro))
    theirs = timeless(train_step(session("grpo", ops=StepOps(sample=lambda *a, **k: ro)), 0).metrics)
    assert ours == theirs


def test_the_median_interval_is_the_sign_test_one():
    from scripts.bench.stats import median_interval

    # n = 6: P(B <= 0) = 1/64 <= 0.025 < P(B <= 1) = 7/64, so k = 1: the extremes (coverage 1 - 2/64)
    assert median_interval([5.0, 1.0, 3.0, 2.0, 6.0, 4.0]) == (1.0, 6.0)
    assert median_interval([1.0, 2.0, 3.0, 4.0, 5.0]) is None  # n = 5: P(B <= 0) = 1/32 > 0.025
    # n = 20: P(B <= 5) = 0.0207 <= 0.025 < P(B <= 6) = 0.0577, so k = 6: the 6th and 15th values
    xs = [float(i) for i in range(1, 21)]
    assert median_interval(xs) == (6.0, 15.0)
    s = spread(xs)
    assert (s["ci_low"], s["ci_high"]) == (6.0, 15.0) and s["ci_rel"] == pytest.approx(4.5 / 10.5)  # the median 10.5: 4.5 on the lower side


def test_the_load_lines_flag_a_moved_repeat_and_restate_the_ratios_without_it():
    from scripts.bench.render import _load_lines

    steady = {"grpo_over_trl_samples_per_s": spread([1.5, 1.6]), "datc_over_grpo_step_s": spread([1.1, 1.2])}
    th = {"load_per_repeat": [{"start": 0.5, "end": 0.7, "flagged": False}, {"start": 0.7, "end": 2.1, "flagged": True},
                              {"start": 2.1, "end": 2.0, "flagged": False}],
          "until": 0.05, "repeats_run": 3, "measure_s": 12.0, "steady": {"repeats": 2, **steady}}
    text = " ".join(_load_lines(th))
    assert "1 of 3 repeats flagged (the load moved by more than 1.0 during them): 1." in text
    assert "within ±5%, or the cap: 3 repeats, 12 s of blocks" in text
    assert "Over the 2 unflagged repeats: credit=grpo / TRL 1.55; credit=datc / credit=grpo 1.15." in text
    assert _load_lines({}) == []  # results from before the load was kept


@pytest.mark.parametrize("overrides", [[], ["policy=tiny_llama", "+reward.init=policy", "+reward.train.trainable_layers=1"]],
                         ids=["gpt2", "llama-shared-trunk"])
def test_the_flop_count_by_phase_covers_the_whole_step(cache_dir, tmp_path, overrides):
    """scripts/bench/flops.py counts each phase of the spine on its own; the phases add up to the
    count of the whole step (no matmul of the step falls outside them) and each one did work. With
    the shared trunk the reward model's input gradient is taken to a leaf (which torch's own
    FlopCounterMode's module hooks refuse)."""
    from datc.checks import validate
    from datc.training.session import build_session
    from scripts.bench.flops import PHASES, count_flops, flop_counter, mm_gflops, profile_ops
    from tests.helpers.testbed import cfg_for

    s = build_session(validate(cfg_for(cache_dir, tmp_path / "unused", "credit=datc", *overrides)))
    assert s.plan.trunk if overrides else True
    torch.manual_seed(0)
    with flop_counter() as whole:
        counts = count_flops(s, 0, s.c.trainer.max_new_tokens)
    assert set(counts) == set(PHASES) and all(counts[p] > 0 for p in PHASES), counts
    assert sum(counts.values()) == whole.get_total_flops()
    assert mm_gflops(64, 64, 64, threads=1, min_s=0.01, repeats=1) > 0
    ops = profile_ops(s, 1, 1, s.c.trainer.max_new_tokens)  # --ops: the profiler's ranges found every phase
    assert all(ops[p]["ops"] > 0 and ops[p]["profiled"] > ops[p]["matmul"] + ops[p]["attention"] + ops[p]["other"] > 0
               for p in PHASES), ops


def test_the_flops_table_is_flops_over_median_time_against_the_peak_by_hand():
    from scripts.bench.flops import table

    res = {"peaks": {"1": {"peak_gflops": 20.0}},
           "credits": {"grpo": {"flops": {"rollout": 2e9, "reward": 1e9, "credit": 0, "update": 3e9},
                                "time_s": {"1": {"rollout": [1.0, 3.0], "reward": [0.5, 0.5], "credit": [0.0, 0.0],
                                                 "update": [1.0, 2.0], "step": [3.0, 5.0]}}}}}
    rows = {r.split("|")[3].strip(): [c.strip() for c in r.strip("|").split("|")] for r in table(res).splitlines()[2:]}
    assert rows["rollout"][3:] == ["2.0", "2.00", "1.0", "5%"]  # 2 GFLOP over the median 2 s: 1 GFLOP/s of 20
    assert rows["update"][3:] == ["3.0", "1.50", "2.0", "10%"]
    assert rows["credit"][3:] == ["0.0", "0.00", "0.0", "0%"]  # no work in no time: zero, not a division error
    assert rows["step"][3:] == ["6.0", "4.00", "1.5", "8%"]  # the phases' 6 GFLOP over the median step


def test_operator_times_are_attributed_to_their_phase_by_hand():
    """scripts/bench/flops.py --ops: every aten event's own time goes to the phase range above it,
    by kind; only the operators called from outside another operator are counted as dispatched;
    events outside every phase range are left out; the time outside operators is the range's
    time less theirs."""
    from types import SimpleNamespace as E

    from scripts.bench.flops import op_times, ops_table

    def ev(name, parent=None, self_us=0.0, total_us=0.0):
        return E(name=name, cpu_parent=parent, self_cpu_time_total=self_us, cpu_time_total=total_us)

    roll, upd = ev("phase:rollout", total_us=10_000), ev("phase:update", total_us=6_000)
    lin = ev("aten::linear", roll, self_us=100)
    bwd = ev("autograd::engine::evaluate_function: AddmmBackward0", upd)
    events = [roll, upd, lin, ev("aten::addmm", lin, self_us=2_000),  # nested in linear: its time, not a dispatch
              ev("aten::_scaled_dot_product_flash_attention_for_cpu", roll, self_us=1_000),
              ev("aten::gelu", roll, self_us=500), ev("aten::mm", bwd, self_us=3_000),  # backward: under the update
              ev("aten::add", None, self_us=9_999), bwd,  # outside every phase: left out
              ev("rollout", total_us=99_000)]  # a range not named phase:<phase> is no phase's time
    t = op_times(events)
    assert t["rollout"] == {"ops": 3, "matmul": 2.1, "attention": 1.0, "other": 0.5, "profiled": 10.0}
    assert t["update"] == {"ops": 1, "matmul": 3.0, "attention": 0.0, "other": 0.0, "profiled": 6.0}
    assert t["reward"]["ops"] == 0 and t["reward"]["profiled"] == 0.0

    res = {"credits": {"grpo": {"ops": t, "ops_threads": 1, "time_s": {"1": {
        "rollout": [0.008], "reward": [0.0], "credit": [0.0], "update": [0.005], "step": [0.013]}}}}}
    rows = {r.split("|")[2].strip(): [c.strip() for c in r.strip("|").split("|")] for r in ops_table(res).splitlines()[2:]}
    assert rows["rollout"][2:] == ["8.0", "10.0", "3", "2.1", "1.0", "0.5", "6.4 (64%)"]
    assert rows["update"][2:] == ["5.0", "6.0", "1", "3.0", "0.0", "0.0", "3.0 (50%)"]
    assert rows["reward"][-1] == "0.0 (-)"  # no range, no share
    assert rows["the four phases"][2:] == ["13.0", "16.0", "4", "5.1", "1.0", "0.5", "9.4 (59%)"]


def test_the_compile_probe_times_both_passes_and_renders_their_ratio():
    """scripts/bench/compile_probe.py: the no-grad forward returns the logits, the forward and
    backward leaves no gradient behind (each timed call starts alike); the table shows the ratio."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from scripts.bench.compile_probe import markdown, passes

    torch.manual_seed(0)
    m = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=8, n_positions=16, vocab_size=11))
    ids, mask = torch.randint(0, 11, (3, 5)), torch.ones(3, 5, dtype=torch.bool)
    p = passes(m, ids, mask)
    assert p["forward"]().shape == (3, 5, 11)
    p["forward_backward"]()
    assert all(q.grad is None for q in m.parameters())
    res = {"command": "c", "commit": "abc", "date": "d", "machine": {"torch": "t", "cpus": 2}, "threads": 1,
           "shape": "3 rows", "repeats": 3, "calls": 2, "max_abs_diff": 1e-6,
           "load_average_1_5_15min": {"start": [0.1], "end": [0.2]},
           "passes": {"forward": {"eager_ms": 2.0, "compiled_ms": 1.0, "ratio": 2.0, "ratio_q1": 1.9, "ratio_q3": 2.1,
                                  "compile_s": 3.0}}}
    assert "| forward | 2.00 | 1.00 | **2.00** (1.90 to 2.10) | 3.0 |" in markdown(res)


@pytest.mark.slow
def test_the_job_memory_probe_runs_jobs_in_one_process_and_finds_none_of_them_alive(cache_dir, tmp_path):
    # scripts/bench/job_memory.py: what a sweep's jobs leave in their process (a job's objects
    # alive after it would be one cause; results/bench/job_memory_vllm.md measures the other).
    from scripts.bench.job_memory import main

    assert main(["--jobs", "2", "--out", str(tmp_path), "debug=fast", f"cache_dir={cache_dir}", "trainer.steps=1"]) == 0
    res = json.loads((tmp_path / "job_memory_torch.json").read_text())
    assert [r["job"] for r in res["jobs"]] == [0, 1] and all(r["alive"] == [] for r in res["jobs"])
    assert all(0 < r[k]["VmRSS"] < 64 for r in res["jobs"] for k in ("start", "built", "end"))  # GB, read from /proc
    assert res["rss_growth_gb_per_job"] == res["jobs"][1]["end"]["VmRSS"] - res["jobs"][0]["end"]["VmRSS"]
    assert "| 1 |" in (tmp_path / "job_memory_torch.md").read_text()


def test_the_memory_trace_slope_is_least_squares_by_hand():
    from scripts.bench.memory_trace import slope

    assert slope([1.0, 2.0, 3.0], [10.0, 12.0, 14.0]) == 2.0
    assert slope([1.0, 2.0, 3.0, 4.0], [5.0, 5.0, 5.0, 5.0]) == 0.0
    assert slope([1.0, 2.0, 3.0], [0.0, 3.0, 3.0]) == 1.5  # ((-1)(-2) + 0 + (1)(1)) / 2


@pytest.mark.slow
def test_the_memory_trace_reads_each_steps_resident_set_and_samples_the_process_tree(cache_dir, tmp_path):
    # scripts/bench/memory_trace.py: a run in a child process, its steps' perf/rss_gb and the
    # process tree's samples; the summary's slope over the second half of the steps.
    from scripts.bench.memory_trace import main

    assert main(["--name", "t", "--steps", "4", "--out", str(tmp_path), "debug=fast", f"cache_dir={cache_dir}"]) == 0
    res = json.loads((tmp_path / "memory_trace_t.json").read_text())
    assert [r["step"] for r in res["steps"]] == [1, 2, 3, 4]
    assert all(0.05 < r["rss_gb"] <= r["peak_gb"] < 64 for r in res["steps"])  # VmRSS never above VmHWM
    assert res["samples"] and all(s["processes"] >= 1 and s["tree_rss_mb"] > 0 for s in res["samples"])
    s = res["summary"]
    assert s["steps"] == 4 and s["rss_last_gb"] == res["steps"][-1]["rss_gb"]
    mb = [r["rss_gb"] * 1024 for r in res["steps"][2:]]
    assert s["second_half_slope_mb_per_step"] == pytest.approx(mb[1] - mb[0])
    # each sample knows how many step lines had landed: they never go back, and the last is every step
    done = [x["steps_done"] for x in res["samples"]]
    assert done == sorted(done) and done[0] == 0 and set(done) <= set(range(5))
    assert "slope" in (tmp_path / "memory_trace_t.md").read_text()


def test_the_memory_trace_reads_peaks_and_floors_per_step_and_per_window(tmp_path, capsys):
    # The tree's samples grouped by the step they fell in (steps_done = k - 1) and by time windows;
    # a rising floor is what tells a creep from a noisy peak's new records.
    from scripts.bench.memory_trace import main, per_step, summarize, windows

    samples = [{"t_s": float(t), "tree_rss_mb": mb, "processes": 1, "steps_done": d}
               for t, mb, d in [(0, 10, 0), (1, 500, 0), (2, 900, 1), (3, 700, 1), (4, 950, 2), (5, 720, 2), (6, 980, 3)]]
    assert per_step(samples, 3) == [{"step": 1, "peak_mb": 500, "floor_mb": 10, "samples": 2},
                                    {"step": 2, "peak_mb": 900, "floor_mb": 700, "samples": 2},
                                    {"step": 3, "peak_mb": 950, "floor_mb": 720, "samples": 2}]
    assert per_step([{k: v for k, v in x.items() if k != "steps_done"} for x in samples], 3) == []  # an old trace
    assert windows(samples, 3.0) == [{"start_s": 0.0, "peak_mb": 900, "floor_mb": 10, "samples": 3},
                                     {"start_s": 3.0, "peak_mb": 950, "floor_mb": 700, "samples": 3},
                                     {"start_s": 6.0, "peak_mb": 980, "floor_mb": 980, "samples": 1}]
    rows = [{"step": k, "rss_gb": 0.5, "peak_gb": 1.0, "step_s": 1.0} for k in (1, 2, 3, 4)]
    more = samples + [{"t_s": 7.0, "tree_rss_mb": 990, "processes": 1, "steps_done": 3}]
    s = summarize({"steps": rows, "samples": more})  # second half: steps 3 and 4
    assert s["tree_step_peak_slope_mb_per_step"] == pytest.approx(990 - 950)
    assert s["tree_step_floor_slope_mb_per_step"] == pytest.approx(980 - 720)
    (tmp_path / "t.json").write_text(json.dumps({"samples": samples}))
    assert main(["--windows", str(tmp_path / "t.json"), "--width", "3", "--skip", "0"]) == 0
    out = capsys.readouterr().out
    assert "| 3 | 0.93 | 0.68 | 3 |" in out  # GB
    # (950 - 900) MB and (700 - 10) MB over 3 s, in MB an hour; the last window (the run's end) left out
    assert "the 2 windows from 0 s to the last: highest +60000 MB an hour, lowest +828000 MB an hour" in out


def test_the_prepared_files_check_passes_on_its_own_pin_and_names_a_changed_file(cache_dir, tmp_path, capsys):
    # scripts/dev/prepared_hashes.py: the full-size real prepare's pin (results/real_model/prepared.json)
    # is checked by the same functions, here on the testbed's assets
    from scripts.dev.prepared_hashes import main

    pin = tmp_path / "prepared.json"
    args = ["--pinned", str(pin), "debug=fast", f"cache_dir={cache_dir}"]
    assert main(["--write", *args]) == 0
    pinned = json.loads(pin.read_text())
    assert set(pinned["files"]) == {"data/train.jsonl", "data/eval.jsonl", "policy/model.safetensors", "policy/config.json",
                                    "reward/model.safetensors", "reward/config.json"}
    assert all(len(sha) == 64 for sha in pinned["files"].values()) and "heldout_within_group_corr" in pinned["rm_report"]
    assert {"cpu_vendor", "cpu_model"} <= set(pinned["machine"])  # the machine kind the bits are (docs/real-models.md)
    # beside each sha256, the hash a run's inputs.json records (the whole file here: the testbed's files are small)
    assert set(pinned["run_hashes"]) == set(pinned["files"])
    assert all(r == {"sha256": pinned["files"][n], "hashed": "whole"} for n, r in pinned["run_hashes"].items())
    assert main(args) == 0
    changed = json.loads(json.dumps(pinned))
    changed["files"]["reward/model.safetensors"] = "0" * 64
    pin.write_text(json.dumps(changed))
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "reward/model.safetensors" in err and "this machine: {'cpu_vendor'" in err
    changed = json.loads(json.dumps(pinned))
    changed["run_hashes"]["policy/model.safetensors"]["sha256"] = "1" * 64
    pin.write_text(json.dumps(changed))
    assert main(args) == 1
    assert "policy/model.safetensors: run-record hash (whole)" in capsys.readouterr().err


@pytest.mark.slow
def test_the_dtype_bench_interleaves_float32_and_bfloat16_sessions(cache_dir, tmp_path):
    # scripts/bench/cpu_dtype.py: two sessions, policy.dtype float32 and bfloat16, steps interleaved;
    # per phase the medians and the float32 / bfloat16 ratio (whichever way it goes on this CPU)
    from scripts.bench.cpu_dtype import PHASES, main

    assert main(["--name", "t", "--steps", "2", "--out", str(tmp_path), "debug=fast", f"cache_dir={cache_dir}"]) == 0
    res = json.loads((tmp_path / "cpu_dtype_t.json").read_text())
    s = res["summary"]
    for d in ("float32", "bfloat16"):
        assert all(len(res["all"][d][p]) == 2 for p in PHASES)  # the warm-up step left out
        assert s[d]["step_s"]["min"] <= s[d]["step_s"]["median"] <= s[d]["step_s"]["max"]
        assert s[d]["step_s"]["median"] >= s[d]["rollout_s"]["median"] > 0 and s[d]["response_len"]["median"] > 0
    ratio = s["float32_over_bfloat16"]["step_s"]
    assert ratio == pytest.approx(s["float32"]["step_s"]["median"] / s["bfloat16"]["step_s"]["median"]) and ratio > 0
    assert f"| float32 / bfloat16 | {ratio:.2f} |" in (tmp_path / "cpu_dtype_t.md").read_text()
    with pytest.raises(SystemExit):  # the script sets the dtype itself
        main(["--name", "t", "--out", str(tmp_path), "debug=fast", "policy.dtype=float32"])


@pytest.mark.slow
def test_the_push_probe_reads_the_resident_set_after_each_call_of_each_phase(cache_dir, tmp_path):
    # scripts/bench/vllm_push.py through the built-in engine (its push is the trainer's own weights,
    # the same calls as vLLM's): every phase's calls in a row, the growth and its slope after warm-up
    from scripts.bench.vllm_push import PHASES, growth, main

    assert main(["--name", "t", "--calls", "3", "--out", str(tmp_path), "debug=fast", f"cache_dir={cache_dir}"]) == 0
    res = json.loads((tmp_path / "vllm_push_t.json").read_text())
    assert [(r["phase"], r["call"]) for r in res["rows"]] == [(p, i) for p in PHASES for i in (1, 2, 3)]
    assert all(0 < r["rss_mb"] <= r["hwm_mb"] for r in res["rows"])
    for p in PHASES:
        rows = [r for r in res["rows"] if r["phase"] == p]
        assert res["growth"][p]["first_to_last_mb"] == pytest.approx(rows[-1]["rss_mb"] - rows[0]["rss_mb"])
    assert "| push_then_sample | 3 |" in (tmp_path / "vllm_push_t.md").read_text()
    rows = [{"phase": "push", "call": k, "rss_mb": mb, "call_s": 1.0} for k, mb in [(1, 100.0), (2, 150.0), (3, 160.0), (4, 170.0), (5, 180.0)]]
    g = growth(rows, "push")  # the first two calls are the warm-up: 160, 170, 180 after them
    assert g["first_to_last_mb"] == 80.0 and g["slope_mb_per_call"] == pytest.approx(10.0) and g["calls"] == 5
    # --account --trim: each reading after malloc_trim, with the reachable tensors' MB and the objects
    assert main(["--name", "a", "--calls", "3", "--phases", "push_then_sample", "--account", "--trim", "--out", str(tmp_path),
                 "debug=fast", f"cache_dir={cache_dir}"]) == 0
    res = json.loads((tmp_path / "vllm_push_a.json").read_text())
    assert res["trim"] is True and all(r["tensor_mb"] > 0 and r["objects"] > 1000 for r in res["rows"])
    assert "tensors (MB) | objects |" in (tmp_path / "vllm_push_a.md").read_text()
    with pytest.raises(SystemExit):
        main(["--name", "t", "--calls", "2", "debug=fast"])
    with pytest.raises(SystemExit):
        main(["--name", "t", "--phases", "push,pull", "debug=fast"])


def test_the_reachable_tensors_count_a_new_storage_once_however_many_views():
    import torch

    from scripts.bench.vllm_push import reachable

    before, _ = reachable()
    x = torch.ones(4 * 2**20 // 4 * 8)  # 32 MB
    views = [x[1:], x.view(8, -1), x[::2]]  # noqa: F841  (kept alive: the same storage three more times)
    after, _ = reachable()
    assert after - before == pytest.approx(32.0, abs=1.0)
    import gc

    gc.freeze()  # as vLLM does once its engine is up: still counted, and frozen again after the reading
    try:
        assert reachable()[0] == pytest.approx(after, abs=1.0) and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
    del x, views


def test_the_dtype_bench_ratio_is_float32_over_bfloat16_and_skips_phases_timed_under_10_ms():
    from scripts.bench.cpu_dtype import summarize

    times = {"float32": {"step_s": [4.0, 6.0, 5.0], "rollout_s": [2.0, 2.0, 2.0], "reward_s": [1.0, 1.0, 1.0],
                         "credit_s": [0.002, 0.001, 0.003], "update_s": [1.0, 3.0, 2.0], "response_len": [8.0, 8.0, 8.0]},
             "bfloat16": {"step_s": [2.0, 3.0, 2.5], "rollout_s": [1.0, 1.0, 1.0], "reward_s": [0.5, 0.5, 0.5],
                          "credit_s": [0.001, 0.001, 0.001], "update_s": [1.0, 1.0, 1.0], "response_len": [8.0, 8.0, 8.0]}}
    s = summarize(times)
    assert s["float32"]["step_s"] == {"median": 5.0, "min": 4.0, "max": 6.0}
    assert s["float32_over_bfloat16"] == {"step_s": 2.0, "rollout_s": 2.0, "reward_s": 2.0, "update_s": 2.0}  # 5/2.5, 2/1, 1/0.5, 2/1


def test_the_onednn_cache_bench_tabulates_each_capacity_and_refuses_a_bad_one(capsys):
    # the child needs vLLM's CPU ops (.venv-vllm); the table and the argument check do not
    from scripts.bench.onednn_cache import main as bench
    from scripts.bench.onednn_cache import markdown

    run = {"handlers": 120, "base_mb": 900.0, "grown_mb": [[40, 122.0], [80, 238.4]], "first_pass_s": 43.6,
           "second_pass_s": 42.5, "after_second_mb": 240.0}
    res = {"command": "python -m scripts.bench.onednn_cache", "commit": "abc", "date": "d", "load_average": [1, 2, 3],
           "machine": {"torch": "2.13.0+cpu", "cpus": 2}, "ms": 80,
           "runs": {"default": run, "128": {**run, "grown_mb": [[40, 99.0], [80, 99.2]], "after_second_mb": 99.0}}}
    md = markdown(res)
    assert "| capacity | +MB at 40 row counts | +MB at 80 row counts | +MB after the second pass |" in md
    assert "| default | +122 | +238 | +240 | 43.6 | 42.5 |" in md and "| 128 | +99 | +99 | +99 |" in md
    with pytest.raises(SystemExit):
        bench(["--capacities", "default,-1"])
    assert "--capacities: -1: an integer >= 0 or default" in capsys.readouterr().err


def test_the_memory_trace_counts_no_exited_unreaped_process():
    # a run that has just exited is a zombie until reaped: its resident set reads 0, not a sample
    import os
    import subprocess
    import sys
    import time

    from scripts.bench.memory_trace import tree_rss_mb

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.time() + 30
        while tree_rss_mb(child.pid)[1] and time.time() < deadline:
            time.sleep(0.05)
        assert tree_rss_mb(child.pid)[1] == 0 and child.poll() is not None  # exited; not counted
    finally:
        child.wait()
    mb, n = tree_rss_mb(os.getpid())
    assert n >= 1 and mb > 1  # a living process is
