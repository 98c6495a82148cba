"""LoRA policies (``policy.lora``): the policy trains low-rank adapters through ``peft`` while
its base weights stay frozen, and the reference is the same model with its adapters disabled.

LoRA (Hu et al. 2021, arXiv:2106.09685, as ``peft`` implements it): each targeted linear map
``W`` (d_out, d_in) computes ``W x + (alpha / r) · B A dropout(x)`` with ``A`` (r, d_in)
Kaiming-uniform and ``B`` (d_out, r) zero at the start, so the adapted policy *is* the base at
step 0. Only ``A`` and ``B`` train (AdamW state for them alone); the base is loaded at
``policy.dtype`` (bf16 on capable GPUs: nothing updates it, so it needs no fp32 master copy) and
the adapters are fp32. With the adapters disabled the model computes exactly the base, which is
the frozen reference GRPO's KL term needs: no second copy is loaded (:class:`AdaptersOff`).

``policy.lora.r: 0`` (the default) trains every parameter, as without this module.
``policy.lora.dropout`` acts in forwards that build a graph (the update's); sampling, the
no-grad log-prob passes and evaluation see the adapters without it, as the policy they
sample from (:class:`GradOnlyDropout`).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from datc.errors import ConfigError

# The attention and MLP projections of each family (peft matches a name against the last part of
# a module's dotted path: GPT-2's ``c_proj`` is both its attention output and its MLP output).
_LLAMA_LIKE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DEFAULT_TARGETS: dict[str, tuple[str, ...]] = {
    "gpt2": ("c_attn", "c_proj", "c_fc"),
    "llama": _LLAMA_LIKE, "mistral": _LLAMA_LIKE, "qwen2": _LLAMA_LIKE, "qwen3": _LLAMA_LIKE,
}


def lora_on(c) -> bool:
    """Whether run config ``c`` trains LoRA adapters (``policy.lora.r > 0``)."""
    return c.policy.lora.r > 0


def alpha_of(lora) -> float:
    """``policy.lora.alpha``, or ``2 r`` when null."""
    return float(lora.alpha) if lora.alpha is not None else 2.0 * lora.r


def targets_of(lora, model_type: str | None) -> list[str]:
    """The module names to adapt: ``policy.lora.target_modules``, else the family's defaults."""
    if lora.target_modules is not None:
        return list(lora.target_modules)
    if model_type not in DEFAULT_TARGETS:
        raise ConfigError(f"policy.lora.target_modules: no default for model type {model_type!r} (defaults for "
                          f"{', '.join(sorted(DEFAULT_TARGETS))}); name the modules to adapt, e.g. [q_proj, v_proj]")
    return list(DEFAULT_TARGETS[model_type])


def adaptable_names(model: nn.Module) -> list[str]:
    """The last parts of the dotted names of ``model``'s modules that LoRA can adapt (linear
    layers, GPT-2's ``Conv1D``, embeddings), sorted: the valid ``target_modules``."""
    from transformers.pytorch_utils import Conv1D

    kinds = (nn.Linear, nn.Embedding, Conv1D)
    return sorted({name.rsplit(".", 1)[-1] for name, mod in model.named_modules() if name and isinstance(mod, kinds)})


def check_targets(model: nn.Module, lora) -> list[str]:
    """The target names for ``model``, each one a module it has, else a one-line ConfigError
    naming the valid names."""
    names = targets_of(lora, getattr(model.config, "model_type", None))
    valid = adaptable_names(model)
    missing = [n for n in names if n not in valid]
    if missing:
        raise ConfigError(f"policy.lora.target_modules: {', '.join(missing)} not a module of the policy "
                          f"({model.config.model_type}); choose from {', '.join(valid)}")
    return names


