"""The GPU check's cases for what was built after its first run (scripts/gpu_check/cases.py holds
the others): the determinism case (the same short run twice, compared bit for bit, and the mode's
step time), several ranks through ``datc-launch`` (FSDP2 on two GPUs; two gloo processes on CPU),
and what a training variant's run is (LoRA: the adapters and the reference; asynchronous: which
CUDA stream the engine's thread samples on). Importable without CUDA; every heavy import is
inside a function.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from scripts.gpu_check.cases import _cuda_memory, compose, plan_memory, preset

ASYNC = ["rollout.max_staleness=1", "rollout.correction=token_truncate"]  # the asynchronous variant's overrides
VARIANTS: dict[str, list[str]] = {  # a training case's variant -> its overrides (lora: the preset's _lora variant)
    "lora": [], "async": ASYNC, "deterministic": ["trainer.deterministic=true"],
}


def variant_facts(variant: str, c, device) -> dict[str, Any]:
    """What a variant's run is, said by the case: ``lora``, the adapters' rank and the
    reference (the base with its adapters off); ``async``, the engine's thread's CUDA stream."""
    if variant == "lora":
        lora = c.policy.lora
        return {"lora": {"r": lora.r, "alpha": lora.alpha, "target_modules": lora.target_modules,
                         "reference": "the policy with its adapters disabled (no second copy)"}}
    if variant == "async":
        return {"async": engine_stream(device)}
    return {}


def engine_stream(device) -> dict[str, Any]:
    """Which CUDA stream a thread of the asynchronous rollout's pool (a ``ThreadPoolExecutor``
    thread, as :class:`datc.step.stream.AsyncRollouts` runs the engine on) launches its kernels
    on, against the trainer's thread's. The same stream serializes sampling and the update on
    the GPU: only their host-side work (Python, kernel launches) can overlap."""
    import torch

    if device.type != "cuda":
        return {"device": device.type, "own_stream": None,
                "note": "no CUDA: the two threads share the CPU cores (torch's ops release the GIL)"}
    from concurrent.futures import ThreadPoolExecutor

    main = torch.cuda.current_stream(device)
    with ThreadPoolExecutor(max_workers=1) as pool:
        other = pool.submit(lambda: torch.cuda.current_stream(device)).result()
    same = other == main
    return {"device": "cuda", "own_stream": not same, "trainer_stream": str(main), "engine_thread_stream": str(other),
            "note": ("the engine's thread launches on the trainer's stream (datc.engines.own_copy takes no stream of its "
                     "own): its kernels and the update's run one after the other on the GPU") if same else
                    "the engine's thread has a stream of its own"}


def case_determinism(spec: dict[str, Any], case_dir: Path) -> dict[str, Any]:
    """The same short run twice under ``trainer.deterministic`` (one process, the preset's own
    step: :func:`datc.step.train_step` on a fresh session each time, seeded as the trainer seeds
    rank 0), their metrics (timings aside) and final parameters compared bit for bit; each run's
    step time (medians over the steps after the first) against the default mode's, which the
    parent reads from ``train/<family>/grpo/none``."""
    import torch

    from datc.checks import validate
    from datc.step import train_step
    from datc.training.session import build_session
    from datc.utils import deterministic_mode, seed_everything

    c = validate(compose(spec["family"], spec["overrides"]))
    if not c.trainer.deterministic:
        raise ValueError("the determinism case runs with trainer.deterministic=true")
    runs: list[dict[str, Any]] = []
    first: dict[str, torch.Tensor] = {}
    with deterministic_mode(True):
        for i in range(2):
            s = build_session(c)
            try:
                seed_everything(c.seed)  # as the trainer seeds rank 0 (datc.training.trainer._loop)
                rows = [train_step(s, it).metrics for it in range(c.trainer.steps)]
                params = {n: p.detach() for n, p in s.m.policy.named_parameters()}
                if i == 0:
                    first = {n: p.to("cpu", copy=True) for n, p in params.items()}
                    diff = None
                else:
                    unequal = [n for n, p in params.items() if not torch.equal(p.cpu(), first[n])]
                    diff = {"unequal_tensors": len(unequal), "tensors": len(params), "first_unequal": unequal[:5],
                            "max_abs_diff": max((float((params[n].cpu().float() - first[n].float()).abs().max())
                                                 for n in unequal), default=0.0)}
            finally:
                s.stream.close()
                s.engine.close()
            metrics = [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]
            steps = [r["perf/step_s"] for r in rows]
            runs.append({"metrics": metrics, "step_s": steps, "rollout_s": [r["perf/rollout_s"] for r in rows],
                         "params_diff": diff})
            del s, params
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    a, b = runs[0]["metrics"], runs[1]["metrics"]
    unequal_keys = sorted({k for x, y in zip(a, b, strict=True) for k in x.keys() | y.keys()
                           if not _same(x.get(k), y.get(k))})
    measured = [v for r in runs for v in (r["step_s"][1:] or r["step_s"])]
    return {"steps": c.trainer.steps, "metrics_equal": not unequal_keys, "unequal_metrics": unequal_keys[:10],
            "params_equal": runs[1]["params_diff"]["unequal_tensors"] == 0, "params_diff": runs[1]["params_diff"],
            "step_s": statistics.median(measured),
            "rollout_s": statistics.median(v for r in runs for v in (r["rollout_s"][1:] or r["rollout_s"])),
            "runs_step_s": [r["step_s"] for r in runs], "decode": "dynamic (the mode's)",
            "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"), **_cuda_memory()}


def _same(x, y) -> bool:
    """Equal bit for bit (NaN equal to NaN)."""
    if isinstance(x, float) and isinstance(y, float):
        return x == y or (math.isnan(x) and math.isnan(y))
    return x == y


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def case_ranks(spec: dict[str, Any], case_dir: Path) -> dict[str, Any]:
    """A training case on ``spec["nproc"]`` ranks, started as a user starts one:
    ``datc-launch --nproc N <overrides>`` (:func:`datc.commands.launch.build`: torchrun for
    ``backend=fsdp2``), one GPU a rank (on CPU, gloo processes sharing the cores). Ends the
    launch once the last step is in ``metrics.jsonl`` (the closing evaluation and checkpoint
    are not part of the check); the peak memory is the run's ``perf/peak_mem_gb``."""
    from datc.commands.launch import build

    run_dir = Path(spec["run_dir"])
    shutil.rmtree(run_dir, ignore_errors=True)
    overrides = [f"experiment=paper/{preset(spec['family'])}", *spec["overrides"]]
    launch = build(argparse.Namespace(nproc=spec["nproc"], overrides=overrides, hostfile=None, num_nodes=None,
                                      master_addr=None, master_port=_free_port(), threads=spec.get("threads"), dry_run=False))
    extra: dict[str, Any] = {"nproc": spec["nproc"], "command": " ".join(launch.argv)}
    try:
        extra["plan"] = plan_memory(spec["family"], spec["overrides"], spec["stage"], spec["params"], n_gpus=spec["nproc"])
    except Exception as e:  # noqa: BLE001 - the estimate is a comparison only
        extra["plan"] = {"error": f"{type(e).__name__}: {e}"}
    with open(case_dir / "ranks.log", "w") as log:
        proc = subprocess.Popen(launch.argv, env={**os.environ, **launch.env}, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            metrics = run_dir / "metrics.jsonl"
            while True:
                done = metrics.exists() and sum('"perf/step_s"' in ln for ln in metrics.read_text().split("\n")[:-1])
                if done and done >= spec["steps"]:
                    extra["ended"] = "after the last step"
                    break
                if proc.poll() is not None:
                    tail = (case_dir / "ranks.log").read_text(errors="replace")[-3000:]
                    if proc.returncode != 0:
                        raise RuntimeError(f"datc-launch --nproc {spec['nproc']} ended with code {proc.returncode}:\n{tail}")
                    extra["ended"] = "run finished"
                    break
                time.sleep(0.5)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
    return extra
