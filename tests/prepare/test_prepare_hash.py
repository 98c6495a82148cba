"""The real preset's reward model is the same file on every machine, and its recipe builds the same
bits on one thread and on two.

The preset loads its reward model from a committed delta (``configs/reward/``; LoRA factors as
integers, merged exactly: ``datc.models.reward_delta``): built from it in a fresh cache, every
prepared file (prompt data, the policy de-quantized from the GGUF wheel, the reward model) has the
sha256 pinned in ``results/real_model/prepared.json``, on any machine (CI runs on another one than
the pin's). Training that delta again is not the same across machine kinds (two kinds trained two
reward models: docs/real-models.md), so the recipe is checked where it can be: a reduced real-preset
training (sizes cut to well under a minute, the same code path: ``ensure_assets``, the shared-prompt
caching, LoRA training steps, held-out scoring) in a spawned process under
``datc.prepare.assets.PINNED_ENV`` and PyTorch's deterministic algorithms gives the same reward model
on one and two threads, and the delta it saves rebuilds that model bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from datc.paths import default_cache_dir
from datc.run.fingerprint import sha256_file

CACHE = Path(default_cache_dir())
pytestmark = pytest.mark.slow

TINY = ["reward.delta=null", "reward.train.lora_r=4", "reward.train.steps=4", "reward.train.n_prompts=2",
        "reward.train.samples_per_prompt=2", "reward.train.edits_per_sample=1", "reward.train.trainable_layers=1",
        "reward.train.test_prompts=1", "reward.train.batch_size=8", "trainer.max_new_tokens=8", "trainer.threads=1"]


def _config(cache, *more):
    from hydra import compose, initialize_config_dir

    from datc.checks import validate
    from datc.paths import CONFIG_DIR

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return validate(compose(config_name="train", overrides=["experiment=real_smollm2", f"cache_dir={cache}", *more]))


def _fresh_cache(path: Path) -> Path:
    """An empty cache sharing the GGUF wheel and its de-quantized policy (made once)."""
    from datc.prepare.assets import materialize_gguf

    models = Path(materialize_gguf(_config(CACHE, *TINY).policy, CACHE)).parent
    path.mkdir()
    (path / "models").symlink_to(models)
    (path / "wheels").symlink_to(CACHE / "wheels")
    return path


def test_the_presets_prepared_files_are_the_pinned_ones(tmp_path):
    from scripts.dev.prepared_hashes import PINNED, differences, prepared

    got = prepared(["experiment=real_smollm2", f"cache_dir={_fresh_cache(tmp_path / 'cache')}"])
    pinned = json.loads(PINNED.read_text())
    assert not differences(pinned, got), differences(pinned, got)
    assert set(got["files"]) == set(pinned["files"])


def test_the_reward_models_recipe_is_deterministic_and_its_delta_rebuilds_it(tmp_path):
    from datc.prepare.assets import DELTA_FILE, ensure_assets

    built = []
    for threads in (1, 2):
        # from an unpinned process (as here and in CI) the build runs in a spawned, pinned one
        a = ensure_assets(_config(_fresh_cache(tmp_path / f"threads{threads}"), *TINY, f"trainer.threads={threads}"))
        built.append(Path(a.reward_path))
    shas = [sha256_file(p / "model.safetensors") for p in built]
    assert shas[0] == shas[1], f"one thread gave {shas[0]}, two threads {shas[1]}: the build is not deterministic"
    assert sha256_file(built[0] / DELTA_FILE) == sha256_file(built[1] / DELTA_FILE)
    loaded = ensure_assets(_config(_fresh_cache(tmp_path / "loaded"), *TINY, f"reward.delta={built[0] / DELTA_FILE}"))
    assert Path(loaded.reward_path) != built[0]  # another cache entry, made from the file, not trained
    assert sha256_file(Path(loaded.reward_path) / "model.safetensors") == shas[0]
    assert loaded.rm_report["heldout_within_group_corr"] == json.loads((built[0] / "rm_report.json").read_text())[
        "heldout_within_group_corr"]


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def test_the_pinned_build_ends_with_the_command_that_started_it(tmp_path):
    # A killed datc-prepare (or datc-train) left its spawned, pinned build training on, orphaned.
    import os
    import signal
    import subprocess
    import sys
    import time

    from hydra import compose, initialize_config_dir

    from datc.checks import validate
    from datc.paths import CONFIG_DIR
    from datc.prepare.assets import materialize_gguf

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        shared = validate(compose(config_name="train", overrides=["experiment=real_smollm2", f"cache_dir={CACHE}", *TINY]))
    (tmp_path / "models").symlink_to(Path(materialize_gguf(shared.policy, CACHE)).parent)
    (tmp_path / "wheels").symlink_to(CACHE / "wheels")
    cmd = [sys.executable, "-m", "datc.commands.prepare", "experiment=real_smollm2", f"cache_dir={tmp_path}", *TINY,
           "reward.train.steps=2000"]  # long enough to be killed while it trains
    parent = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path)
    try:
        deadline, child = time.monotonic() + 240, None
        while time.monotonic() < deadline and child is None and parent.poll() is None:
            kids = _children(parent.pid)
            child = next((k for k in kids if b"spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes()), None)
            time.sleep(0.5)
        assert child is not None, "the pinned build never started"
        time.sleep(3)  # well into its work
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and Path(f"/proc/{child}").exists():
            time.sleep(0.2)
        alive = Path(f"/proc/{child}").exists() and "Z" not in Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0]
        assert not alive, f"the pinned build (pid {child}) outlived the killed command"
    finally:
        if parent.poll() is None:
            parent.kill()
