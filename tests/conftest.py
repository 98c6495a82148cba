"""Shared fixtures and helpers: the testbed tokenizer and tiny models of both families, built in
memory; a composed debug config (:func:`cfg_for`) and the session's prepare cache (``cache_dir``)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from datc.models.build import build_causal_lm, build_reward_model
from datc.models.tokenizer import build_testbed_tokenizer, load_tokenizer
from datc.paths import CONFIG_DIR
from datc.utils import quiet_libraries

quiet_libraries()
torch.set_num_threads(1)

ARCHS = {
    "gpt2": dict(model_type="gpt2", n_layer=2, n_head=2, n_embd=32, n_positions=64),
    "llama": dict(model_type="llama", num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                  hidden_size=32, intermediate_size=64, max_position_embeddings=64),
}


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Every test starts on one torch thread: ``train`` sets the count from ``trainer.threads``
    and would otherwise leave it to the tests after it (rounding depends on it)."""
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tok(tmp_path_factory):
    return load_tokenizer(build_testbed_tokenizer(tmp_path_factory.mktemp("tok")))


@pytest.fixture(params=sorted(ARCHS))
def family(request):
    return request.param


@pytest.fixture
def policy(tok, family):
    return build_causal_lm(ARCHS[family], tok, 0).eval()


@pytest.fixture
def reward_model(tok, family):
    return build_reward_model(ARCHS[family], tok, 0).eval()


def cfg_for(cache_dir, run_dir, *overrides):
    """``configs/train.yaml`` composed with ``debug=fast``, the given cache and run directories
    and the overrides (not yet validated)."""
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose(config_name="train", overrides=["debug=fast", f"cache_dir={cache_dir}", f"run_dir={run_dir}", *overrides])


def train_cmd(cache_dir, run_dir, *overrides) -> list[str]:
    """The command line of :func:`cfg_for`'s run, for a run in its own process."""
    return [sys.executable, "-m", "datc.train", "debug=fast", f"cache_dir={cache_dir}", f"run_dir={run_dir}", *overrides]


def metric_rows(run_dir) -> list[dict]:
    """The run's ``metrics.jsonl``, one dict per row."""
    return [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def comparable(rows: list[dict]) -> list[dict]:
    """Metric rows without wall-clock timings (``perf/*``): what two equal runs share exactly."""
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]


def kill_at_checkpoint(cmd: list[str], run_dir, step: int, timeout: float = 300) -> None:
    """Start ``cmd`` (a training run writing to ``run_dir``), SIGKILL it as soon as its
    checkpoint of ``step`` exists, and check that it had not finished: what a resume test
    starts from. Fails if the run ends first or ``timeout`` seconds pass."""
    ckpt = Path(run_dir) / "checkpoints" / f"step_{step:07d}"
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + timeout
    try:
        while not ckpt.exists():
            assert proc.poll() is None and time.time() < deadline, f"run ended or timed out before {ckpt.name}"
            time.sleep(0.005)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    assert not (Path(run_dir) / "summary.json").exists(), "the run finished before it could be killed"


