"""Token-credit heatmaps and the shared credit-analysis helpers, on the tiny testbed: the page
shows every scheme and token with the right colours, the figure is a PNG, the helpers are
deterministic and complete, and the credit-accuracy command still runs on them. The schemes
shown are found (every credit config and registered scheme), never listed by hand."""

from __future__ import annotations

import dataclasses
import html
import json
import re

import pytest
import torch

from datc.analysis import credit_accuracy, heatmaps
from datc.analysis.inputs import credit_inputs, run_session
from datc.analysis.schemes import analysed_schemes, scheme_outputs
from datc.checks import validate
from datc.credit import CREDIT_SCHEMES
from datc.credit.base import NEEDS
from datc.credit.configs import credit_config_names
from datc.run.checkpoint import save_checkpoint
from datc.run.rundir import RunDir
from datc.training.lifecycle import resolved_config as _resolved
from datc.training.session import build_session
from tests.helpers.testbed import cfg_for

WHITE = "#ffffff"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SHOWN = analysed_schemes()


def test_the_schemes_are_every_credit_config_and_registered_scheme():
    assert set(SHOWN) == set(credit_config_names()) | set(CREDIT_SCHEMES.names())
    assert SHOWN[0] == "grpo" and SHOWN[1:] == sorted(SHOWN[1:])  # the uniform baseline first
    assert {"datc_identity", "datc_unsigned"} <= set(SHOWN) - set(CREDIT_SCHEMES.names())  # configs over datc
    assert analysed_schemes(uniform=False) == SHOWN[1:]


@pytest.fixture(scope="module")
def session(cache_dir, tmp_path_factory):
    s = build_session(validate(cfg_for(cache_dir, tmp_path_factory.mktemp("run"))))
    torch.manual_seed(s.c.seed)
    return s


@pytest.fixture(scope="module")
def shown(session):
    return heatmaps.shown_responses(session, 2)


@pytest.fixture(scope="module")
def page(shown):
    return heatmaps.render_html(shown, "test", heatmaps.scales_for(shown))


def _cells(page: str) -> dict[tuple[int, str], list[tuple[str, str, str]]]:
    """(response, row name) -> [(background, title, text)] per token cell, parsed from the page."""
    out = {}
    tables = re.findall(r'<table class="credit" data-response="(\d+)">(.*?)</table>', page, re.S)
    for k, table in tables:
        for name, row in re.findall(r'<tr data-row="([^"]*)"><th>[^<]*</th>(.*?)</tr>', table):
            out[int(k), html.unescape(name)] = re.findall(
                r'<td style="background:(#[0-9a-f]{6})[^"]*" title="([^"]*)">(.*?)</td>', row)
    return out


def test_page_shows_every_scheme_and_token_and_grpo_is_white(session, shown, page):
    assert len(shown) >= 2 and {r.label for r in shown} <= {"highest A", "lowest A", "all A equal"}
    cells = _cells(page)
    for name in [heatmaps.GOLD_ROW, *SHOWN]:
        assert f"<th>{html.escape(name)}</th>" in page
    for k, r in enumerate(shown):
        for name in [heatmaps.GOLD_ROW, *SHOWN]:
            # exactly the valid tokens, in order: no padding position is drawn
            assert [html.unescape(c[2]) for c in cells[k, name]] == r.tokens, (k, name)
        assert all(bg == WHITE for bg, _, _ in cells[k, "grpo"])
        assert all(title == "grpo: w = 1.0000" for _, title, _ in cells[k, "grpo"])
    assert html.escape(session.m.tok.pad_token) not in page
    assert "<eos>" not in page  # token text is escaped


