"""datc-study's refusals (one line, exit 2, before any run) and the continuation of a study made
under the fixed-grid protocol (results/tuned/records): its --plan adds only the missing bracket points."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from datc.study.cli import main as study

RECORDS = Path(__file__).resolve().parents[2] / "results" / "tuned" / "records"
ARGS = ["--policy", "tiny_gpt2", "--data", "keywords", "--eval-draws", "0", "--eval-seeds", "200,201"]


def run(argv, capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        study(argv)
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


@pytest.mark.parametrize("extra, says", [
    (["--schemes", "grpo,nonesuch"], "credit=nonesuch: no such option in credit/"),
    (["--schemes", "grpo", "--select-seeds", "100,200"], "shares seed(s) 200 with --select-seeds"),
    (["--schemes", "grpo", "--select-seeds", "100"], "at least 2 seeds"),
    (["--schemes", "grpo", "hydra/launcher=ray"], "hydra/launcher=ray: no such option in hydra/launcher"),
    (["--schemes", "grpo", "seed=3"], "sets what the study sets"),
    (["--schemes", "grpo,datc", "--kl-schemes", "datc,grpo"],
     "--kl-schemes: grpo: not among --schemes other than the baseline grpo (choose from datc)"),
])
def test_bad_input_is_one_line_exit_2_and_runs_nothing(extra, says, tmp_path, capsys):
    code, _, err = run([*ARGS, "--root", str(tmp_path), "--stage", "lr", *extra], capsys)
    assert code == 2 and says in err and len([ln for ln in err.splitlines() if ln.startswith("datc-study:")]) == 1, err
    assert not (tmp_path / "keywords-tiny_gpt2" / "select").exists()


def test_another_protocol_and_a_held_lock_are_refused(tmp_path, capsys):
    folder = tmp_path / "keywords-tiny_gpt2"
    folder.mkdir()
    m = json.loads((RECORDS / "keywords-tiny_gpt2" / "tuning.json").read_text())
    (folder / "tuning.json").write_text(json.dumps(m))
    code, _, err = run([*ARGS, "--root", str(tmp_path), "--schemes", "grpo", "--stage", "lr"], capsys)
    assert code == 2 and "holds another protocol (overrides:" in err
    from datc.study.launch import StudyLock

    lock = StudyLock(tmp_path / "arithmetic-tiny_gpt2")
    try:
        code, _, err = run(["--policy", "tiny_gpt2", "--data", "arithmetic", "--root", str(tmp_path), "--schemes", "grpo",
                            "--stage", "lr", "--eval-draws", "0", "--eval-seeds", "200,201"], capsys)
    finally:
        lock.close()
    assert code == 2 and "another datc-study is running on this setting" in err


def _as_fixed_grid(folder: Path) -> None:
    """The committed keywords / tiny GPT-2 study as the fixed grid left it: its selection runs on
    the ×0.5/×1/×2 grids only, the manifest without the bracketing search."""
    from datc.study.reading import same_value

    m = json.loads((folder / "tuning.json").read_text())
    m.pop("search", None)
    m.pop("continued_from", None)
    (folder / "tuning.json").write_text(json.dumps(m, indent=2))
    for d in ("eval", "matched"):
        shutil.rmtree(folder / d, ignore_errors=True)
    (folder / "matched.json").unlink(missing_ok=True)
    for run in (folder / "select").iterdir():
        ident = json.loads((run / "run.json").read_text())["identity"]
        spec = m["schemes"][ident["credit"]["name"]]
        knob = ident["credit"].get(spec["knob"].split(".", 1)[1]) if spec["knob"] else None
        on_grid = any(same_value(ident["trainer"]["lr"], x) for x in spec["lr_grid"]) and (
            knob is None or any(same_value(knob, x) for x in spec["knob_grid"]))
        if not on_grid:
            shutil.rmtree(run)


def test_a_fixed_grid_study_is_continued_with_only_its_missing_bracket_points(tmp_path, capsys):
    shutil.copytree(RECORDS / "keywords-tiny_gpt2", tmp_path / "keywords-tiny_gpt2")
    _as_fixed_grid(tmp_path / "keywords-tiny_gpt2")
    before = (tmp_path / "keywords-tiny_gpt2" / "tuning.json").read_bytes()
    m = json.loads(before)
    code, out, err = run(["--policy", "tiny_gpt2", "--data", "keywords", "--root", str(tmp_path), "--schemes", ",".join(m["schemes"]),
                          "--stage", "lr", "--plan", "trainer.threads=1"], capsys)
    assert code == 0, err
    assert "continued under METHOD §6's bracketing" in err
    line = next(ln for ln in out.splitlines() if "stage lr:" in ln)
    # every scheme whose best rate was x2 now needs x4 on both selection seeds, datc (best x0.5) x1/4
    assert line.startswith("  stage lr: 16 runs now (")
    assert "grpo lr ×4 ×2" in line and "oracle lr ×4 ×2" in line and "datc lr ×1/4 ×2" in line and "×1/2" not in line
    assert "core-hours" in out
    assert (tmp_path / "keywords-tiny_gpt2" / "tuning.json").read_bytes() == before  # --plan writes nothing
    assert not (tmp_path / "keywords-tiny_gpt2" / "study.jsonl").exists()


def test_the_studys_jobs_compose_to_the_records_run_directories(tmp_path):
    # the new command's job overrides name the same runs as the fixed-grid batches did (composition only)
    from hydra import initialize_config_dir

    from datc.paths import CONFIG_DIR
    from datc.study.jobs import base, config
    from datc.study.launch import Job, StudyLauncher
    from datc.study.reading import read_setting

    folder = RECORDS / "keywords-tiny_gpt2"
    m = json.loads((folder / "tuning.json").read_text())
    st = read_setting(folder)
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3", job_name="train"):
        launcher = StudyLauncher([], tmp_path)
        for scheme in ("grpo", "datc_identity"):
            sc = st.schemes[scheme]
            for c in sc.candidates[:2]:
                job = Job([*base(m, folder, "select"), *config(scheme, sc.spec, c.lr, c.knob), "prepare_seed=0",
                           f"seed={c.seeds[0]}"], scheme)
                assert launcher.run_dir(job).is_dir(), job.overrides
            r = sc.tuned[0]
            job = Job([*base(m, folder, "eval"), *config(scheme, sc.spec, sc.lr, sc.knob),
                       f"prepare_seed={json.loads((Path(r.source).parent / 'run.json').read_text())['identity']['prepare_seed']}",
                       f"seed={r.seed}"], scheme)
            assert launcher.run_dir(job).resolve() == Path(r.source).parent.resolve()


def test_the_matched_runs_of_every_rate_are_read_not_one_run_a_seed(tmp_path):
    # matched/ holds one rate per scheme whose gain was matched, each at every evaluation seed; the
    # reading keeps each rate's runs (it once kept one run a seed, the newest, across rates: the
    # other schemes' matched rates then read "not evaluated yet" with their runs on disk)
    import shutil

    from datc.study.reading import read_setting

    src = Path(__file__).resolve().parents[2] / "results" / "tuned" / "legacy_rm09ab3fe7" / "records" / "reviews-smollm2_135m_instruct"
    folder = tmp_path / src.name
    shutil.copytree(src, folder)
    before = read_setting(folder).matched
    assert len({lr for lr, _ in before}) == 1 and len(before) == 12
    for d in sorted((folder / "matched").iterdir()):  # the same seeds at a second rate
        twin = d.with_name(d.name + "-x2")
        shutil.copytree(d, twin)
        run = json.loads((twin / "run.json").read_text())
        run["identity"]["trainer"]["lr"] *= 2
        (twin / "run.json").write_text(json.dumps(run))
    after = read_setting(folder).matched
    lrs = sorted({lr for lr, _ in after})
    assert len(lrs) == 2 and lrs[1] == 2 * lrs[0]
    assert sorted(r.seed for lr, r in after if lr == lrs[1]) == sorted(r.seed for _, r in before)
    assert len(after) == 24


def test_a_job_past_submitits_time_limit_names_the_setting(tmp_path):
    # submitit ends a job at hydra.launcher.timeout_min (60 by default, the local executor's too)
    # and reports it as uncompleted; a real-model run under load can take longer
    from hydra import initialize_config_dir

    from datc.paths import CONFIG_DIR
    from datc.study.launch import StudyLauncher

    class UncompletedJobError(RuntimeError):  # submitit.core.utils's, by name
        pass

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3", job_name="train"):
        local = StudyLauncher(["hydra/launcher=submitit_local", "hydra.launcher.timeout_min=90"], tmp_path)
        basic = StudyLauncher([], tmp_path)
    hint = local._time_limit_hint(UncompletedJobError("Job 1 (task: 0) with path ..."))
    assert "hydra.launcher.timeout_min=90 minutes" in hint and "resumes from its last checkpoint" in hint
    assert local._time_limit_hint(RuntimeError("other")) == ""
    assert basic._time_limit_hint(UncompletedJobError("x")) == ""


def test_each_batch_of_finished_runs_gives_back_its_weights_before_the_next_starts(tmp_path):
    # a real run's checkpoints hold about 3 GB and its final policy 0.6 GB: removed once a round of
    # twelve had finished, they held 37 GB at once; now each batch's, before the next batch runs
    from hydra import initialize_config_dir

    from datc.paths import CONFIG_DIR
    from datc.study.launch import Job, StudyLauncher

    seen = []

    def fake_launch(overrides, idx):  # each job "finishes" with weights; note what the earlier ones still hold
        seen.append(sorted(str(p.relative_to(tmp_path)) for p in tmp_path.glob("r*/*") if p.is_dir()))
        for o in overrides:
            run = tmp_path / o[0]
            for w in ("checkpoints/step_0000004", "final"):
                (run / w).mkdir(parents=True)
            if o[0] != "r3":  # r3 is cut: it resumes, so it keeps its checkpoints
                (run / "summary.json").write_text("{}")
        return [None] * len(overrides)

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3", job_name="train"):
        for keep in (False, True):
            for p in tmp_path.glob("r*"):
                shutil.rmtree(p)
            launcher = StudyLauncher([], tmp_path, batch_size=2, keep_checkpoints=keep)
            launcher.launcher.launch, seen[:] = fake_launch, []
            jobs = [Job([f"r{i}"], f"run {i}", run_dir=tmp_path / f"r{i}") for i in range(4)]
            failed = launcher.launch(jobs)
            assert [j.label for j in failed] == ["run 3"]
            if keep:
                assert seen[1] == ["r0/checkpoints", "r0/final", "r1/checkpoints", "r1/final"]
            else:
                assert seen[1] == []  # the first batch's weights were gone when the second began
                assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.glob("r*/*") if p.is_dir()) == ["r3/checkpoints", "r3/final"]


def test_a_run_that_finished_under_a_stopped_driver_gives_back_its_weights_at_the_next_start(tmp_path, capsys):
    # the driver stopped while the other job of its batch ran: the finished run kept its weights, and a
    # stage with nothing left to run never reached the prune after a batch
    shutil.copytree(RECORDS / "keywords-tiny_gpt2", tmp_path / "keywords-tiny_gpt2")
    folder = tmp_path / "keywords-tiny_gpt2"
    runs = sorted((folder / "select").iterdir())[:2]
    for r in runs:
        (r / "checkpoints" / "step_0000040").mkdir(parents=True)
        (r / "final").mkdir()
    m = json.loads((folder / "tuning.json").read_text())
    argv = ["--policy", "tiny_gpt2", "--data", "keywords", "--root", str(tmp_path), "--schemes", ",".join(m["schemes"]),
            "--stage", "knob", "trainer.threads=1"]
    code, _, err = run([*argv, "--keep-checkpoints"], capsys)
    assert code == 0 and "0 to run" in err, err
    assert all((r / "checkpoints").is_dir() and (r / "final").is_dir() for r in runs)  # kept when asked
    code, _, err = run(argv, capsys)
    assert code == 0 and "0 to run" in err, err
    assert not any((r / "checkpoints").exists() or (r / "final").exists() for r in runs)
    assert all((r / "summary.json").is_file() and (r / "run.json").is_file() for r in runs)  # the records stay


def test_the_matched_kl_control_runs_for_a_scheme_asked_for_whatever_its_gain(tmp_path, capsys):
    # METHOD §6 controls every resolved gain; --kl-schemes adds a loss (datc's, on keywords / tiny
    # GPT-2): its search starts from GRPO's selection points, and the request is kept in matched.json
    import dataclasses

    from datc.study.jobs import kl_jobs
    from datc.study.matched import verdict
    from datc.study.protocol import Refused
    from datc.study.reading import read_setting

    folder = tmp_path / "keywords-tiny_gpt2"
    shutil.copytree(RECORDS / folder.name, folder)
    m = json.loads((folder / "tuning.json").read_text())
    st = read_setting(folder, m)
    assert "datc" not in [r.scheme for r in st.control("grpo")]
    assert kl_jobs(m, folder, st, "grpo", write=False) == ([], [])  # every resolved gain's control is done
    jobs, _ = kl_jobs(m, folder, st, "grpo", requested=("datc",))
    assert [j.label.rsplit(" seed ", 1)[0] for j in jobs] == ["grpo lr 0.000794 (KL search for datc)"] * 2
    assert all("credit=grpo" in j.overrides and "trainer.lr=0.000794" in j.overrides for j in jobs)
    log = json.loads((folder / "matched.json").read_text())
    assert log["requested"] == ["datc"] and log["datc"]["tried"] == [0.000794]
    st = read_setting(folder, m)  # remembered: the next round and the tables see it without the flag
    row = next(r for r in st.control("grpo") if r.scheme == "datc")
    assert not row.resolved and row.gain.diff.mean < 0 and row.credit_share is None and row.lr is None
    assert verdict(row) == "no matched rate found yet"
    with pytest.raises(Refused, match=r"--kl-schemes: nonesuch, grpo: not a scheme .* \(choose from "):
        kl_jobs(m, folder, st, "grpo", write=False, requested=("nonesuch", "grpo"))
    # the readings of a requested row: no gain to explain, so no "credit"/"step size" and no share
    done = next(r for r in st.control("grpo") if r.scheme == "oracle")  # matched and evaluated
    assert done.resolved and verdict(done).startswith("credit: the gain holds at matched KL") and done.credit_share > 0
    asked = dataclasses.replace(done, resolved=False)
    assert verdict(asked).startswith("above GRPO at matched KL") and asked.credit_share is None
    flat = dataclasses.replace(asked, vs_matched=dataclasses.replace(
        done.vs_matched, diff=dataclasses.replace(done.vs_matched.diff, mean=0.0)))
    assert verdict(flat).startswith("not resolved at matched KL")


def test_an_unresolved_difference_asked_for_is_not_bold(tmp_path):
    from datc.study.jobs import kl_jobs
    from datc.study.matched import matched_markdown
    from datc.study.reading import read_setting

    folder = tmp_path / "arithmetic-tiny_gpt2"
    shutil.copytree(RECORDS / folder.name, folder)
    m = json.loads((folder / "tuning.json").read_text())
    kl_jobs(m, folder, read_setting(folder, m), "grpo", requested=("oracle",))
    row = next(r for r in read_setting(folder, m).control("grpo") if r.scheme == "oracle")
    assert not row.resolved and not row.gain.significant
    line = next(ln for ln in matched_markdown([row], "grpo", 1e-3).splitlines() if ln.startswith("| oracle |"))
    assert line.split(" | ")[1] == f"{row.gain.diff.mean:+.3f} ± {row.gain.diff.half_width:.3f}"  # no bold


def test_the_tables_name_the_reward_model_each_evaluation_run_scored_with(tmp_path):
    # METHOD §6's tables name the reward model: its weights' hash as each run's inputs.json records it
    from datc.study.reading import read_setting, reward_models

    folder = tmp_path / "keywords-tiny_gpt2"
    shutil.copytree(RECORDS / folder.name, folder)
    runs = [r for sc in read_setting(folder).schemes.values() for r in sc.tuned]
    before = reward_models(runs)
    assert len(before) == 3 and sum(before.values()) == len(runs)  # three asset draws
    assert all(k.startswith("`") and len(k) == 14 for k in before)  # 12 hex digits, hashed whole
    (Path(runs[0].source).parent / "inputs.json").unlink()
    after = reward_models(runs)
    assert after["not recorded"] == 1 and sum(after.values()) == len(runs)


def test_the_power_of_each_matched_kl_control_is_stated_from_its_own_pairs(tmp_path):
    # issue: "state the power reached per comparison": the matched-KL row's pairs, not the tuned ones
    from datc.report.statistics import detectable_difference
    from datc.study.reading import read_setting
    from datc.study.tables import setting_markdown

    folder = tmp_path / "keywords-tiny_gpt2"
    shutil.copytree(RECORDS / folder.name, folder)
    st = read_setting(folder)
    md = setting_markdown(st, "grpo")
    rows = [r for r in st.control("grpo") if r.vs_matched is not None and r.vs_matched.seeds]
    assert rows
    for r in rows:
        d = r.vs_matched.diff
        assert f"- {r.scheme} − grpo at matched KL: {d.n} pairs, ±{d.half_width:.3f}; detectable: " \
               f"{detectable_difference(d):.3f}" in md
        assert d.half_width != r.gain.diff.half_width  # its own spread, not the tuned comparison's
