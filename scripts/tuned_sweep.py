"""The tuned comparison of METHOD §6 in resumable batches, one setting at a time.

    python -m scripts.tuned_sweep --policy tiny_gpt2 --data keywords --schemes grpo,datc --stage lr
    python -m scripts.tuned_sweep --policy tiny_gpt2 --data keywords --schemes grpo,datc --stage knob
    python -m scripts.tuned_sweep --policy tiny_gpt2 --data keywords --schemes grpo,datc --stage eval
    datc-compare --tuned runs/tuned --out results/tuned

Stages (``--stage all`` runs them in order):

- ``lr``: every scheme at its knob's default, the learning rate x0.5, x1, x2 of the setting's
  default, on the selection draw and seeds (one ``datc-train -m`` grid per group of schemes);
- ``knob``: at each scheme's chosen rate, its knob x0.5 and x2 (``tau`` for the schemes that share
  the weight step under its softmax, a peer's own knob otherwise: :func:`datc.study.reading.knob_for`);
- ``eval``: each scheme's chosen configuration on the evaluation draws and seeds, which the
  selection never saw, then the default configurations of the schemes whose choice moved
  (``--lane K/N`` splits the seeds among batches run side by side);
- ``kl``: the matched-KL control (:mod:`datc.study.matched`): for every scheme whose tuned gain
  over the tuned baseline is resolved, the baseline's rate searched on the selection seeds until
  its mean final KL is within ±20% of the scheme's (a few rounds, the rates tried kept in
  ``matched.json``), then that rate on the evaluation seeds into ``matched/`` (``--lane K/N``
  splits each round's selection seeds and the evaluation seeds; lane 0 chooses the rates, a lane
  with nothing to run waits for the others).

The grids are Hydra's basic sweeper (``-m`` with comma lists): each run's directory is named by
its config (``${datc.config_id:}``), so a killed batch run again skips the runs that finished and
resumes the one that was cut (``trainer.resume=auto``). The choice between stages is read from the
finished runs by :func:`datc.study.reading.read_setting`, the same code ``datc-compare --tuned``
reports with; a stage whose inputs are incomplete is refused in one line (exit 2) naming what is
missing. Every setting's protocol is kept in ``<root>/<data>-<policy>/tuning.json``; a later batch
with another protocol in the same folder is refused. Extra ``key=value`` arguments go to every
run (e.g. ``trainer.threads=1``, ``cache_dir=...``, ``debug=fast`` for a smoke test).
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

from datc.report.statistics import same_value
from datc.study.matched import (
    MATCHED_DIR,
    MAX_ROUNDS,
    matched_rows,
    propose_lr,
    read_search,
    within,
    write_search,
)
from datc.study.reading import (
    EVAL_DIR,
    KNOB_FACTORS,
    LR_FACTORS,
    MANIFEST,
    SELECT_DIR,
    TuningError,
    grid,
    knob_for,
    read_setting,
)

STAGES = ("lr", "knob", "eval", "kl")
RUN_NAME = "run_name=${data.name}-${policy.name}-${credit.name}-p${prepare_seed}-s${seed}-${datc.config_id:}"
POLL_S = 60.0  # --stage kl: how often a lane waiting for the others looks again
RESERVED = ("seed", "prepare_seed", "credit", "trainer.lr", "policy", "data", "experiment", "run_name", "run_dir", "hydra.sweep")


class Refused(Exception):
    """A batch that cannot run as asked: one line."""


def seeds(text: str) -> list[int]:
    """``100,101`` or ``200-205``."""
    out: list[int] = []
    for part in text.split(","):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b) + 1)) if b else [int(a)]
    return out


def lane(text: str) -> tuple[int, int]:
    """``K/N``: the k-th of every n evaluation seeds (0 <= k < n)."""
    k, _, n = text.partition("/")
    try:
        k_, n_ = int(k), int(n)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not K/N (e.g. 0/2)") from None
    if not 0 <= k_ < n_:
        raise argparse.ArgumentTypeError(f"{text!r}: K must be in 0..N-1")
    return k_, n_


def _num(x: float) -> str:
    return repr(float(x))


def scheme_spec(scheme: str, experiment: str, policy: str, data: str, extra: list[str]) -> dict[str, Any]:
    """The scheme's defaults in this setting (composed as the runs will be) and its two grids."""
    from hydra import compose, initialize_config_dir

    from datc.credit import CREDIT_SCHEMES
    from datc.paths import CONFIG_DIR

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="train", overrides=[f"experiment={experiment}", f"policy={policy}", f"data={data}",
                                                      f"credit={scheme}", *extra])
    credit = dict(cfg.credit)
    output = CREDIT_SCHEMES.get(str(credit.get("scheme", credit["name"]))).output
    knob = knob_for(credit, output)
    lr = float(cfg.trainer.lr)
    return {"lr": lr, "lr_grid": grid(lr, LR_FACTORS), "knob": f"credit.{knob}" if knob else None,
            "knob_default": float(credit[knob]) if knob else None,
            "knob_grid": grid(float(credit[knob]), KNOB_FACTORS) if knob else [], "output": output}


