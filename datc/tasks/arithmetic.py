"""``arithmetic``: the sparse task. "compute a plus b =" → scratchpad filler, then an answer.

The answer is the first number token of the response. Its gold contribution is
``max(-1, 1 - |n - (a + b)| / 2)`` (1 if exact, 0.5 if off by one, negative when far off);
every other token contributes 0, and a response without a number has gold 0. One decisive
token among filler: credit is sparse.
"""

from __future__ import annotations

import random
from typing import Any

from datc.tasks.base import EOS, MAX_NUMBER, SCRATCH, TASKS, Task

_NUMBERS = {str(i): i for i in range(MAX_NUMBER + 1)}


@TASKS.register("arithmetic")
class ArithmeticTask(Task):
    name = "arithmetic"

    def make_example(self, rng: random.Random) -> dict[str, Any]:
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        return {"prompt": f"compute {a} plus {b} =", "a": a, "b": b}

    def contributions(self, example: dict[str, Any], tokens: list[str]) -> list[float]:
        out = [0.0] * len(tokens)
        target = example["a"] + example["b"]
        for i, tok in enumerate(tokens):
            if tok in _NUMBERS:
                out[i] = max(-1.0, 1.0 - abs(_NUMBERS[tok] - target) / 2.0)
                break
        return out

    def _response(self, rng, answer: int, n_scratch: int) -> list[str]:
        return [rng.choice(SCRATCH) for _ in range(n_scratch)] + ["answer", str(answer), EOS]

    def demonstration(self, example, rng):
        # Right 30% of the time, otherwise off by 1-4: the warm policy knows the format.
        s = example["a"] + example["b"]
        ans = s if rng.random() < 0.3 else min(MAX_NUMBER, max(0, s + rng.choice([-4, -3, -2, -1, 1, 2, 3, 4])))
        return self._response(rng, ans, rng.randint(1, self.max_new_tokens - 4))

    def perturbations(self, example, rng):
        s = example["a"] + example["b"]
        out = [self._response(rng, s, rng.randint(0, self.max_new_tokens - 4)) for _ in range(3)]
        out += [self._response(rng, rng.randint(0, MAX_NUMBER), rng.randint(0, self.max_new_tokens - 4)) for _ in range(3)]
        out.append([rng.choice(SCRATCH) for _ in range(rng.randint(1, self.max_new_tokens - 1))] + [EOS])
        return out

    def edit(self, example, tokens, rng):
        s = example["a"] + example["b"]
        out = [t for t in tokens if t != EOS]
        nums = [i for i, t in enumerate(out) if t in _NUMBERS]
        new = str(min(MAX_NUMBER, max(0, s + rng.choice([-3, -2, -1, 0, 0, 0, 1, 2, 3]))))
        if nums:
            out[nums[0]] = new
        else:
            out = out[: self.max_new_tokens - 3] + ["answer", new]
        if out and rng.random() < 0.3:  # and a scratchpad token changed, which must not matter
            i = rng.randrange(len(out))
            if out[i] in SCRATCH:
                out[i] = rng.choice(SCRATCH)
        return out + [EOS]
