"""Shared fixtures and hooks, seen by every test below this folder: the testbed tokenizer and
tiny models of both families, built in memory; the session's prepare cache (``cache_dir``) and the
runs it shares between tests. The helpers they use are in tests/helpers/."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

from datc.models.build import build_causal_lm, build_reward_model
from datc.models.tokenizer import build_testbed_tokenizer, load_tokenizer
from datc.utils import quiet_libraries
from tests.helpers.shared import Sweep, once_per_run, shared_dir
from tests.helpers.testbed import ARCHS, HAS_VLLM, cfg_for

quiet_libraries()
torch.set_num_threads(1)


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


@pytest.fixture
def forced():
    """Every step's batch holds a group tied by value (its responses differ), a response with a
    NaN reward, and a group of identical responses (tests/helpers/zero_advantage.py): the
    zero-advantage skip's tests and LoRA's. ``forced["ops"]``: the seams that do it."""
    from tests.helpers.zero_advantage import forced_ops

    return forced_ops()


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


@pytest.fixture(scope="session")
def finished_sweep(prepared_cache, tmp_path_factory) -> Sweep:
    """A finished multirun sweep of four jobs, ``datc-train -m debug=fast seed=0,1 credit=grpo,datc``
    in its own process (the cache through ``DATC_CACHE``), run once per test run (by the first
    worker that asks): the sweep tests read it, or rerun its command on a copy."""
    from tests.helpers import cli

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
    """The same-global-batch cases of tests/helpers/distributed/same_batch.py, run once per session:
    ``.one(name)`` the one-process reference, ``.two(name)`` the 2-process DeepSpeed run (each
    side computed once per test run, by the first worker that asks, and read by the others)."""
    from tests.helpers.distributed.same_batch import SameBatchRuns

    return SameBatchRuns(prepared_cache, shared_dir(tmp_path_factory, "same_batch"))


@pytest.fixture(scope="session")
def resume_runs(prepared_cache, tmp_path_factory):
    """The 2-process save-and-resume runs of tests/helpers/distributed/resume.py (ZeRO-3, LoRA under
    ZeRO-2/3, FSDP2), made once per test run by the first worker that asks."""
    from tests.helpers.distributed.resume import ResumeRuns

    return ResumeRuns(prepared_cache, shared_dir(tmp_path_factory, "resume"))


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
