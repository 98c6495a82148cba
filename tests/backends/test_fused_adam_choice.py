"""``deepspeed.optimizer_impl``: which AdamW the policy engine runs, and the arch-list repair that
lets DeepSpeed's FusedAdam JIT build on images whose ``TORCH_CUDA_ARCH_LIST`` holds suffixed
architectures (``9.0a``), which its op builder cannot parse."""

from __future__ import annotations

import logging

import pytest
import torch

from datc.backends.deepspeed_config import sanitized_arch_list, use_torch_adam


@pytest.mark.parametrize(("given", "clean"), [
    ("9.0a", "9.0"), ("8.0;8.6;9.0a;10.0f", "8.0;8.6;9.0;10.0"), ("9.0a+PTX", "9.0+PTX"),
    ("8.0 9.0", "8.0;9.0"), ("9.0;9.0a", "9.0"), ("8.6", "8.6"), ("90", "9.0"),
])
def test_the_arch_list_loses_its_suffixes(given, clean):
    assert sanitized_arch_list(given) == clean


def test_explicit_choices_and_the_cpu_are_decided_without_building():
    def boom():
        raise AssertionError("no build wanted")

    assert use_torch_adam("torch", torch.device("cuda"), boom) is True
    assert use_torch_adam("deepspeed", torch.device("cuda"), boom) is False
    assert use_torch_adam("auto", torch.device("cpu"), boom) is True


def test_auto_on_a_gpu_builds_fused_adam_with_a_clean_arch_list(monkeypatch):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0a")
    seen = []
    assert use_torch_adam("auto", torch.device("cuda"), lambda: seen.append(__import__("os").environ["TORCH_CUDA_ARCH_LIST"])) is False
    assert seen == ["8.0;9.0"]


def test_auto_falls_back_to_torch_adamw_with_one_line_when_the_build_fails(monkeypatch, caplog):
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)

    def fails():
        raise RuntimeError("ninja: build stopped: subcommand failed.\nmore")

    with caplog.at_level(logging.WARNING, logger="datc.backends.distributed"):
        assert use_torch_adam("auto", torch.device("cuda"), fails) is True
    (rec,) = caplog.records
    assert "FusedAdam did not build (RuntimeError: ninja: build stopped" in rec.getMessage() and "more" not in rec.getMessage()
