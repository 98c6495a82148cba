"""``keywords``: the dense task. "write about <topic> :" → a response whose every token counts.

Gold contribution of a response token: ``+1/L`` for a keyword of the prompt's topic, ``-1/L``
for a keyword of any other topic, ``0`` for filler (``L = max_new_tokens``). The gold reward
is their sum, in ``[-1, 1]``. Many tokens matter, each a little: credit is dense.
"""

from __future__ import annotations

import random
from typing import Any

from datc.tasks.base import EOS, FILLER, TASKS, TOPICS, Task

_OWNER = {k: topic for topic, ks in TOPICS.items() for k in ks}


@TASKS.register("keywords")
class KeywordsTask(Task):
    name = "keywords"

    def make_example(self, rng: random.Random) -> dict[str, Any]:
        topic = rng.choice(sorted(TOPICS))
        return {"prompt": f"write about {topic} :", "topic": topic}

    def contributions(self, example: dict[str, Any], tokens: list[str]) -> list[float]:
        unit = 1.0 / self.max_new_tokens
        out = []
        for tok in tokens:
            owner = _OWNER.get(tok)
            out.append(0.0 if owner is None else (unit if owner == example["topic"] else -unit))
        return out

    def _mix(self, example, rng, n, p_on, p_off) -> list[str]:
        others = [t for t in TOPICS if t != example["topic"]]
        words = []
        for _ in range(n):
            u = rng.random()
            if u < p_on:
                words.append(rng.choice(TOPICS[example["topic"]]))
            elif u < p_on + p_off:
                words.append(rng.choice(TOPICS[rng.choice(others)]))
            else:
                words.append(rng.choice(FILLER))
        return words

    def demonstration(self, example, rng):
        # Mostly filler with some keywords of either sign: gold starts low but not at the floor.
        n = rng.randint(4, self.max_new_tokens - 1)
        return self._mix(example, rng, n, rng.uniform(0.0, 0.4), rng.uniform(0.0, 0.3)) + [EOS]

    def perturbations(self, example, rng):
        out = []
        for p_on, p_off in [(1.0, 0.0), (0.0, 1.0), (0.7, 0.1), (0.1, 0.7), (0.5, 0.0), (0.0, 0.0)]:
            n = rng.randint(2, self.max_new_tokens - 1)
            out.append(self._mix(example, rng, n, p_on, p_off) + [EOS])
        # Repetition of a single keyword and responses that run to the length limit.
        kw = rng.choice(TOPICS[example["topic"]])
        out.append([kw] * rng.randint(2, self.max_new_tokens - 1) + [EOS])
        out.append(self._mix(example, rng, self.max_new_tokens, rng.random(), rng.random() * 0.3))
        return out
