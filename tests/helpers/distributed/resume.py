"""The 2-process save-and-resume runs of tests/e2e/test_distributed.py (ZeRO-3),
tests/e2e/test_lora_distributed.py (LoRA under ZeRO-2 and ZeRO-3) and tests/e2e/test_fsdp2.py (FSDP2, the
full policy and LoRA),
made once per test run in three launches instead of two per case:

1. ZeRO-3's uninterrupted run through ``datc-launch`` (DeepSpeed's launcher: its command line, its
   output, rank 0's one summary line);
2. the other cases' uninterrupted runs in one ``torchrun`` launch (``runs_worker.py``: the
   command's own training loop, one run after the other in the same processes);
3. every case's run "killed" after its step-2 checkpoint (:func:`tests.helpers.runs.copy_as_killed`:
   what a kill -9 then would have left) resumed, again in one ``torchrun`` launch.

Each case: 4 steps of ``debug=fast`` with ``credit=datc``, a checkpoint every 2 steps."""

from __future__ import annotations

import json
import shutil
import subprocess
from argparse import Namespace
from pathlib import Path

from datc.commands.launch import build
from tests.helpers.distributed.same_batch import LORA, env, free_port, torchrun

ROOT = Path(__file__).resolve().parents[3]
WORKER = ROOT / "tests" / "helpers" / "distributed" / "runs_worker.py"

COMMON = ["debug=fast", "credit=datc", "trainer.steps=4", "trainer.checkpoint_every=2", "trainer.keep_checkpoints=3"]
CASES: dict[str, list[str]] = {  # name -> the backend's overrides, in the order the launches run them
    "fsdp2": ["backend=fsdp2"],
    "lora-fsdp2": ["backend=fsdp2", *LORA],
    "zero3": ["deepspeed=zero3"],
    "lora-zero2": ["deepspeed=zero2", *LORA],
    "lora-zero3": ["deepspeed=zero3", *LORA],
}
LAUNCHED = "zero3"  # its uninterrupted run goes through datc-launch


def overrides(name: str, cache_dir, run_dir: Path) -> list[str]:
    return [*COMMON, *CASES[name], f"cache_dir={cache_dir}", f"run_dir={run_dir}"]


class ResumeRuns:
    """``full(name)``: the uninterrupted run's directory; ``resumed(name)``: the run resumed from its
    step-2 checkpoint; ``launched``: the ``datc-launch`` process of :data:`LAUNCHED` (its argv,
    stdout, stderr); ``resume_log``: the resuming launch's stderr. Made once per test run, by the
    first worker that asks, under a lock; a failure is raised again for every test that asks."""

    def __init__(self, cache_dir, folder: Path) -> None:
        self.cache_dir, self.folder = cache_dir, folder
        self._error: BaseException | None = None
        self._made = False

    def full(self, name: str) -> Path:
        self._make()
        return self.folder / "full" / name

    def resumed(self, name: str) -> Path:
        self._make()
        return self.folder / "resumed" / name

    @property
    def launched(self) -> dict:
        self._make()
        return json.loads((self.folder / "launched.json").read_text())

    @property
    def resume_log(self) -> str:
        self._make()
        return (self.folder / "resumed.log").read_text()

    def _make(self) -> None:
        if self._error is not None:
            raise self._error
        if self._made:
            return
        from tests.helpers.shared import once_per_run

        try:
            with once_per_run(self.folder):
                if not (self.folder / "done").exists():
                    self._run()
                    (self.folder / "done").touch()
        except Exception as e:  # noqa: BLE001  kept and raised again for every test that asks
            self._error = e
            raise
        self._made = True

    def _run(self) -> None:
        from tests.helpers.runs import copy_as_killed

        for sub in ("full", "resumed"):
            shutil.rmtree(self.folder / sub, ignore_errors=True)  # an earlier attempt that failed
        cache = self.cache_dir
        launch = launch_cmd(*overrides(LAUNCHED, cache, self.folder / "full" / LAUNCHED), port=free_port())
        proc = subprocess.run(launch.argv, env={**env(cache), **launch.env}, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        (self.folder / "launched.json").write_text(json.dumps({"argv": launch.argv, "stdout": proc.stdout,
                                                                "stderr": proc.stderr}))
        self._launch("full", [n for n in CASES if n != LAUNCHED])
        for name in CASES:
            copy_as_killed(self.folder / "full" / name, self.folder / "resumed" / name, 2, 3)
        log = self._launch("resumed", list(CASES))
        (self.folder / "resumed.log").write_text(log)

    def _launch(self, side: str, names: list[str]) -> str:
        """The named cases' runs under ``side/`` in one ``torchrun`` launch; its stderr."""
        spec = self.folder / f"{side}.json"
        spec.write_text(json.dumps({n: overrides(n, self.cache_dir, self.folder / side / n) for n in names}))
        return torchrun(self.cache_dir, WORKER, str(spec), timeout=1200).stderr


def launch_cmd(*overrides, nproc=2, port=29777):
    """``datc-launch``'s command line on this CPU machine (the runs started with it pass a free port,
    so two suites on one machine do not meet on 29777)."""
    return build(Namespace(nproc=nproc, hostfile=None, num_nodes=None, master_addr=None, master_port=port, threads=None,
                           dry_run=False, overrides=list(overrides)), cpu_count=2, environ={}, cuda=False)


def warm_policy(cache_dir) -> str:
    """The warm-started policy these runs start from (the cache may hold other draws too)."""
    from datc.checks import validate
    from datc.prepare.assets import ensure_assets
    from tests.helpers.testbed import cfg_for

    return ensure_assets(validate(cfg_for(cache_dir, "unused"))).policy_path
