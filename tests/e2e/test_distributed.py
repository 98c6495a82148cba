"""DeepSpeed on CPU (gloo): 2-process ZeRO-2 and ZeRO-3 runs compute the same losses and end
with the same policy as one plain process on the same global batch; a ZeRO-3 run saved and
resumed equals an uninterrupted one; ``datc-launch`` builds the launcher's command lines and
starts the 2-process run."""

from __future__ import annotations

import json
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch

from datc.commands.launch import build
from tests.helpers.distributed.resume import launch_cmd, warm_policy
from tests.helpers.distributed.same_batch import (
    CASES,
    PARAM_ATOL,
    PARAM_ATOL_BF16,
    TWO_ONLY,
    assert_two_match_one,
    env,
    free_port,
)
from tests.helpers.runs import assert_same_metrics

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _env(cache_dir) -> dict[str, str]:
    return env(cache_dir)


@pytest.mark.parametrize("case", [n for n, c in CASES.items() if c[0] != "fsdp2" and not n.startswith("lora-") and n not in TWO_ONLY])
def test_two_processes_match_one_on_the_same_global_batch(same_batch_runs, case):
    """ZeRO-2 and ZeRO-3, grpo and datc, fp32 and bf16, and the schemes that read the whole
    batch (entropy_top, delta): a 2-process run equals one process on the same global batch."""
    stage, _, dtype, _, _ = CASES[case]
    one, two = same_batch_runs.one(case), same_batch_runs.two(case)
    assert two["share_prompts"] is (stage != "zero3") and one["share_prompts"] is two["share_prompts"]
    assert_two_match_one(one, two, PARAM_ATOL_BF16 if dtype == "bfloat16" else PARAM_ATOL)


@pytest.mark.parametrize("credit", ["grpo", "datc"])
def test_zero3_sampling_with_gathered_parameters_equals_synced_gathers(same_batch_runs, credit):
    # deepspeed.gather_for_generation: the policy's parameters gathered once per sampling call
    # (no per-token all-gathers, no rank waiting on the others' responses; `auto` on CPU, the
    # zero3-*-float32 runs) against ZeRO's per-module gathers with synced_gpus: the same
    # samples, so the same steps, bit for bit.
    runs = {"gather": same_batch_runs.two(f"zero3-{credit}-float32"), "synced": same_batch_runs.two(f"zero3-{credit}-synced")}
    assert runs["gather"]["gather_generation"] is True and runs["synced"]["gather_generation"] is False
    assert runs["gather"]["steps"] == runs["synced"]["steps"]
    for name, p in runs["synced"]["params"].items():
        assert torch.equal(runs["gather"]["params"][name], p), name


def test_zero3_save_and_resume_equals_an_uninterrupted_run(resume_runs, tmp_path):
    cache_dir = resume_runs.cache_dir
    full, launched = resume_runs.full("zero3"), resume_runs.launched
    assert launched["argv"][1:4] == ["-m", "deepspeed.launcher.runner", "--log_level"]  # through datc-launch
    # Rank 0 speaks: one summary line, none of DeepSpeed's per-process CPU or launcher chatter.
    assert [ln.split(":")[0].rsplit("-", 1)[0] for ln in launched["stdout"].splitlines() if ln.startswith("run ")] == [
        "run keywords-tiny_gpt2-datc-s0"], launched["stdout"]
    for noise in ("Setting accelerator to CPU", "CUDA_VISIBLE_DEVICES", "all_gather_into_tensor"):
        assert noise not in launched["stdout"] + launched["stderr"], noise
    ckpts = sorted(p.name for p in (full / "checkpoints").iterdir() if p.is_dir())
    assert ckpts == ["step_0000002", "step_0000004"]
    # The trained policy as a Hugging Face checkpoint: gathered from the ZeRO-3 shards at the end
    # of the run (final/), and consolidated from the last checkpoint's shards by datc-export.
    from transformers import AutoModelForCausalLM

    from datc.commands.export import export_checkpoint

    exported = AutoModelForCausalLM.from_pretrained(export_checkpoint(full, 4, tmp_path / "exported")).eval()
    final = AutoModelForCausalLM.from_pretrained(full / "final").eval()
    ids = torch.randint(4, 100, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=ids).logits, final(input_ids=ids).logits, rtol=0, atol=0)
    warm = AutoModelForCausalLM.from_pretrained(warm_policy(cache_dir)).eval()
    with torch.no_grad():
        assert not torch.equal(warm(input_ids=ids).logits, final(input_ids=ids).logits)  # it trained
    assert {p.name for p in (full / "checkpoints" / "step_0000002").glob("rank_*.pt")} == {"rank_00000.pt", "rank_00001.pt"}

    # The same run, "killed" after its step-2 checkpoint (what it had written then, and no more),
    # resumed: the same metrics as the uninterrupted run.
    resumed = resume_runs.resumed("zero3")
    assert f"resumed {resumed} from its checkpoint of step 2 of 4" in resume_runs.resume_log
    assert_same_metrics(full, resumed)


