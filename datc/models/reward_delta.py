"""A reward model's trained part as a small file that every machine turns into the same weights.

A reward model made from the policy (``reward.init: policy``) is the policy's weights plus what
the prepare trains. Training it again on another machine gives other bits (another CPU kind,
another summation order: ``docs/real-models.md``), so the real preset ships what it trained:
LoRA factors ``A`` (r, d_in) and ``B`` (d_out, r) of the top blocks' projections, each stored as
16-bit integers times a power of two, and the few small tensors trained whole (final norm, score
head) as float32. :func:`apply_delta` adds ``(alpha / r) B A`` to the base weights with integer
arithmetic held exactly in float64 (every product and partial sum of the integer factors is an
integer below 2**53, whatever order a BLAS adds them in), scaled by powers of two (exact), then
element-wise IEEE operations only (the scale ``alpha / r``, the sum with the base weight in float64,
the rounding to float32: each correctly rounded, so the same on any machine): the merged weights
are the same bits everywhere, so the reward model's file hash can be pinned and checked anywhere.

LoRA as ``peft`` computes it (Hu et al. 2021, arXiv:2106.09685): ``W x + (alpha / r) B A x``.
Training (:func:`add_adapters`, :func:`take_delta`) uses ``peft``'s layers; the merge is this
module's own, since ``peft``'s ``merge_and_unload`` rounds through the machine's matmul.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from datc.errors import ConfigError

FORMAT = 1
QMAX = 32767  # int16 factors: |q| <= 2**15 - 1; a product < 2**30, a rank-r sum < 2**53 for r < 2**23


@dataclass
class RewardDelta:
    """``factors``: module name -> (A as int16, its exponent, B as int16, its exponent), the
    factor being ``q * 2**exp``; ``whole``: parameter name -> float32 tensor; ``meta``: rank,
    alpha and whatever the maker records (the base's hash, the fit's report)."""

    rank: int
    alpha: float
    factors: dict[str, tuple[Tensor, int, Tensor, int]] = field(default_factory=dict)
    whole: dict[str, Tensor] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)


def quantize(x: Tensor) -> tuple[Tensor, int]:
    """``x`` as int16 ``q`` and an exponent ``e`` with ``q * 2**e`` close to ``x`` (the largest
    entry kept to 1 part in 32767; round half to even). A zero tensor is ``(0, 0)``."""
    x = x.detach().double()
    amax = float(x.abs().max()) if x.numel() else 0.0
    if amax == 0.0:
        return torch.zeros(x.shape, dtype=torch.int16), 0
    e = math.ceil(math.log2(amax / QMAX))
    q = torch.round(x * math.ldexp(1.0, -e)).clamp_(-QMAX, QMAX)  # a power of two: exact
    return q.to(torch.int16), e


def dequantize(q: Tensor, e: int) -> Tensor:
    """``q * 2**e`` in float64 (exact)."""
    return q.double() * math.ldexp(1.0, e)


def delta_weight(a: Tensor, ea: int, b: Tensor, eb: int, scaling: float) -> Tensor:
    """``scaling * B A`` in float64, the same bits on any machine: ``B_q A_q`` is a matrix
    product of integers whose every partial sum is an integer below 2**53 (exact in float64
    in any order of addition), then scaled by ``2**(ea + eb)`` (exact) and by ``scaling`` (one
    rounding)."""
    if a.dtype != torch.int16 or b.dtype != torch.int16 or a.shape[0] != b.shape[1]:
        raise ValueError(f"reward delta: factors must be int16 of one rank, got A {a.dtype} {tuple(a.shape)}, "
                         f"B {b.dtype} {tuple(b.shape)}")
    if a.shape[0] > 2 ** 22:
        raise ValueError(f"rank {a.shape[0]} too large for an exact float64 sum")
    prod = b.double() @ a.double()
    return prod * math.ldexp(1.0, ea + eb) * scaling


def apply_delta(model: nn.Module, delta: RewardDelta) -> None:
    """Add ``delta`` to ``model``'s weights in place: ``W <- float32(W + (alpha / r) B A)`` for each
    adapted module, the whole tensors copied. Refuses a name the model lacks, a shape that differs
    or factors that are not int16 of the delta's rank, before changing anything."""
    params = dict(model.named_parameters())
    scaling = delta.alpha / delta.rank
    for name, (a, _, b, _) in delta.factors.items():
        if a.dtype != torch.int16 or b.dtype != torch.int16 or a.shape[0] != delta.rank or b.shape[1] != delta.rank:
            raise ValueError(f"reward delta: {name}'s factors are not int16 of rank {delta.rank} "
                             f"(A {a.dtype} {tuple(a.shape)}, B {b.dtype} {tuple(b.shape)})")
        w = params.get(f"{name}.weight")
        if w is None:
            raise ValueError(f"reward delta: the model has no module {name!r}")
        if tuple(w.shape) != (b.shape[0], a.shape[1]):
            raise ValueError(f"reward delta: {name} is {tuple(w.shape)} in the model, {(b.shape[0], a.shape[1])} in the delta")
    for name, t in delta.whole.items():
        if name not in params or params[name].shape != t.shape:
            raise ValueError(f"reward delta: {name} {tuple(t.shape)} does not match the model "
                             f"({tuple(params[name].shape) if name in params else 'missing'})")
    with torch.no_grad():
        for name, (a, ea, b, eb) in delta.factors.items():
            w = params[f"{name}.weight"]
            merged = w.double() + delta_weight(a, ea, b, eb, scaling)
            w.copy_(merged.to(w.dtype))
        for name, t in delta.whole.items():
            params[name].copy_(t)