def check_lora(c) -> None:
    """``policy.lora``'s ranges and, where the policy's architecture is known without loading
    any weights (an ``arch`` block, or a local ``config.json``), its target modules (a model
    built on the meta device). A hub id without an ``arch`` block is checked when it loads,
    still before training."""
    lo = c.policy.lora
    if lo.r < 0:
        raise ConfigError(f"policy.lora.r: must be >= 0 (0: train the whole policy), got {lo.r}")
    if not lora_on(c):
        return
    if lo.alpha is not None and not lo.alpha > 0:
        raise ConfigError(f"policy.lora.alpha: must be > 0 (or null for 2 r), got {lo.alpha}")
    if not 0 <= lo.dropout < 1:
        raise ConfigError(f"policy.lora.dropout: must be in [0, 1), got {lo.dropout}")
    if lo.target_modules is not None and not lo.target_modules:
        raise ConfigError("policy.lora.target_modules: an empty list adapts nothing; give module names or null")
    model = _meta_policy(c)
    if model is not None:
        check_targets(model, lo)


def _meta_policy(c) -> nn.Module | None:
    from transformers import AutoConfig, AutoModelForCausalLM

    arch = dict(c.policy.arch)
    if "model_type" in arch:
        mt = arch.pop("model_type")
        # the testbed's vocabulary comes from its tokenizer; module names do not depend on it (nor
        # on the special ids, given inside it so transformers does not warn about GPT-2's 50256)
        arch = {"vocab_size": 64, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, **arch}
        conf = AutoConfig.for_model(mt, **arch)
    elif c.policy.path is not None and os.path.isfile(os.path.join(str(c.policy.path), "config.json")):
        conf = AutoConfig.from_pretrained(str(c.policy.path))
    else:
        return None
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(conf)