def test_launch_command_lines():
    one = launch_cmd("credit=datc", nproc=1)
    assert one.argv[1:] == ["-m", "datc.train", "credit=datc", "trainer.threads=2"]
    assert one.env == {"OMP_NUM_THREADS": "2"}

    two = launch_cmd("deepspeed=zero3", "credit=datc")
    assert two.argv[1:] == ["-m", "deepspeed.launcher.runner", "--log_level", "warning", "--num_nodes", "1", "--num_gpus", "2",
                            "--master_port", "29777", "--no_local_rank", "--module", "datc.train",
                            "deepspeed=zero3", "credit=datc", "trainer.threads=1"]
    assert two.env == {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}  # a CPU machine: said, not detected

    nodes = build(Namespace(nproc=8, hostfile="hosts", num_nodes=2, master_addr="10.0.0.1", master_port=29500,
                            threads=4, dry_run=False, overrides=["deepspeed=zero2", "trainer.threads=6"]),
                  cpu_count=64, environ={"OMP_NUM_THREADS": "3"}, cuda=True)
    assert nodes.argv[1:] == ["-m", "deepspeed.launcher.runner", "--log_level", "warning", "--hostfile", "hosts", "--num_nodes", "2",
                              "--num_gpus", "8", "--master_addr", "10.0.0.1", "--master_port", "29500",
                              "--no_local_rank", "--module", "datc.train", "deepspeed=zero2", "trainer.threads=6"]
    assert nodes.env == {}  # the user's OMP_NUM_THREADS and trainer.threads are kept


def test_launch_refuses_several_processes_without_deepspeed():
    with pytest.raises(SystemExit, match="deepspeed=zero2"):
        launch_cmd("credit=datc")
    with pytest.raises(SystemExit, match="deepspeed=zero2"):
        launch_cmd("deepspeed=none")


def test_slurm_launcher_config_composes_one_task_per_gpu():
    from hydra import compose, initialize_config_dir

    from datc.paths import CONFIG_DIR

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="train", overrides=["hydra/launcher=slurm", "hydra.launcher.partition=gpu",
                                                      "hydra.launcher.gpus_per_node=4"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.partition, launcher.gpus_per_node, launcher.tasks_per_node) == ("gpu", 4, 4)
    assert launcher.max_num_timeout > 0  # a timed-out job is requeued and resumes from its checkpoint


