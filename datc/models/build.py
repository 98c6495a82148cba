"""Policy and reward models: tiny ones built from config for the testbed, real ones loaded by
hub id or local directory through the same ``from_pretrained`` path."""

from __future__ import annotations

import errno
import functools
import inspect
import os
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    PreTrainedModel,
)

from datc.atomic import atomic_dir, atomic_write_json
from datc.errors import first_line, full_disk

# Said, not detected, on a machine without CUDA: DeepSpeed (imported by transformers' loading
# path) otherwise logs "Setting accelerator to CPU" on every command.
if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
    os.environ["DS_ACCELERATOR"] = "cpu"


class ModelLoadError(RuntimeError):
    """A model or tokenizer that cannot be loaded, with how to point at a local copy."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("trainer.device=cuda but no CUDA device is visible; use trainer.device=cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: bfloat16 on a GPU that supports it, float32 otherwise (CPU runs stay fp32)."""
    if name == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    return getattr(torch, name)


def _model_config(arch: dict[str, Any], tokenizer, **extra: Any):
    arch = dict(arch)
    model_type = arch.pop("model_type")
    return AutoConfig.for_model(
        model_type,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **arch,
        **extra,
    )


def build_causal_lm(arch: dict[str, Any], tokenizer, seed: int) -> PreTrainedModel:
    """A randomly initialised causal LM of ``arch["model_type"]`` (e.g. gpt2, llama, qwen2)."""
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(_model_config(arch, tokenizer))


def build_reward_model(arch: dict[str, Any], tokenizer, seed: int) -> PreTrainedModel:
    """A randomly initialised ``...ForSequenceClassification`` with one output (the score)."""
    torch.manual_seed(seed)
    return AutoModelForSequenceClassification.from_config(_model_config(arch, tokenizer, num_labels=1))


def load_pretrained(kind: str, path: str, field: str, dtype: torch.dtype | None = None, gguf_file: str | None = None,
                    num_labels: int | None = None) -> PreTrainedModel:
    """Load a policy (``kind="causal_lm"``) or a reward model (``kind="reward"``) by hub id or
    local directory. Offline, a hub id that is not cached fails at once with a message naming
    the field to set to a local copy. ``gguf_file`` (a file in ``path``) is de-quantized by
    transformers' GGUF reader (needs the ``gguf`` package); ``num_labels=1`` loads a causal LM's
    checkpoint as a reward model with a new one-output head."""
    cls = AutoModelForCausalLM if kind == "causal_lm" else AutoModelForSequenceClassification
    kwargs: dict[str, Any] = {"dtype": dtype} if dtype is not None else {}
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    extra = {"num_labels": num_labels} if num_labels is not None else {}
    config = from_hub(AutoConfig.from_pretrained, path, field, "model", **({"gguf_file": gguf_file} if gguf_file else {}),
                      **extra)
    if getattr(config, "activation_function", None) == "gelu_new":  # GPT-2's tanh-approximate GELU:
        config.activation_function = "gelu_pytorch_tanh"  # the same formula as one fused kernel (5-15% of a testbed step)
    model = from_hub(cls.from_pretrained, path, field, "model", config=config, **kwargs)
    if kind == "reward" and model.config.num_labels != 1:
        raise ModelLoadError(
            f"{field}={path!r} has {model.config.num_labels} outputs; a reward model must have exactly one"
        )
    return model


def from_hub(load, path: str, field: str, what: str = "model", **kwargs: Any):
    """``load(path, **kwargs)`` (any ``from_pretrained``) for a hub id or a local directory.
    Offline, a hub id that is not cached fails at once with a message naming the checkpoint and
    the field to set to a local copy."""
    path = str(path)
    check_model_path(path, field, what, gguf_file=kwargs.get("gguf_file"))
    if not os.path.isdir(path):
        # Try the local cache first so that an offline machine never waits on the network.
        try:
            return load(path, local_files_only=True, **kwargs)
        except OSError:
            pass
        unreachable = hub_unreachable()
        if unreachable:  # fail at once instead of minutes of retries per file
            raise ModelLoadError(
                f"{field}={path!r} is neither a local directory nor a cached hub {what}, and the hub cannot be "
                f"reached ({unreachable}). Download it on a machine with network access "
                f"(`hf download {path} --local-dir DIR`) and set {field}=DIR to the local copy."
            )
    try:
        return load(path, **kwargs)
    except OSError as e:
        if os.path.isdir(path):
            raise ModelLoadError(f"{field}={path!r}: the directory does not hold a loadable {what} ({e})") from None
        raise ModelLoadError(
            f"{field}={path!r} is neither a local directory nor a cached hub {what}, and the hub could "
            f"not be reached. Download it on a machine with network access "
            f"(`hf download {path} --local-dir DIR`) and set {field}=DIR to the local copy."
        ) from None