class GradOnlyDropout(nn.Module):
    """Dropout with probability ``p`` in forwards that build a graph, the identity otherwise:
    the update's forward trains through dropped-out adapters, and every no-grad pass (sampling,
    old and reference log-probs, evaluation) sees the policy as it samples."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.dropout(x, self.p, training=torch.is_grad_enabled())


def add_adapters(model: nn.Module, lora, seed: int = 0) -> Any:
    """``model`` with LoRA adapters on the targeted modules (``peft.get_peft_model``): returns
    the ``PeftModel``; its ``base_model.model`` is ``model`` itself, adapted in place, through
    which the trainer's forwards go. Base weights frozen, adapters fp32 (peft's
    ``autocast_adapter_dtype``). ``A`` is drawn from its own generator seeded with ``seed``, so
    a run's adapters do not depend on what drew random numbers before (a cold or warm cache)
    and every rank draws the same."""
    import peft

    targets = check_targets(model, lora)
    conf = peft.LoraConfig(r=lora.r, lora_alpha=alpha_of(lora), lora_dropout=0.0, target_modules=targets,
                           bias="none", task_type="CAUSAL_LM",
                           fan_in_fan_out=model.config.model_type == "gpt2")  # GPT-2's Conv1D stores W transposed
    devices = [model.device.index or 0] if model.device.type == "cuda" else []
    with warnings.catch_warnings(), torch.random.fork_rng(devices=devices):
        warnings.simplefilter("ignore", FutureWarning)  # peft asks transformers a deprecated question
        torch.manual_seed(seed)
        pm = peft.get_peft_model(model, conf)
    if lora.dropout > 0:
        for mod in model.modules():
            if isinstance(getattr(mod, "lora_dropout", None), nn.ModuleDict):
                for name in mod.lora_dropout:
                    mod.lora_dropout[name] = GradOnlyDropout(lora.dropout)
    return pm


def lora_layers(model: nn.Module) -> list[nn.Module]:
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer)]


class AdaptersOff:
    """The policy with its LoRA adapters disabled, used as the frozen reference: called like a
    model, it runs the policy's module (the same object, so under DeepSpeed the engine's
    parameter hooks apply) with every LoRA layer computing its base layer alone, which is the
    base model exactly. Anything else (``config``, ``base_model``, ``get_input_embeddings``,
    ``forward``'s signature, ``parameters``) is the policy's."""

    def __init__(self, policy: nn.Module) -> None:
        self._policy = policy
        self._layers = lora_layers(policy)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        was = [layer._disable_adapters for layer in self._layers]
        for layer in self._layers:
            layer._disable_adapters = True  # peft's flag: forward = base_layer(x)
        try:
            return self._policy(*args, **kwargs)
        finally:
            for layer, w in zip(self._layers, was, strict=True):
                layer._disable_adapters = w

    def __getattr__(self, name: str) -> Any:
        return getattr(self._policy, name)


def trunk_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s parameters and buffers by name, the base weights of LoRA layers under their
    unadapted names and the adapters left out: what the module computes with adapters disabled,
    comparable with an unadapted model's (:func:`datc.forward.trunk.shared_trunk_depth`)."""
    out = {}
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if "lora_" in name:
            continue
        out[name.replace(".base_layer.", ".")] = t
    return out


def peft_state_dict(pm, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter weights of ``PeftModel`` ``pm`` as ``save_pretrained`` writes them, from the
    adapted module's state (keys as ``pm.base_model.model`` names them)."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(pm, state_dict={f"base_model.model.{k}": v for k, v in state.items()})


def save_adapter(pm, tok, out, state: dict[str, torch.Tensor], merge: bool = False, exist: str = "refuse",
                 marker: dict | None = None, base: str | None = None):
    """The adapters of ``pm`` (with the adapted module's weights ``state``, gathered) and the
    tokenizer saved into ``out``: ``save_pretrained`` of the adapter (``adapter_config.json``,
    ``adapter_model.safetensors``; ``PeftModel.from_pretrained(base, out)`` loads it), or with
    ``merge`` the base with ``W + (alpha / r) B A`` folded in, a plain checkpoint that
    ``AutoModelForCausalLM.from_pretrained(out)`` loads. The tokenizer pads on the left, as the
    policy did; ``exist`` and ``marker`` as :func:`datc.models.build.save_pretrained_dir`'s. ``base``
    (a local base checkpoint, e.g. the testbed's warm start in the cache): copied into
    ``out/base`` and named by the adapter's ``base_model_name_or_path``, so the export stands on
    its own (``PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(out / "base"), out)``
    wherever the folder is moved; ``AutoPeftModelForCausalLM.from_pretrained(out)`` where it was written)."""
    from datc.atomic import atomic_dir, atomic_write_json
    from datc.models.build import EXPORT_MARKER as MARKER
    from datc.models.build import save_tokenizer

    module = pm.base_model.model
    with atomic_dir(out, exist) as tmp:
        if merge:
            module.load_state_dict(state, strict=False)
            merged = pm.merge_and_unload()
            merged.save_pretrained(tmp)
        else:
            pm.save_pretrained(tmp, state_dict={f"base_model.model.{k}": v for k, v in state.items()})
            if base is not None and os.path.isdir(base):
                import json
                import shutil

                shutil.copytree(base, tmp / "base")
                conf = json.loads((tmp / "adapter_config.json").read_text())
                conf["base_model_name_or_path"] = str(Path(out).resolve() / "base")
                atomic_write_json(tmp / "adapter_config.json", conf)
        save_tokenizer(tok, tmp)
        if marker is not None:
            atomic_write_json(tmp / MARKER, marker)
    return out


def trained_state(module: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The entries of ``state`` (``module``'s state dict) that training changes: all of them for
    a full policy, the trainable parameters (a LoRA policy's adapters) when some are frozen."""
    params = list(module.named_parameters())
    if all(p.requires_grad for _, p in params):
        return state
    names = {n for n, p in params if p.requires_grad}
    return {k: v for k, v in state.items() if k in names}


def load_trained_state(module: nn.Module, state: dict[str, torch.Tensor], what: str) -> None:
    """``state`` (:func:`trained_state`) into ``module``: every key must match; with frozen
    parameters exactly the trainable ones must be there."""
    if all(p.requires_grad for p in module.parameters()):
        module.load_state_dict(state)
        return
    names = {n for n, p in module.named_parameters() if p.requires_grad}
    if set(state) != names:
        raise ConfigError(f"policy.lora: {what} holds other trained tensors than this policy's adapters (missing "
                          f"{sorted(names - set(state))[:3]}, unexpected {sorted(set(state) - names)[:3]}); resume it "
                          "with the policy.lora it was written with")
    module.load_state_dict(state, strict=False)
