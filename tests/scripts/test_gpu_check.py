"""The GPU check's rehearsal: ``python -m scripts.gpu_check`` at tiny shapes on CPU, through the same cases
and code path as on a GPU (random models saved and loaded through the presets, every family x
credit x DeepSpeed stage, the credit timing, synced_gpus sampling under ZeRO-3), with a failing
and a hanging case injected to show that they are reported and the script goes on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRAIN = [f"train/{f}/{c}/{s}" for f in ("qwen3", "llama32") for c in ("grpo", "datc") for s in ("none", "zero2", "zero3", "fsdp2")]
# built since the first GPU run: the presets' LoRA variants, the asynchronous rollout, the deterministic mode, FSDP2 on two ranks
NEW = {*(f"train/{f}/{c}/none/lora" for f in ("qwen3", "llama32") for c in ("grpo", "datc")), "train/qwen3/grpo/none/async",
       "determinism/qwen3", "train/qwen3/grpo/fsdp2/2ranks"}
EXPECTED = {"build/qwen3", "build/llama32", "credit/qwen3", "credit/llama32", "decode/qwen3", "decode/llama32",
            "synced/qwen3", "synced/qwen3/gathered", "fail/error", "fail/hang", *TRAIN, "train/qwen3/datc/none/auto", *NEW}


@pytest.mark.slow
def test_gpu_check_rehearsal_runs_every_case_and_reports_failures(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "scripts.gpu_check", "--tiny", "--inject-failures", "--out", str(out),
                           "--work", str(tmp_path / "work")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    cases = report["cases"]
    assert set(cases) == EXPECTED
    names = list(cases)
    # the deliberate failures come early; they are reported, and every case after them still ran
    assert names.index("fail/error") < names.index(TRAIN[0])
    assert cases["fail/error"]["status"] == "error"
    assert "deliberately failing" in cases["fail/error"]["error"]
    assert "RuntimeError" in cases["fail/error"]["traceback"]
    assert cases["fail/hang"]["status"] == "timeout" and cases["fail/hang"]["wall_s"] < 30
    bad = {n: (r["status"], r.get("error")) for n, r in cases.items() if not n.startswith("fail/") and r["status"] != "ok"}
    assert not bad, bad
    for name in TRAIN:
        s = cases[name]["summary"]
        assert s["steps_logged"] == report["scale"]["steps"] and s["steps_measured"] >= 1
        assert s["step_s"] > 0 and s["update_s"] > 0 and s["rollout_s"] > 0
        assert s["step_s"] >= s["rollout_s"] + s["update_s"]
        assert s["response_len"] > 0 and s["gen_tokens_per_s"] > 0 and s["update_tokens_per_s"] > 0
        assert cases[name]["plan"]["gib"] > 0 or name.endswith("none")
        assert cases[name]["autocast_dtype"] == "float32"  # CPU; bfloat16 on a GPU
    auto = cases["train/qwen3/datc/none/auto"]  # trainer.micro_batch_size: auto over the whole batch of 16
    assert auto["summary"]["micro_batch_auto"]["micro_batch_size"] == 16 and "CPU" in auto["summary"]["micro_batch_auto"]["why"]
    # the models were built at the scaled-down arch and the same tokenizer size everywhere
    assert cases["build/qwen3"]["vocab"] == 512 and cases["build/qwen3"]["params"]["policy"] > 0
    assert cases["synced/qwen3"]["zero3_partitioned"] and cases["synced/qwen3"]["tokens"] > 0
    gathered = cases["synced/qwen3/gathered"]  # the same sampling with the parameters gathered once per call
    assert gathered["generation"] == "gathered once" and gathered["zero3_partitioned"]  # partitioned again after
    assert gathered["tokens"] > 0 and gathered["responses"] == cases["synced/qwen3"]["responses"]
    assert cases["credit/qwen3"]["shape"] == {"tokens": 512, "vocab": 512, "hidden": 32, "chunk_size": 128}
    for dt in ("bfloat16", "tf32"):  # credit.matmul_dtype, timed and compared with the fp32 scores
        assert cases["credit/qwen3"]["seconds_median"][f"datc_exact_{dt}"] > 0
        assert 0 < cases["credit/qwen3"]["low_precision_err_vs_fp32_in_std"][dt] < 0.1
    for fam in ("qwen3", "llama32"):  # the decode loops through the rollout's sampler, the graph's step run eagerly
        d = cases[f"decode/{fam}"]
        assert d["shape"]["rows"] == 16 and d["shape"]["max_new_tokens"] == report["scale"]["max_new_tokens"]
        assert set(d["modes"]) == {"prefill", "dynamic", "static", "static_graph", "static_graph_to_budget"}
        assert all(d["modes"][m]["tokens_per_s"] > 0 and d["modes"][m]["hbm_fraction"] > 0 for m in d["modes"] if m != "prefill")
        assert d["bound"]["weight_bytes"] > 0 and d["bound"]["kv_bytes"] > 0 and d["copy_bandwidth_gb_s"] > 0
        g = d["graph_vs_eager"]
        assert g["captured"] is False and g["bit_equal"] and g["shape"] == [16, 8, 512]  # 8 check tokens (TINY)
    for name in (n for n in NEW if n.startswith("train/")):  # the new training cases ran their steps
        assert cases[name]["summary"]["steps_logged"] == report["scale"]["steps"] and cases[name]["verdict"].startswith("step ")
    for fam in ("qwen3", "llama32"):  # the preset's LoRA variant: adapters, the reference as adapters off, the plan's adapters
        lora = cases[f"train/{fam}/datc/none/lora"]
        assert lora["lora"]["r"] == 16 and "adapters disabled" in lora["lora"]["reference"] and lora["plan"]["params"]["adapter"] > 0
    stale = cases["train/qwen3/grpo/none/async"]  # rollout.max_staleness=1: the engine's waits and the overlap's figure
    assert stale["summary"]["rollout_wait_s"] >= 0 and "overlap" in stale["verdict"] and "saved_s" in stale["overlap"]
    det = cases["determinism/qwen3"]  # the same short run twice under trainer.deterministic: equal bit for bit
    assert det["metrics_equal"] and det["params_equal"] and det["steps"] == report["scale"]["steps"]
    assert det["verdict"].startswith("two identical runs of 2 steps: EQUAL bit for bit; step ")
    ranks = cases["train/qwen3/grpo/fsdp2/2ranks"]  # datc-launch --nproc 2 backend=fsdp2 (two gloo processes here)
    assert ranks["nproc"] == 2 and "datc.commands.torchrun" in ranks["command"] and "beside none" in ranks["verdict"]
    log = (out / "gpu_check.log").read_text()
    assert "determinism/qwen3: ok" in log and "EQUAL bit for bit" in log  # the verdict printed as the case ended
    md = (out / "gpu_check.md").read_text()
    assert "## Built since the first run" in md and "| qwen3 / grpo | fsdp2/2ranks | ok |" in md
    for name in TRAIN:
        assert f"| {name[6:]} | ok |" in md
    assert "| qwen3 | ok | 16 x" in md and "| static_graph |" in md
    assert "`fail/error`: error" in md and "`fail/hang`: timeout" in md
    assert "## Projected paper-preset run" in md and "- **qwen3: " in md and "- **llama32: " in md  # the headline, per family


def test_gpu_check_reports_what_the_deadline_skipped(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "scripts.gpu_check", "--tiny", "--budget-s", "1", "--families", "qwen3",
                           "--out", str(out), "--work", str(tmp_path / "work")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    cases = json.loads((out / "gpu_check.json").read_text())["cases"]
    # build, credit, decode, 2 credits x 4 stages, micro auto, LoRA x 2 credits, async, determinism, 2 ranks, synced (and gathered)
    assert len(cases) == 1 + 1 + 1 + 8 + 1 + 2 + 3 + 2
    assert all(r["status"] == "skipped" for r in cases.values())
    assert cases["build/qwen3"]["error"].startswith("global deadline")
    assert cases["train/qwen3/datc/zero3"]["error"] == "build/qwen3 did not succeed"
    md = (out / "gpu_check.md").read_text()
    assert "| qwen3/datc/zero3 | skipped |" in md and "`build/qwen3`: skipped: global deadline" in md