def copy_as_killed(run_dir, dst, last_checkpoint: int, rows_through: int) -> None:
    """``run_dir`` copied to ``dst`` as a kill after checkpoint ``last_checkpoint`` would have
    left it: no later checkpoint, no summary.json, the metrics rows through step
    ``rows_through`` only (those written after the checkpoint included)."""
    def later(_dir, names):
        return [n for n in names if n == "summary.json"
                or (re.fullmatch(r"step_\d+", n) is not None and int(n[5:]) > last_checkpoint)]

    shutil.copytree(run_dir, dst, ignore=later)
    rows = [r for r in metric_rows(dst) if r["step"] <= rows_through]
    (Path(dst) / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def assert_same_metrics(a, b, rel: float = 1e-6, abs: float = 1e-9) -> None:
    """The two runs' metric rows, timings aside, step for step within ``rel``/``abs`` (several
    processes reduce in an order that may differ from run to run)."""
    ra, rb = comparable(metric_rows(a)), comparable(metric_rows(b))
    assert [r["step"] for r in ra] == [r["step"] for r in rb]
    for x, y in zip(ra, rb, strict=True):
        assert y == pytest.approx(x, rel=rel, abs=abs)


def shared_dir(tmp_path_factory, name: str) -> Path:
    """A folder every worker of this test run shares (``pytest -n``: pytest-xdist's workers have
    their own temporary folders under one run folder), or this process's own without workers."""
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name
    folder.mkdir(exist_ok=True)
    return folder


@contextmanager
def once_per_run(folder: Path):
    """Holds ``folder``'s lock: the first worker to take it makes what the folder holds, the
    others wait for it and find it made."""
    from filelock import FileLock

    with FileLock(str(folder) + ".lock"):
        yield


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One prepare cache for the test run's end-to-end tests, shared by its workers (assets are
    keyed by their config and written whole, so workers that prepare the same one at once agree)."""
    return str(shared_dir(tmp_path_factory, "cache"))


@pytest.fixture(scope="session")
def prepared_cache(cache_dir):
    """The session's cache with the testbed's ``debug=fast`` assets (warm-started tiny GPT-2 and
    its reward model) prepared in a test process (one worker; the others wait), so processes
    started on it only read them."""
    from datc.checks import validate
    from datc.prepare.assets import ensure_assets

    with once_per_run(Path(cache_dir)):
        ensure_assets(validate(cfg_for(cache_dir, "unused")))
    return cache_dir


@dataclass(frozen=True)
class Sweep:
    dir: Path  # hydra.sweep.dir: one run directory per job
    cmd: list[str]  # the command without its hydra.sweep.dir
    env: dict[str, str]  # on top of the test process's (tests/cli.py)


@pytest.fixture(scope="session")
def finished_sweep(prepared_cache, tmp_path_factory) -> Sweep:
    """A finished multirun sweep of four jobs, ``datc-train -m debug=fast seed=0,1 credit=grpo,datc``
    in its own process (the cache through ``DATC_CACHE``), run once per test run (by the first
    worker that asks): the sweep tests read it, or rerun its command on a copy."""
    from tests import cli

    env = {"DATC_CACHE": str(prepared_cache)}
    cmd = [sys.executable, "-m", "datc.train", "-m", "debug=fast", "seed=0,1", "credit=grpo,datc"]
    folder = shared_dir(tmp_path_factory, "sweep")
    sweep, done = folder / "sweep", folder / "finished"
    with once_per_run(folder):
        if not done.exists():
            shutil.rmtree(sweep, ignore_errors=True)  # a worker's earlier attempt that failed
            r = cli.run([*cmd, f"hydra.sweep.dir={sweep}"], timeout=900, env=env)
            assert r.returncode == 0, r.stderr[-2000:]
            done.touch()
    return Sweep(sweep, cmd, env)


@pytest.fixture(scope="session")
def same_batch_runs(prepared_cache, tmp_path_factory):
    """The same-global-batch cases of tests/distributed/same_batch.py, run once per session:
    ``.one(name)`` the one-process reference, ``.two(name)`` the 2-process DeepSpeed run (each
    side computed once per test run, by the first worker that asks, and read by the others)."""
    from tests.distributed.same_batch import SameBatchRuns

    return SameBatchRuns(prepared_cache, shared_dir(tmp_path_factory, "same_batch"))


@pytest.fixture(scope="session")
def resume_runs(prepared_cache, tmp_path_factory):
    """The 2-process save-and-resume runs of tests/distributed/resume.py (ZeRO-3, LoRA under
    ZeRO-2/3, FSDP2), made once per test run by the first worker that asks."""
    from tests.distributed.resume import ResumeRuns

    return ResumeRuns(prepared_cache, shared_dir(tmp_path_factory, "resume"))


HAS_VLLM = importlib.util.find_spec("vllm") is not None


def pytest_collection_modifyitems(config, items):
    """The vLLM engine's tests (marked ``vllm``) run in the environment that has vLLM
    (``make test`` runs them in .venv-vllm, ``make test-vllm`` alone); elsewhere they are
    deselected and counted, never skipped to green."""
    if HAS_VLLM:
        return
    engine = [it for it in items if it.get_closest_marker("vllm") is not None]
    if engine:
        items[:] = [it for it in items if it.get_closest_marker("vllm") is None]
        config.hook.pytest_deselected(items=engine)