def test_datc_colours_weights_above_and_below_one_apart(shown, page):
    cells = _cells(page)
    tokens = [(k, t, w) for k, r in enumerate(shown) for t, w in enumerate(r.weights["datc"])]
    above = [(k, t) for k, t, w in tokens if w > 1.1]
    below = [(k, t) for k, t, w in tokens if w < 0.9]
    assert above and below, "the tiny rollouts should give datc weights on both sides of 1"
    (ka, ta), (kb, tb) = above[0], below[0]
    hi, lo = cells[ka, "datc"][ta][0], cells[kb, "datc"][tb][0]
    assert WHITE not in (hi, lo) and hi != lo
    assert int(hi[1:3], 16) > int(hi[5:7], 16)  # above 1: red
    assert int(lo[5:7], 16) > int(lo[1:3], 16)  # below 1: blue


def test_command_reads_the_runs_own_config_and_writes_into_the_run(cache_dir, tmp_path, capsys):
    # A tiny-Llama debug run: nothing repeated on the command line. Without the run's own config
    # the script built a GPT-2 (a state_dict error) or the full testbed's assets (silently).
    run = tmp_path / "run"
    cfg = cfg_for(cache_dir, run, "policy=tiny_llama")
    RunDir.open(run, _resolved(cfg), "auto")  # config.yaml and run.json, as a run writes them
    trained = build_session(validate(cfg))
    with torch.no_grad():
        for p in trained.m.policy.parameters():
            p.add_(0.01)  # "trained": weights other than the warm start's
    save_checkpoint(run, 1, {"policy": trained.m.policy.state_dict()}, keep=1)

    s, ckpt = run_session(run, [])
    assert (s.c.policy.name, s.c.policy.warm_start.steps) == ("tiny_llama", 20)  # debug=fast's own warm start
    assert s.assets.policy_path == trained.assets.policy_path
    for name, p in s.m.policy.state_dict().items():
        assert torch.equal(p, trained.m.policy.state_dict()[name]), name

    heatmaps.main(["--run", str(run), "--examples", "1"])
    out = run / "heatmaps"  # the default: inside the run, not in the checkout
    page, png = out / "keywords-tiny_llama.html", out / "keywords-tiny_llama.png"
    assert str(page) in capsys.readouterr().out
    assert "step 1" in page.read_text()
    data = png.read_bytes()
    assert len(data) > 1000 and data.startswith(PNG_MAGIC)
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]
    for args, said in (([str(tmp_path / "none")], "no config.yaml"), ([str(run), "policy=tiny_gpt2"], "only plain fields")):
        with pytest.raises(SystemExit) as e:
            heatmaps.main(["--run", *args])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and err[0].startswith("datc-heatmaps: --run") and said in err[0], err


def test_png_titles_fit_the_figure(shown):
    long = [dataclasses.replace(r, prompt=r.prompt + " and a much longer prompt" * 6) for r in shown]
    title = "Token credit on keywords-tiny_gpt2 (run keywords-tiny_gpt2-grpo-s0-ca33da, step 80)" + " extra" * 20
    fig = heatmaps.figure(long, title, heatmaps.scales_for(long))
    fig.canvas.draw()
    box = fig.bbox
    texts = [fig._suptitle, *(ax._left_title for ax in fig.axes if ax._left_title.get_text())]
    assert len(texts) >= 1 + len(long)
    for t in texts:
        ext = t.get_window_extent()
        assert box.x0 - 1 <= ext.x0 and ext.x1 <= box.x1 + 1, (t.get_text()[:40], ext, box)


def test_credit_inputs_are_complete_and_scheme_outputs_deterministic(session):
    inputs = credit_inputs(session, [session.assets.eval[i] for i in range(2)], generator_seed=3)
    b, t = inputs.batch, session.c.trainer
    B, T = 2 * t.num_generations, t.max_new_tokens
    assert all(getattr(b, f) is not None for f in NEEDS)
    for x in (b.response_ids, b.response_mask, b.old_logps, b.entropy, inputs.gold_contrib):
        assert x.shape == (B, T)
    assert b.rm_grad.shape[:2] == b.policy_logits.shape[:2] == (B, T)
    assert inputs.advantages.shape == inputs.gold.shape == (B,)
    first, second = scheme_outputs(inputs, SHOWN), scheme_outputs(inputs, SHOWN)
    assert list(first) == SHOWN
    for name in SHOWN:
        assert torch.equal(first[name].weights, second[name].weights), name


