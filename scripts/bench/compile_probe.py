"""What fused kernels could buy the testbed step: the policy's forward (no grad, as the reference
pass) and forward + backward (as the update) in eager PyTorch against ``torch.compile`` (inductor),
at one rollout's shape, outside the training step.

    python -m scripts.bench.compile_probe [--repeats 9] [hydra overrides]
    -> results/bench/compile_probe.json, results/bench/compile_probe.md

The testbed step is bound by the count of small operators, not by their arithmetic
(``results/bench/flops_testbed.md``); fusing them is the lever that is left, and this measures how
far it reaches on this CPU before any of it is built into the step. One rollout of the testbed
session gives the shape (B rows of prompt + response, left-padded prompts, the attention mask);
both models are the session's policy, the compiled one ``torch.compile(policy, dynamic=False)``
(one shape: the step's shapes change from step to step, so a compiled step would pad to fixed
shapes or compile for dynamic ones; the first compile's time is stated). Eager and compiled
alternate in each repeat; the ratio is the median over repeats of eager time / compiled time. The
compiled logits are checked against eager's (the largest difference is stated).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from scripts.bench.render import write_result
from scripts.bench.scales import OUT


def timed(fn, n: int) -> float:
    """Seconds per call of ``fn`` over ``n`` calls."""
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def passes(model, ids: torch.Tensor, mask: torch.Tensor) -> dict[str, Any]:
    """The two passes of ``model`` over ids/mask: ``forward`` (no grad) and ``forward_backward``
    (the mean log-softmax's gradient into the parameters, zeroed after)."""
    am = mask.long()

    def forward():
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=am).logits

    def forward_backward():
        out = model(input_ids=ids, attention_mask=am).logits
        torch.log_softmax(out.float(), -1).mean().backward()
        for p in model.parameters():
            p.grad = None

    return {"forward": forward, "forward_backward": forward_backward}


def markdown(res: dict[str, Any]) -> str:
    rows = ["| pass | eager ms | compiled ms | eager / compiled (quartiles) | first compile s |", "|---|---|---|---|---|"]
    for name, r in res["passes"].items():
        rows.append(f"| {name} | {r['eager_ms']:.2f} | {r['compiled_ms']:.2f} | **{r['ratio']:.2f}** "
                    f"({r['ratio_q1']:.2f} to {r['ratio_q3']:.2f}) | {r['compile_s']:.1f} |")
    la = res["load_average_1_5_15min"]
    return f"""# Eager against `torch.compile` for the testbed policy's passes

Written by `{res['command']}` (`scripts/bench/compile_probe.py`) at commit `{res['commit']}` ({res['date']}),
torch {res['machine']['torch']}, {res['threads']} torch thread(s), {res['machine']['cpus']} CPUs; load average
(1, 5, 15 min) {la['start']} at the start, {la['end']} at the end.

Shape: {res['shape']}. Outside the training step: what fusing the step's small operators could buy,
not a switch of this project. Medians over {res['repeats']} repeats of {res['calls']} calls each, eager and
compiled alternating; the compiled logits differ from eager's by at most {res['max_abs_diff']:.2e}.

{chr(10).join(rows)}
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.bench.compile_probe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--calls", type=int, default=20, help="calls per timing")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("overrides", nargs="*", help="hydra overrides (e.g. policy=tiny_llama)")
    a = ap.parse_args(argv)
    from datc.run.provenance import load_average, provenance
    from datc.utils import quiet_libraries
    from scripts.bench.datc_side import datc_session

    quiet_libraries()
    torch.set_num_threads(a.threads)
    load_start = load_average()
    s = datc_session(list(a.overrides))
    ro = s.stream.take(s, 0)
    ids = torch.cat([ro.prompt_ids, ro.response_ids], 1)
    mask = torch.cat([ro.prompt_mask, ro.response_mask], 1)
    policy = s.m.policy
    policy.train(False)
    eager = passes(policy, ids, mask)
    compiled_model = torch.compile(policy, dynamic=False)
    compiled = passes(compiled_model, ids, mask)
    res: dict[str, Any] = {
        **provenance(" ".join(["python -m scripts.bench.compile_probe", *(argv if argv is not None else sys.argv[1:])])),
        "threads": a.threads, "repeats": a.repeats, "calls": a.calls, "passes": {},
        "shape": f"{ids.shape[0]} rows × {ids.shape[1]} tokens (prompts {ro.prompt_ids.shape[1]}, responses "
                 f"{ro.response_ids.shape[1]}), policy {s.c.policy.name} "
                 f"({sum(p.numel() for p in policy.parameters()) / 1e6:.3g}M parameters)"}
    for name in ("forward", "forward_backward"):
        t0 = time.perf_counter()
        compiled[name]()  # the first call compiles
        compile_s = time.perf_counter() - t0
        eager[name]()
        e, c = [], []
        for _ in range(a.repeats):
            e.append(timed(eager[name], a.calls))
            c.append(timed(compiled[name], a.calls))
        ratios = sorted(x / y for x, y in zip(e, c, strict=True))
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        res["passes"][name] = {"eager_ms": statistics.median(e) * 1e3, "compiled_ms": statistics.median(c) * 1e3,
                               "ratio": statistics.median(ratios), "ratio_q1": q[0], "ratio_q3": q[2],
                               "compile_s": compile_s}
    res["max_abs_diff"] = float((eager["forward"]() - compiled["forward"]()).abs().max())
    res["load_average_1_5_15min"] = {"start": load_start, "end": load_average()}
    print(write_result(Path(a.out), "compile_probe", res, markdown(res)).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