def rollout_engine(experiment: str, policy: str, data: str, extra: list[str]) -> str:
    """The runs' rollout engine (``rollout.name``), composed as the runs will be."""
    from hydra import compose, initialize_config_dir

    from datc.paths import CONFIG_DIR

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="train", overrides=[f"experiment={experiment}", f"policy={policy}", f"data={data}", *extra])
    return str(cfg.rollout.name)


def split_jobs(overrides: list[str]) -> list[list[str]]:
    """The jobs of one ``datc-train -m`` override list, each with one value per swept key, in
    Hydra's own order (its basic sweeper's ``split_arguments``): each then runs as a
    ``datc-train -m`` of one job in a process of its own, in the same run directory."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def write_manifest(folder: Path, new: dict[str, Any]) -> dict[str, Any]:
    """The setting's protocol, merged with the one its folder holds (schemes may be added; nothing
    else may change)."""
    path = folder / MANIFEST
    if path.exists():
        old = json.loads(path.read_text())
        for key in ("setting", "experiment", "overrides", "selection", "evaluation"):
            if old.get(key) != new[key]:
                raise Refused(f"{path} holds another protocol ({key}: {old.get(key)} here, {new[key]} asked); "
                              "a tuned sweep keeps its protocol: use another --root")
        for name, spec in new["schemes"].items():
            if name in old["schemes"] and old["schemes"][name] != spec:
                raise Refused(f"{path}: scheme {name}'s defaults or grids changed since its first batch "
                              f"({old['schemes'][name]} there, {spec} now); use another --root")
        new = {**old, "schemes": {**old["schemes"], **new["schemes"]}}
    from datc.atomic import atomic_write_json

    atomic_write_json(path, new)
    return new


def swept_groups(experiment: str) -> set[str]:
    """The config groups the experiment itself sweeps (its ``hydra.sweeper.params``): the setting
    replaces those lists; any other group is set by a plain override."""
    from omegaconf import OmegaConf

    from datc.paths import CONFIG_DIR

    params = OmegaConf.select(OmegaConf.load(Path(CONFIG_DIR) / "experiment" / f"{experiment}.yaml"),
                              "hydra.sweeper.params", default=None)
    return set(params or ())


def _base(m: dict[str, Any], folder: Path, where: str) -> list[str]:
    s, swept = m["setting"], swept_groups(m["experiment"])
    setting = [f"{'hydra.sweeper.params.' if g in swept else ''}{g}={s[g]}" for g in ("policy", "data")]
    return [f"experiment={m['experiment']}", *setting, RUN_NAME, f"hydra.sweep.dir={folder / where}", *m["overrides"]]


def _sel(m: dict[str, Any], seeds: list[int] | None = None) -> list[str]:
    """The selection draw and its seeds (``seeds``: these of them)."""
    return [f"prepare_seed={m['selection']['prepare_seed']}",
            "seed=" + ",".join(map(str, m["selection"]["seeds"] if seeds is None else seeds))]


def stage_commands(stage: str, m: dict[str, Any], folder: Path, schemes: list[str],
                   lane: tuple[int, int] = (0, 1)) -> list[list[str]]:
    """The ``datc-train -m`` override lists of one stage for ``schemes``; ``lane=(k, n)`` keeps the
    evaluation seeds k, k+n, k+2n... (n batches side by side, one per core, share the seeds)."""
    specs = {s: m["schemes"][s] for s in schemes}
    if stage == "lr":
        groups: dict[tuple[float, ...], list[str]] = {}
        for s, spec in specs.items():
            groups.setdefault(tuple(spec["lr_grid"]), []).append(s)
        return [[*_base(m, folder, SELECT_DIR), "credit=" + ",".join(ss), "trainer.lr=" + ",".join(map(_num, lrs)), *_sel(m)]
                for lrs, ss in groups.items()]
    st = read_setting(folder)
    cmds = []
    if stage == "knob":
        for s, spec in specs.items():
            if not spec["knob"]:
                continue
            lr = _chosen(st, s, "lr")
            values = [k for k in spec["knob_grid"] if k != spec["knob_default"]]
            cmds.append([*_base(m, folder, SELECT_DIR), f"credit={s}", f"trainer.lr={_num(lr)}",
                         f"{spec['knob']}=" + ",".join(map(_num, values)), *_sel(m)])
        return cmds
    tuned, moved = [], []  # every scheme's chosen configuration; the schemes whose choice is not their default
    for s, spec in specs.items():
        lr, knob = _chosen(st, s, "lr"), _chosen(st, s, "knob") if spec["knob"] else None
        if lr != spec["lr"] or knob != spec["knob_default"]:
            tuned.append([f"credit={s}", f"trainer.lr={_num(lr)}", *([f"{spec['knob']}={_num(knob)}"] if spec["knob"] else [])])
            moved.append(s)
        else:
            tuned.append([f"credit={s}"])
    # the chosen configurations first (the comparison's claim rests on them), then the default ones
    # of the schemes whose choice moved; each phase seed by seed, every scheme's runs at a seed one
    # after the other, so a batch cut between two seeds leaves whole chosen pairs. A later batch
    # whose prepare made other assets (a real model's reward model prepared again on another
    # machine) never splits a chosen pair; a default pair may span the two phases, and
    # datc.study.reading checks the chosen and the default pairs at a seed apart.
    at_seeds = [(draw, seed) for draw, ss in m["evaluation"]["seeds"].items() for seed in ss]
    at_seeds = at_seeds[lane[0]::lane[1]]
    for configs in (tuned, [["credit=" + ",".join(moved)]] if moved else []):
        for draw, seed in at_seeds:
            cmds += [[*_base(m, folder, EVAL_DIR), *c, f"prepare_seed={draw}", f"seed={seed}"] for c in configs]
    return cmds


class KlRound(NamedTuple):
    """One call of :func:`kl_round`: the commands to run now, and whether this lane waits for the
    others (a search rate whose other selection seeds another lane runs, or lane 0's next rate)."""

    cmds: list[list[str]]
    waiting: str | None  # what it waits for (None: nothing)


def kl_round(m: dict[str, Any], folder: Path, baseline: str, lane: tuple[int, int] = (0, 1)) -> KlRound:
    """One round of the matched-KL control: the baseline at a new rate on the selection seeds for
    each resolved gain without a matched rate yet, and the matched rates' evaluation runs not yet
    finished. No commands and nothing to wait for: nothing is left to run. ``lane=(k, n)``: the
    k-th of every n selection seeds of each searched rate and of the evaluation seeds, so n
    batches side by side share every round; lane 0 chooses each next rate (its rounds read the
    round before, complete on every selection seed) and keeps ``matched.json``, the other lanes
    read it and wait for it between rounds."""
    st = read_setting(folder)
    if baseline not in st.schemes:
        raise Refused(f"--stage kl: the baseline {baseline} is not a scheme of {folder / MANIFEST}")
    n_eval = sum(len(v) for v in m["evaluation"]["seeds"].values())
    if short := [s for s, sc in st.schemes.items() if sc.lr is None or len(sc.tuned) < n_eval]:
        raise Refused(f"--stage kl: the evaluation is not complete for {', '.join(short)} "
                      f"(of {n_eval} evaluation seeds); run --stage eval first (it resumes where it stopped)")
    search, cmds, asked, waiting = read_search(folder), [], [], None
    base = st.schemes[baseline]
    share = [int(x) for x in m["selection"]["seeds"]][lane[0]::lane[1]]  # this lane's selection seeds of a rate

    def search_cmd(lr: float) -> list[str] | None:  # this lane's unfinished selection runs at ``lr``
        c = base.find(lr, base.spec.get("knob_default"))
        left = [x for x in share if c is None or x not in c.seeds]
        return [*_base(m, folder, SELECT_DIR), f"credit={baseline}", f"trainer.lr={_num(lr)}", *_sel(m, left)] if left else None

    for row in sorted(matched_rows(st, baseline, st.matched), key=lambda r: r.target_kl):
        entry = search.setdefault(row.scheme, {"target_kl": row.target_kl, "tried": []})
        if row.lr is not None:
            if len(row.matched) < n_eval:
                at_seeds = [(draw, seed) for draw, ss in m["evaluation"]["seeds"].items() for seed in ss][lane[0]::lane[1]]
                for draw in dict.fromkeys(d for d, _ in at_seeds):
                    cmds.append([*_base(m, folder, MATCHED_DIR), f"credit={baseline}", f"trainer.lr={_num(row.lr)}",
                                 f"prepare_seed={draw}", "seed=" + ",".join(str(x) for d, x in at_seeds if d == draw)])
            continue
        if entry.get("stopped"):
            continue
        # a rate already asked for whose selection runs are not all finished: the round in flight
        flight = [lr for lr in entry["tried"] if not any(same_value(lr, x) for x, _ in row.tried)]
        if flight:
            if (cmd := search_cmd(flight[-1])) is not None:
                cmds.append(cmd)
            else:
                waiting = f"{row.scheme}: {baseline} at {flight[-1]:g} on the other lanes' selection seeds"
            continue
        if lane[0]:
            waiting = f"{row.scheme}: lane 0's next {baseline} rate"
            continue  # lane 0 chooses the rate
        if any(within(row.target_kl, t, 0.1) for t in asked):
            continue  # a target within ±10% of one searched for in this round waits for that round's runs
        asked.append(row.target_kl)
        lr = propose_lr(row.tried, row.target_kl)
        if any(abs(lr / x - 1) < 1e-6 for x, _ in row.tried):
            entry["stopped"] = msg = (f"the search for {baseline}'s rate at KL {row.target_kl:.3f} came back to a rate "
                                      f"it tried ({lr:g}) without a match")
            print(f"tuned_sweep: warning: {st.setting}, {row.scheme}: {msg}: stopped", file=sys.stderr)
            continue
        if len(entry["tried"]) >= MAX_ROUNDS:
            entry["stopped"] = msg = f"no {baseline} rate within ±20% of KL {row.target_kl:.3f} in {MAX_ROUNDS} rounds"
            print(f"tuned_sweep: warning: {st.setting}, {row.scheme}: {msg}: stopped", file=sys.stderr)
            continue
        entry["tried"].append(lr)
        if (cmd := search_cmd(lr)) is not None:
            cmds.append(cmd)
    search["baseline"] = baseline  # the scheme the control ran at other rates (datc-compare shows it against that one)
    if not lane[0]:  # the search's file is lane 0's: another lane writing it back could drop a rate lane 0 added
        write_search(folder, search)
    return KlRound([c for i, c in enumerate(cmds) if c not in cmds[:i]], waiting)


def prune_checkpoints(folder: Path) -> int:
    """Removes the ``checkpoints/`` of every finished run (its ``summary.json`` written) under
    ``folder``'s stage folders; returns how many. A finished run never resumes, and the tables read
    its ``summary.json``, ``run.json`` and ``inputs.json``; its ``final/`` weights stay. At the real
    scale a run's two kept checkpoints take about 3 GB (a real-model batch filled a disk). Lanes
    run side by side prune the same folder: a file another lane removed first is no error."""
    def gone_already(_fn: Any, _path: str, exc: Any) -> None:  # rmtree's onexc (the error) or, before 3.12, onerror (exc_info)
        err = exc[1] if isinstance(exc, tuple) else exc
        if not isinstance(err, FileNotFoundError):
            raise err

    handler = {"onexc": gone_already} if sys.version_info >= (3, 12) else {"onerror": gone_already}  # onerror: deprecated in 3.12

    n = 0
    for d in (SELECT_DIR, EVAL_DIR, MATCHED_DIR):
        for run in sorted((folder / d).glob("*/")):
            if (run / "summary.json").is_file() and (run / "checkpoints").is_dir():
                shutil.rmtree(run / "checkpoints", **handler)
                n += 1
    return n


def _chosen(st, scheme: str, what: str) -> float:
    sc = st.schemes[scheme]
    value = sc.lr if what == "lr" else sc.knob
    if value is None:
        n = sum(len(c.seeds) for c in sc.candidates)
        step = "rate" if what == "lr" else "knob"
        raise Refused(f"{st.setting}, {scheme}: the {step} search is not complete ({n} selection run(s) finished); "
                      f"run --stage {'lr' if what == 'lr' else 'knob'} first (it resumes where it stopped)")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m scripts.tuned_sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", required=True, help="policy config (e.g. tiny_gpt2)")
    p.add_argument("--data", required=True, help="data config (e.g. keywords)")
    p.add_argument("--schemes", required=True, help="comma-separated credit configs, the baseline among them")
    p.add_argument("--stage", choices=[*STAGES, "all"], required=True)
    p.add_argument("--root", default="runs/tuned", help="the sweep's root; one folder per setting below it")
    p.add_argument("--experiment", default="four_settings")
    p.add_argument("--baseline", default="grpo", help="the scheme the matched-KL control (--stage kl) runs at other rates")
    p.add_argument("--select-draw", type=int, default=0, help="prepare_seed of the selection runs")
    p.add_argument("--select-seeds", type=seeds, default=seeds("100,101"))
    p.add_argument("--eval-draws", default="0,1,2", help="prepare_seeds of the evaluation, the seeds split evenly among them")
    p.add_argument("--eval-seeds", type=seeds, default=seeds("200-205"))
    p.add_argument("--lane", type=lane, default=(0, 1), metavar="K/N",
                   help="eval and kl stages: this batch's share of the evaluation seeds (the k-th of every n; "
                        "run n batches side by side, 0/2 and 1/2 on two cores); kl: also each searched rate's "
                        "selection seeds, lane 0 choosing the rates")
    p.add_argument("--keep-checkpoints", action="store_true",
                   help="keep finished runs' checkpoints (by default removed after each command: a finished run never resumes)")
    p.add_argument("--process-per-job", choices=["auto", "yes", "no"], default="auto",
                   help="run each job of a grid in a process of its own (auto: where the runs sample with vLLM, whose "
                        "compilation leaves about 0.1 GB behind in the process per job at the real scale)")
    p.add_argument("--dry-run", action="store_true", help="print the commands only")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="passed to every run")
    return p


