"""What a sweep's jobs leave behind in their process: ``--jobs`` training runs one after another
in one process, as ``datc-train -m`` runs them (Hydra's basic launcher), with the resident set
(VmRSS) and its high-water mark (VmHWM) at each job's start, after its set-up and at its end, and
whether any of the run's objects (session, policy, reference, reward model, engine) is still alive.

    DATC_CACHE=CACHE python -m scripts.bench.job_memory --jobs 3 experiment=real_smollm2 rollout=vllm \
        trainer.steps=1 trainer.eval_size=8
    -> results/bench/job_memory_<rollout>.json, results/bench/job_memory_<rollout>.md

A job that leaves memory behind makes every later job of the process start higher; a sweep of
many jobs per process then runs out of memory where each job alone fits. Run it in the
environment that has the engine (``.venv-vllm`` for ``rollout=vllm``).
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import weakref
from pathlib import Path
from typing import Any

from scripts.bench.render import write_result

OUT = Path("results/bench")


def memory_gb() -> dict[str, float]:
    """This process's resident set and its high-water mark, GB."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            out[line.split(":")[0]] = int(line.split()[1]) / 2**20
    return out


def run_jobs(overrides: list[str], jobs: int, root: Path) -> list[dict[str, Any]]:
    """``jobs`` runs of ``overrides`` (seeds 0, 1, ...) in this process; per job its memory at
    start, after the set-up and at the end, and which of its objects are alive after it."""
    from hydra import compose, initialize_config_dir

    import datc.training.trainer as trainer
    from datc.paths import CONFIG_DIR

    rows: list[dict[str, Any]] = []
    refs: list[dict[str, weakref.ref]] = []
    build = trainer.build_session

    def watched(*args, **kwargs):
        s = build(*args, **kwargs)
        refs.append({name: weakref.ref(x) for name, x in [("session", s), ("policy", s.m.policy), ("reference", s.m.ref),
                                                           ("reward model", s.m.rm), ("engine", s.engine)] if x is not None})
        rows[-1]["built"] = memory_gb()
        return s

    trainer.build_session = watched
    try:
        for job in range(jobs):
            with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
                cfg = compose(config_name="train", overrides=[*overrides, f"run_dir={root / f'job{job}'}", f"seed={job}"])
            rows.append({"job": job, "start": memory_gb()})
            trainer.train(cfg)
            gc.collect()
            rows[-1]["end"] = memory_gb()
            rows[-1]["alive"] = sorted({name for r in refs for name, ref in r.items() if ref() is not None})
    finally:
        trainer.build_session = build
    return rows


def markdown(res: dict[str, Any]) -> str:
    table = ["| job | RSS at start (GB) | after set-up | at end | high-water mark at end | objects of any run alive after it |",
             "|---|---|---|---|---|---|"]
    for r in res["jobs"]:
        table.append(f"| {r['job']} | {r['start']['VmRSS']:.2f} | {r['built']['VmRSS']:.2f} | {r['end']['VmRSS']:.2f} | "
                     f"{r['end']['VmHWM']:.2f} | {', '.join(r['alive']) or 'none'} |")
    la = res["load_average"]
    return f"""# What a sweep's jobs leave in their process: rollout={res['rollout']}

Written by `{res['command']}` (`scripts/bench/job_memory.py`) at commit `{res['commit']}` ({res['date']}),
torch {res['machine']['torch']}, {res['machine']['cpus']} CPUs; load average (1, 5, 15 min) {la} at the start.
Runs in one process, one after another, as `datc-train -m` runs a sweep's jobs.

{chr(10).join(table)}

Left in the process per job after the first: **{res['rss_growth_gb_per_job']:.2f} GB** of resident set,
**{res['hwm_growth_gb_per_job']:.2f} GB** of high-water mark (the mean over the jobs after the first).
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.bench.job_memory", description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=3)
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("overrides", nargs="*", help="hydra overrides of every job (e.g. experiment=real_smollm2 rollout=vllm)")
    a = ap.parse_args(argv)
    if a.jobs < 2:
        ap.error("--jobs: at least 2 (what a job leaves shows in the next one)")
    from hydra import compose, initialize_config_dir

    from datc.paths import CONFIG_DIR
    from datc.run.provenance import provenance

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        rollout = str(compose(config_name="train", overrides=list(a.overrides)).rollout.name)
    res: dict[str, Any] = {**provenance(" ".join(["python -m scripts.bench.job_memory", *(argv if argv is not None else sys.argv[1:])])),
                           "rollout": rollout}
    with tempfile.TemporaryDirectory(prefix="datc-job-memory-") as root:
        res["jobs"] = run_jobs(list(a.overrides), a.jobs, Path(root))
    ends = [r["end"] for r in res["jobs"]]
    res["rss_growth_gb_per_job"] = (ends[-1]["VmRSS"] - ends[0]["VmRSS"]) / (len(ends) - 1)
    res["hwm_growth_gb_per_job"] = (ends[-1]["VmHWM"] - ends[0]["VmHWM"]) / (len(ends) - 1)
    print(write_result(Path(a.out), f"job_memory_{rollout}", res, markdown(res)).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