def looks_local(path: str) -> bool:
    """A filesystem path rather than a hub id (``org/name`` or ``name``): absolute, relative
    with ``./``, ``../`` or ``~``, or with more than one ``/``."""
    return path.startswith(("/", "./", "../", "~", ".\\")) or path in (".", "..") or path.count("/") > 1


def check_model_path(path: str, field: str, what: str = "model", gguf_file: str | None = None) -> None:
    """A local ``policy.path`` / ``reward.path`` / ``policy.tokenizer`` that does not exist, or a
    directory without the files of a ``what`` (model or tokenizer), or without its ``gguf_file``
    (a path inside the directory, which holds model and tokenizer alike), is said in one line
    before anything loads."""
    path = os.path.expanduser(str(path))
    if not os.path.exists(path):
        if looks_local(path):
            raise ModelLoadError(f"{field}={path!r}: no such file or directory (a local path; a hub id looks like org/name)")
        return
    if not os.path.isdir(path):
        return
    if gguf_file is not None:
        if not os.path.isfile(os.path.join(path, gguf_file)):
            raise ModelLoadError(f"{field}={path!r}: no GGUF file {gguf_file!r} inside it (policy.gguf_file)")
        return
    names = set(os.listdir(path))
    needed = TOKENIZER_FILES if what == "tokenizer" else {"config.json"}
    if not names & needed and not any(n.endswith(".gguf") for n in names):
        raise ModelLoadError(
            f"{field}={path!r}: the directory holds no {what} (none of {', '.join(sorted(needed))}); point {field} at "
            "a directory saved with save_pretrained, or at a hub id"
        )


TOKENIZER_FILES = {"tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "config.json"}

HUB_PROBE_TIMEOUT_S = 5.0


@functools.lru_cache(maxsize=1)
def hub_unreachable() -> str | None:
    """Why the Hugging Face hub cannot be reached now (checked once per process, one HEAD
    request with a short timeout and no retries, through the hub client's own proxies), or
    None if it answers at all."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    try:
        from huggingface_hub.utils import get_session

        get_session().head(constants.ENDPOINT, timeout=HUB_PROBE_TIMEOUT_S)
    except Exception as e:  # noqa: BLE001  any transport error means: not reachable
        return f"{constants.ENDPOINT}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'no answer'}"
    return None


def freeze(model: PreTrainedModel) -> PreTrainedModel:
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


EXPORT_MARKER = "datc_export.json"  # in every datc-export output: the run and checkpoint it holds


def save_tokenizer(tok, out) -> None:
    """``tok`` saved with its padding side, so every loader pads as the policy did (left)."""
    tok.init_kwargs["padding_side"] = tok.padding_side
    tok.save_pretrained(out)


def decoder_layers(model) -> list | None:
    """The decoder blocks of a causal LM (``base_model.layers``: Llama, Qwen, Mistral;
    ``base_model.h``: GPT-2), or None for another layout. A DeepSpeed engine's are its module's."""
    base = getattr(getattr(model, "module", model), "base_model", None)
    layers = getattr(base, "layers", None)
    if layers is None:
        layers = getattr(base, "h", None)
    return list(layers) if layers is not None else None


def cache_kwarg(model) -> str:
    """The forward's name for the KV cache: ``cache`` (transformers 5) or ``past_key_values``;
    a wrapper's (DeepSpeed's engine) is its module's."""
    model = getattr(model, "module", model)
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def save_pretrained_dir(model, tok, out: str | Path, state_dict: dict[str, torch.Tensor] | None = None,
                        exist: str = "refuse", marker: dict | None = None) -> Path:
    """``model`` (with ``state_dict`` as its weights, if given) and ``tok`` saved with
    ``save_pretrained`` into ``out``, which appears complete or not at all (``exist``: what an
    ``out`` already there means, :func:`datc.atomic.atomic_dir`)."""
    out = Path(out)
    try:
        with atomic_dir(out, exist) as tmp:
            model.save_pretrained(tmp, state_dict=state_dict)
            save_tokenizer(tok, tmp)
            if marker is not None:
                atomic_write_json(tmp / EXPORT_MARKER, marker)
    except Exception as e:  # safetensors says a full disk in its own error: an OSError, said in one line above
        if isinstance(e, OSError) or not full_disk(e):
            raise
        raise OSError(errno.ENOSPC, f"No space left on device (or quota exceeded) while writing {out.name}/ "
                                    f"({type(e).__name__}: {first_line(e, 160)}); nothing of it was left", str(out)) from e
    return out