def test_credit_accuracy_command_runs_on_the_shared_helpers(cache_dir, tmp_path):
    credit_accuracy.main(["--batches", "1", "--out", str(tmp_path), "debug=fast",
                          f"cache_dir={cache_dir}"])
    result = json.loads((tmp_path / "keywords-tiny_gpt2.json").read_text())
    assert list(result["schemes"]) == analysed_schemes(uniform=False)  # every scheme that ranks tokens
    assert result["command"] == f"datc-credit-accuracy --batches 1 --out {tmp_path} debug=fast cache_dir={cache_dir}"
    assert result["batches"] == 1 and sum(result["tokens"].values()) > 0
    md = (tmp_path / "keywords-tiny_gpt2.md").read_text()
    assert "| scheme | credit accuracy | minus datc | mean w, agree | mean w, neutral | mean w, disagree |" in md
    ident = result["schemes"]["datc_identity"]  # an interval over responses, a paired difference to datc
    assert ident["responses"] >= 2 and ident["interval95"] > 0 and len(ident["minus_datc"]) == 2
    assert result["schemes"]["datc"]["minus_datc"] is None
    # the second reference: the reward model's own counterfactual contributions, on the same responses
    ref = result["rm_counterfactual_reference"]
    assert ref["k"] == 16 and list(ref["schemes"]) == list(result["schemes"])
    assert ref["schemes"]["datc_identity"]["responses"] >= 2 and len(ref["schemes"]["p2t"]["minus_datc"]) == 2
    assert -1 <= ref["vs_gold"]["credit_accuracy"] <= 1 and ref["vs_gold"]["interval95"] > 0
    # two estimates of the same c_t from independent draws agree more than any first-order scheme does
    cf = ref["schemes"]["rm_counterfactual"]["credit_accuracy"]
    assert cf > 0.3 and cf > ref["schemes"]["datc"]["credit_accuracy"]
    assert "## Against the reward model's counterfactual contributions (K = 16 draws per token)" in md
    # the reference against gold is the oracle against the reference (Spearman is symmetric; oracle's sign(A)² = 1)
    assert ref["vs_gold"]["credit_accuracy"] == pytest.approx(ref["schemes"]["oracle"]["credit_accuracy"], abs=1e-12)


def test_cf_rows_restricts_the_counterfactuals_to_a_subset(cache_dir, tmp_path):
    """--cf-rows N: the reference and rm_counterfactual on the first N responses with A != 0 of
    each batch; the other schemes are judged against gold on every response, as without it."""
    base = ["--batches", "1", "--schemes", "datc_identity,rm_counterfactual,oracle", "--cf-k", "2",
            "debug=fast", f"cache_dir={cache_dir}"]
    credit_accuracy.main([*base, "--out", str(tmp_path / "all"), "--breakdown"])
    credit_accuracy.main([*base, "--out", str(tmp_path / "sub"), "--cf-rows", "3"])
    full, sub = (json.loads((tmp_path / d / "keywords-tiny_gpt2.json").read_text()) for d in ("all", "sub"))
    assert sub["cf_rows"] == 3 and full["cf_rows"] is None
    assert full["schemes"]["rm_counterfactual"]["responses"] > 3
    assert sub["schemes"]["rm_counterfactual"]["responses"] <= 3
    assert sub["rm_counterfactual_reference"]["responses"] <= 3 < full["rm_counterfactual_reference"]["responses"]
    for n in ("datc_identity", "rm_counterfactual", "oracle"):
        assert sub["rm_counterfactual_reference"]["schemes"][n]["responses"] <= 3
    for n in ("datc_identity", "oracle"):  # not editing: the same responses and numbers against gold
        assert sub["schemes"][n] == full["schemes"][n]
    md = (tmp_path / "sub" / "keywords-tiny_gpt2.md").read_text()
    assert "`--cf-rows 3`: the counterfactual reference and `rm_counterfactual` (" in md
    # --breakdown: by quintile of pi_old(y_t) and class, on the same tokens for every scheme; the oracle's
    # sign(A) s is the gold contribution itself, so its sign is right on every token that has one
    bd = full["breakdown"]
    assert len(bd["edges"]) == 4 and bd["tokens"] == sum(g["tokens"] for g in bd["schemes"]["oracle"]["by_quintile"])
    assert {g["sign_accuracy"] for g in bd["schemes"]["oracle"]["by_quintile"]} - {None} == {1.0}
    assert sum(g["gold_share"] for g in bd["schemes"]["datc_identity"]["by_quintile"]) == pytest.approx(1.0)
    assert (tmp_path / "all" / "keywords-tiny_gpt2-breakdown.png").stat().st_size > 0
    assert "## Where credit lands: by quintile of π_old(y_t)" in (tmp_path / "all" / "keywords-tiny_gpt2.md").read_text()
    assert "breakdown" not in sub
    with pytest.raises(SystemExit):
        credit_accuracy.main(["--cf-rows", "0"])