def test_a_sweep_runs_through_the_submitit_launcher(prepared_cache, tmp_path):
    cache_dir = prepared_cache
    # The local executor of the same plugin as hydra/launcher=slurm: each sweep point a submitit job.
    proc = subprocess.run([sys.executable, "-m", "datc.train", "-m", "hydra/launcher=submitit_local", "seed=0,1",
                           "debug=fast", "trainer.steps=1", f"cache_dir={cache_dir}", f"hydra.sweep.dir={tmp_path}"],
                          env=_env(cache_dir), capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for seed in (0, 1):
        [run] = tmp_path.glob(f"keywords-tiny_gpt2-grpo-s{seed}-*")
        summary = json.loads((run / "summary.json").read_text())
        assert summary["seed"] == seed and summary["steps"] == 1


def _cfg(*overrides):
    from hydra import compose, initialize_config_dir

    from datc.checks import validate
    from datc.paths import CONFIG_DIR

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return validate(compose(config_name="train", overrides=list(overrides)))


def test_deepspeed_config_is_derived_from_the_trainer():
    from datc.backends.deepspeed_config import deepspeed_config, inference_config

    c = _cfg("deepspeed=zero3", "trainer.batch_size=64", "trainer.mini_batch_size=32", "trainer.micro_batch_size=8",
             "trainer.max_grad_norm=0.5", "trainer.lr=1e-5")
    ds = deepspeed_config(c, 2, torch.device("cpu"))
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (32, 8, 2)
    assert ds["train_batch_size"] == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * 2
    assert ds["gradient_clipping"] == 0.5 and ds["optimizer"]["params"]["lr"] == 1e-5
    assert ds["optimizer"]["params"]["torch_adam"] is True  # no compiled Adam on CPU
    assert ds["zero_optimization"]["stage"] == 3
    assert inference_config(c, 2)["zero_optimization"]["stage"] == 3
    assert inference_config(_cfg("deepspeed=zero2"), 2) is None  # frozen models are plain replicas
    # the micro-batch is capped by a rank's share of the mini-batch
    small = deepspeed_config(_cfg("deepspeed=zero2", "trainer.mini_batch_size=16", "trainer.micro_batch_size=8"), 4,
                             torch.device("cpu"))
    assert (small["train_micro_batch_size_per_gpu"], small["gradient_accumulation_steps"]) == (4, 1)
    offload = deepspeed_config(_cfg("deepspeed=zero3_offload"), 1, torch.device("cpu"))
    assert offload["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    extra = deepspeed_config(_cfg("deepspeed=zero2", "+deepspeed.config.zero_optimization.reduce_bucket_size=1000"), 1,
                             torch.device("cpu"))
    assert extra["zero_optimization"] == {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 1000}


@pytest.mark.parametrize(("world", "overrides", "field"), [
    (3, ["deepspeed=zero2"], "trainer.batch_size"),  # 8 prompts do not split over 3 ranks
    (2, ["deepspeed=zero2", "trainer.mini_batch_size=8", "trainer.batch_size=64", "trainer.micro_batch_size=8",
         "trainer.num_generations=4"], None),
    (2, ["deepspeed=none"], "backend: 2 processes were started but the plain backend"),
    (2, ["deepspeed=zero2", "trainer.micro_batch_size=16", "trainer.mini_batch_size=48", "trainer.batch_size=48"],
     "trainer.micro_batch_size"),
])
def test_world_size_checks_name_the_field(world, overrides, field):
    from datc.backends.distributed import check_world
    from datc.config import ConfigError

    c = _cfg(*overrides)
    if field is None:
        check_world(c, world)
        return
    with pytest.raises(ConfigError, match=f"^{field}"):
        check_world(c, world)


def test_offload_needs_the_right_stage():
    from datc.config import ConfigError

    with pytest.raises(ConfigError, match="^deepspeed.offload_param"):
        _cfg("deepspeed=zero2", "deepspeed.offload_param=cpu")
    with pytest.raises(ConfigError, match="^deepspeed.stage"):
        _cfg("deepspeed.stage=5")


def test_an_engine_checkpoint_from_another_setup_is_refused_before_loading(tmp_path):
    from datc.config import ConfigError
    from datc.run.checkpoint import load_engine_checkpoint

    ckpt = tmp_path / "step_0000002"
    ckpt.mkdir()
    torch.save({"step": 2, "elapsed": 1.0}, ckpt / "state.pt")  # written without DeepSpeed
    with pytest.raises(ConfigError, match="^backend: .* written by the plain backend; resume it with the backend that wrote it"):
        load_engine_checkpoint(ckpt, engine=None, rank=0, world_size=2)
    torch.save({"step": 2, "elapsed": 1.0, "deepspeed": True, "world_size": 2}, ckpt / "state.pt")
    with pytest.raises(ConfigError, match="^backend: .* 2 processes, this run has 1"):
        load_engine_checkpoint(ckpt, engine=None, rank=0, world_size=1)  # the engine is never touched


def test_the_collectives_over_two_gloo_ranks(tmp_path):
    # Dist's reductions without DeepSpeed: sum, max (the vLLM gap's largest over ranks; a
    # maximum of negatives is the least negative, not 0), tensors, gathers of unequal sizes.
    port = str(free_port())
    worker = str(ROOT / "tests" / "helpers" / "distributed" / "collectives_worker.py")
    procs = [subprocess.Popen([sys.executable, worker, str(r), port, str(tmp_path)], env=_env(tmp_path)) for r in (0, 1)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    for r in (r0, r1):
        assert r["sum"] == 4.0 and r["max"] == 0.25 and r["max_negative"] == -2.0
        assert r["tensor_sum"] == [3.0, 6.0] and r["cat"] == [0.0, 10.0, 11.0]
        assert r["gather"] == [{"rank": 0}, {"rank": 1}] and r["broadcast"] == "from 0"
    assert (r0["shard"], r1["shard"]) == ([0, 4], [4, 8])
