"""The optimizer-step interface (:mod:`datc.backends.plain`): the plain PyTorch implementation's step,
skips and the autocast cache it must not leave stale."""

from __future__ import annotations

import math

import torch
from transformers import get_scheduler

from datc.backends.plain import TorchOptimizer


def _opt(model, lr=0.1):
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    return TorchOptimizer(model, opt, get_scheduler("constant", opt), max_grad_norm=1.0)


def test_forwards_after_a_step_in_the_same_autocast_region_use_the_new_weights():
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)
    opt = _opt(lin)
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lin(x).float().pow(2).sum().backward()
        grad_norm, skipped = opt.step(1)
        after = lin(x)  # a mini-batch after the update, as the update phase's next one
    expected = torch.nn.functional.linear(x.bfloat16(), lin.weight.detach().bfloat16(), lin.bias.detach().bfloat16())
    assert not skipped and grad_norm > 0
    assert torch.equal(after, expected)  # not the pre-step weights' cached bf16 copy


def test_a_non_finite_gradient_or_no_backward_takes_no_step_but_the_schedule_advances():
    lin = torch.nn.Linear(2, 2)
    opt = _opt(lin)
    before = lin.weight.detach().clone()
    lin.weight.grad = torch.full_like(lin.weight, math.nan)
    lin.bias.grad = torch.zeros_like(lin.bias)
    grad_norm, skipped = opt.step(1)
    assert skipped and math.isnan(grad_norm) and torch.equal(lin.weight, before)
    opt.zero_grad()
    assert opt.step(0)[1] is True  # nothing backpropagated
    assert opt.sched.last_epoch == 2


def test_a_skipped_first_step_advances_the_schedule_without_torchs_order_warning():
    import warnings

    lin = torch.nn.Linear(2, 2)
    opt = _opt(lin)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        opt.skip()  # a mini-batch without tokens, before any optimizer step
        opt.zero_grad()
        opt.step(0)  # nothing backpropagated: skipped too
    assert opt.sched.last_epoch == 2


def test_no_deepspeed_accelerator_warning_on_a_machine_without_cuda():
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    proc = subprocess.run([sys.executable, "-c", "import datc.models.build, deepspeed, os; print(os.environ.get('DS_ACCELERATOR'))"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    said = proc.stdout.strip().splitlines()[-1]
    assert said == ("None" if torch.cuda.is_available() else "cpu")  # with CUDA, DeepSpeed detects it itself
    assert "Setting accelerator to CPU" not in proc.stdout + proc.stderr
