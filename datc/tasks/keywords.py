"""``keywords``: the dense task. "write with <w1> <w2> <w3> :" → a response whose every token counts.

The prompt names three keywords (drawn from the testbed's 96). Gold contribution of a response
token: ``+1/L`` for one of the prompt's keywords, ``-1/L`` for any other keyword, ``0`` for
filler (``L = norm_len``); the gold reward is their sum. Many tokens matter, each a little:
credit is dense. Whether a keyword helps depends on the prompt, so neither the policy nor the
reward model can score tokens without reading it.
"""

from __future__ import annotations

import random
from typing import Any

from datc.tasks.base import EOS, FILLER, TASKS, TOPICS, Task

KEYWORDS = sorted({k for ks in TOPICS.values() for k in ks})
N_PROMPT_WORDS = 3


@TASKS.register("keywords")
class KeywordsTask(Task):
    name = "keywords"

    def make_example(self, rng: random.Random) -> dict[str, Any]:
        words = rng.sample(KEYWORDS, N_PROMPT_WORDS)
        return {"prompt": f"write with {' '.join(words)} :", "words": words}

    def contributions(self, example: dict[str, Any], tokens: list[str]) -> list[float]:
        unit = 1.0 / self.max_new_tokens
        wanted = set(example["words"])
        return [unit if t in wanted else (-unit if t in _KEYWORD_SET else 0.0) for t in tokens]

    def _mix(self, example, rng, n, p_on, p_off) -> list[str]:
        words = []
        for _ in range(n):
            u = rng.random()
            if u < p_on:
                words.append(rng.choice(example["words"]))
            elif u < p_on + p_off:
                words.append(rng.choice(KEYWORDS))
            else:
                words.append(rng.choice(FILLER))
        return words

    def demonstration(self, example, rng):
        # Mostly filler with some keywords of either sign: gold starts low but not at the floor.
        n = rng.randint(4, self.max_new_tokens - 1)
        return self._mix(example, rng, n, rng.uniform(0.1, 0.6), rng.uniform(0.0, 0.3)) + [EOS]

    def perturbations(self, example, rng):
        out = []
        for p_on, p_off in [(1.0, 0.0), (0.0, 1.0), (0.6, 0.2), (0.2, 0.6)]:
            n = rng.randint(2, self.max_new_tokens - 1)
            out.append(self._mix(example, rng, n, p_on, p_off) + [EOS])
        # Repetition of one wanted keyword, and a response that runs to the length limit.
        out.append([rng.choice(example["words"])] * rng.randint(2, self.max_new_tokens - 1) + [EOS])
        out.append(self._mix(example, rng, self.max_new_tokens, rng.random(), rng.random() * 0.3))
        return out

    def edit(self, example, tokens, rng):
        body = [t for t in tokens if t != EOS] or [rng.choice(FILLER)]
        out = list(body)
        for _ in range(rng.randint(1, 3)):
            out[rng.randrange(len(out))] = self._mix(example, rng, 1, 0.4, 0.3)[0]
        return out + [EOS]


_KEYWORD_SET = set(KEYWORDS)