def test_an_unknown_scheme_is_refused_with_the_choices(capsys):
    with pytest.raises(SystemExit) as e:
        credit_accuracy.main(["--schemes", "datc,nope"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "datc-credit-accuracy: error: --schemes: nope not a credit config or registered scheme; choose from grpo, datc, " in err


COMMANDS = {"datc.analysis.heatmaps": "datc-heatmaps", "datc.analysis.credit_accuracy": "datc-credit-accuracy"}


@pytest.mark.parametrize("module", sorted(COMMANDS))
def test_each_command_runs_as_a_module(module):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith(f"usage: {COMMANDS[module]} "), r.stderr


def test_the_console_entry_points_name_the_commands():
    from pathlib import Path

    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert '\ndatc-heatmaps = "datc.analysis.heatmaps:main"\n' in pyproject
    assert '\ndatc-credit-accuracy = "datc.analysis.credit_accuracy:main"\n' in pyproject


def test_heatmaps_of_a_lora_run_and_an_edited_config_is_exit_2(cache_dir, tmp_path, capsys):
    # Before: ExportError "does not match the policy's architecture" (the checkpoint of a LoRA run
    # holds its adapters alone), and an edited config.yaml was refused with exit 1, not 2.
    from datc.models.lora import trained_state

    run = tmp_path / "lora"
    cfg = cfg_for(cache_dir, run, "policy.lora.r=4")
    RunDir.open(run, _resolved(cfg), "auto")
    trained = build_session(validate(cfg))
    assert trained.m.adapter is not None
    with torch.no_grad():
        for p in trained.m.policy.parameters():
            if p.requires_grad:  # the adapters (lora_B starts at 0: the adapted policy is the base)
                p.add_(0.05)
    state = trained_state(trained.m.policy, trained.m.policy.state_dict())
    assert state and all("lora_" in k for k in state)
    save_checkpoint(run, 1, {"policy": state}, keep=1)

    s, _ = run_session(run, [])
    own = s.m.policy.state_dict()
    for name, p in trained.m.policy.state_dict().items():  # adapters and base, as trained
        assert torch.equal(own[name], p), name
    heatmaps.main(["--run", str(run), "--examples", "1"])
    page = run / "heatmaps" / "keywords-tiny_gpt2.html"
    assert str(page) in capsys.readouterr().out and "step 1" in page.read_text()

    config = run / "config.yaml"
    config.write_text(config.read_text().replace("steps: 3", "steps: 30", 1))
    with pytest.raises(SystemExit) as e:
        heatmaps.main(["--run", str(run), "--examples", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert err[0].startswith(f"datc-heatmaps: --run: {config} was edited: it differs from run.json at trainer.steps"), err