def add_adapters(model: nn.Module, layers: list[int], targets: list[str], rank: int, alpha: float, seed: int) -> list[str]:
    """``peft`` LoRA adapters of rank ``rank`` on the ``targets`` projections of blocks ``layers``
    (``model.model.layers``), ``A`` drawn from ``seed`` and ``B`` zero: the model computes what it
    did. Their parameters train; nothing else is changed. Returns the adapted modules' names."""
    from peft import LoraConfig, inject_adapter_in_model

    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    cfg = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=list(targets),
                     layers_to_transform=list(layers), layers_pattern="layers", bias="none")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        inject_adapter_in_model(cfg, model)
    for n, p in model.named_parameters():  # peft freezes what is not an adapter: the caller's choice stands
        p.requires_grad_(("lora_" in n) or _base_name(n) in trainable)
    return sorted(n[: -len(".base_layer")] for n, _ in model.named_modules() if n.endswith(".base_layer"))


def _base_name(n: str) -> str:
    return n.replace(".base_layer", "")


def take_delta(model: nn.Module, rank: int, alpha: float, whole: list[str], meta: dict[str, Any] | None = None) -> RewardDelta:
    """The adapters of :func:`add_adapters` quantized into a :class:`RewardDelta` (with the
    parameters named in ``whole``), the adapters removed, and the delta applied with
    :func:`apply_delta`: afterwards ``model`` is exactly what any machine builds from the base
    and the delta."""
    from peft.tuners.lora import LoraLayer

    delta = RewardDelta(rank, float(alpha), meta=dict(meta or {}))
    for name, mod in list(model.named_modules()):
        if not isinstance(mod, LoraLayer):
            continue
        (adapter,) = mod.lora_A.keys()
        a, ea = quantize(mod.lora_A[adapter].weight)
        b, eb = quantize(mod.lora_B[adapter].weight)
        delta.factors[name] = (a, ea, b, eb)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, mod.get_base_layer())
    if hasattr(model, "peft_config"):  # peft's record of the adapters, gone with them
        del model.peft_config
    params = dict(model.named_parameters())
    delta.whole = {n: params[n].detach().float().clone() for n in whole}
    apply_delta(model, delta)
    return delta


def save_delta(delta: RewardDelta, path: str | Path) -> None:
    """Write ``delta`` as one safetensors file (its meta as JSON in the file's metadata)."""
    from safetensors.torch import save_file

    tensors: dict[str, Tensor] = {}
    for name, (a, ea, b, eb) in delta.factors.items():
        tensors[f"lora.{name}.A"], tensors[f"lora.{name}.B"] = a.contiguous(), b.contiguous()
        tensors[f"lora.{name}.exp"] = torch.tensor([ea, eb], dtype=torch.int32)
    for name, t in delta.whole.items():
        tensors[f"whole.{name}"] = t.contiguous()
    head = {"format": FORMAT, "rank": delta.rank, "alpha": delta.alpha, **delta.meta}
    save_file(tensors, str(path), metadata={"datc": json.dumps(head, sort_keys=True)})


def load_delta(path: str | Path) -> RewardDelta:
    """A delta written by :func:`save_delta`."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        head = json.loads((f.metadata() or {}).get("datc", "{}"))
        if head.get("format") != FORMAT:
            raise ValueError(f"{path}: not a reward delta of format {FORMAT} (found {head.get('format')!r})")
        t = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no iterator)
    delta = RewardDelta(int(head.pop("rank")), float(head.pop("alpha")), meta={k: v for k, v in head.items() if k != "format"})
    for k in sorted(t):
        if k.startswith("lora.") and k.endswith(".exp"):
            name = k[len("lora."): -len(".exp")]
            ea, eb = (int(v) for v in t[k].tolist())
            delta.factors[name] = (t[f"lora.{name}.A"], ea, t[f"lora.{name}.B"], eb)
        elif k.startswith("whole."):
            delta.whole[k[len("whole."):]] = t[k]
    return delta



def delta_path(cfg) -> Path:
    """``reward.delta`` as a file: a name in the package's ``configs/reward/`` (where the presets
    keep theirs), else the path as given (absolute, or from the current folder)."""
    from datc.paths import CONFIG_DIR

    given = Path(cfg.reward.delta)
    for p in (Path(CONFIG_DIR) / "reward" / given, given):
        if p.is_file():
            return p
    raise ConfigError(f"reward.delta: no file {cfg.reward.delta!r} (looked in {Path(CONFIG_DIR) / 'reward'} and the "
                      "current folder); null trains the reward model instead")


def check_reward_delta(c) -> None:
    """``reward.delta`` and ``reward.train.lora_r`` against the rest of ``reward``, before any model loads."""
    r = c.reward
    if r.delta is not None:
        if r.path is not None:
            raise ConfigError(f"reward.delta: applies to the policy's weights (reward.init=policy), not to reward.path={r.path!r}; "
                              "set one of them to null")
        if r.init != "policy":
            raise ConfigError(f"reward.delta: applies to the policy's weights, so reward.init must be policy (got {r.init!r})")
        delta_path(c)
    if r.train.lora_r > 0 and r.train.trainable_layers == 0 and r.path is None and r.delta is None:
        raise ConfigError("reward.train.lora_r: adapters go on the top reward.train.trainable_layers blocks; set "
                          "trainable_layers > 0 (or lora_r=0 to train every layer whole)")