def protocol(args: argparse.Namespace) -> dict[str, Any]:
    draws = [int(d) for d in args.eval_draws.split(",")]
    if len(args.select_seeds) < 2:
        raise Refused("--select-seeds: METHOD §6 selects on at least 2 seeds")
    if len(args.eval_seeds) % len(draws) or len(set(args.eval_seeds)) != len(args.eval_seeds):
        raise Refused(f"--eval-seeds: {len(args.eval_seeds)} distinct seeds do not split evenly over draws {draws}")
    if shared := sorted(set(args.select_seeds) & set(args.eval_seeds)):
        raise Refused(f"--eval-seeds shares seed(s) {', '.join(map(str, shared))} with --select-seeds "
                      "(METHOD §6: evaluate on fresh seeds)")
    if bad := [o for o in args.overrides if "=" not in o or o.split("=")[0].lstrip("+~").startswith(RESERVED)]:
        raise Refused(f"override {bad[0]!r}: not KEY=VALUE, or sets what the sweep sets ({', '.join(RESERVED)})")
    if args.lane[1] > 1 and args.stage not in ("eval", "kl"):
        raise Refused(f"--lane {args.lane[0]}/{args.lane[1]} splits the evaluation seeds: it is for --stage eval or kl, "
                      f"not {args.stage} (two lanes of a selection stage would run the same runs at once)")
    if args.lane[1] > len(args.eval_seeds):
        raise Refused(f"--lane {args.lane[0]}/{args.lane[1]}: more lanes than the {len(args.eval_seeds)} evaluation seeds")
    per = len(args.eval_seeds) // len(draws)
    extra = [o for o in args.overrides if not o.startswith("hydra")]
    schemes = [s for s in args.schemes.split(",") if s]
    return {
        "protocol": "METHOD §6", "setting": {"data": args.data, "policy": args.policy}, "experiment": args.experiment,
        "overrides": list(args.overrides),
        "selection": {"prepare_seed": args.select_draw, "seeds": args.select_seeds},
        "evaluation": {"seeds": {str(d): args.eval_seeds[i * per:(i + 1) * per] for i, d in enumerate(draws)}},
        "schemes": {s: scheme_spec(s, args.experiment, args.policy, args.data, extra) for s in schemes},
    }


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    folder = Path(args.root) / f"{args.data}-{args.policy}"
    try:
        new = protocol(args)
        if len(args.eval_seeds) < 6:
            print(f"tuned_sweep: warning: {len(args.eval_seeds)} evaluation seeds; METHOD §6 asks for at least 6 pairs",
                  file=sys.stderr)
        if not args.dry_run:
            folder.mkdir(parents=True, exist_ok=True)
        m = write_manifest(folder, new) if not args.dry_run else new
        per_job = args.process_per_job == "yes" or (args.process_per_job == "auto" and rollout_engine(
            args.experiment, args.policy, args.data, [o for o in args.overrides if not o.startswith("hydra")]) == "vllm")
        for stage in STAGES if args.stage == "all" else (args.stage,):
            if args.dry_run and stage != "lr":
                print(f"# stage {stage}: its commands depend on the finished runs of the stage before")
                continue
            if stage == "kl" and args.stage == "all" and args.baseline not in m["schemes"]:
                print(f"# stage kl: no matched-KL control without the baseline {args.baseline} in the sweep")
                continue
            rounds, said = 0, None
            while rounds < (MAX_ROUNDS + 2 if stage == "kl" else 1):  # kl: a round's choice reads the round before
                if stage == "kl":
                    cmds, waiting = kl_round(m, folder, args.baseline, args.lane)
                    if not cmds and waiting and not args.dry_run:  # another lane's runs of this round, or lane 0's next rate
                        if waiting != said:
                            print(f"tuned_sweep: lane {args.lane[0]}/{args.lane[1]}: waiting for {waiting}", flush=True)
                            said = waiting
                        time.sleep(POLL_S)
                        continue
                else:
                    cmds = stage_commands(stage, m, folder, list(new["schemes"]), args.lane)
                rounds += 1
                for overrides in (job for grid in cmds for job in (split_jobs(grid) if per_job else [grid])):
                    cmd = [sys.executable, "-m", "datc.train", "-m", *overrides]
                    print("datc-train -m " + " ".join(shlex.quote(o) for o in overrides), flush=True)
                    if not args.dry_run and (rc := subprocess.run(cmd).returncode):
                        print(f"tuned_sweep: a run of stage {stage} failed (exit {rc}); run the stage again to resume",
                              file=sys.stderr)
                        return rc
                    if not args.dry_run and not args.keep_checkpoints:
                        prune_checkpoints(folder)
                if not cmds:
                    break
    except (Refused, TuningError) as e:
        print(f"tuned_sweep: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
