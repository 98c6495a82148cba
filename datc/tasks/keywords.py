"""``keywords``: the dense task. "write about <topic> :" → a response whose every token counts.

The eight topics' 96 keywords form two camps (``CAMPS``): the keywords of sports, music, food
and space are *good*, those of ocean, forest, city and winter *bad*. Gold contribution of a
response token: ``+1/L`` for a good keyword, ``-1/L`` for a bad one, ``0`` for filler
(``L = norm_len``); the gold reward is their sum, in ``[-1, 1]``. Many tokens matter, each a
little: credit is dense.

The rule does not depend on the prompt. Prompt-dependent rules (the prompt topic's own
keywords; the camp of the prompt's topic; three keywords named in the prompt) were tried on
the 2-layer testbed models: the reward models fit some of them, but neither the supervised
warm start nor 300 GRPO steps taught the policies to condition on the prompt, so gold did not
move. The sparse task (``arithmetic``) is the prompt-dependent one.
"""

from __future__ import annotations

import random
from typing import Any

from datc.tasks.base import EOS, FILLER, SPECIAL_TOKENS, TASKS, TOPICS, Task, vocabulary

_TOPIC_NAMES = list(TOPICS)
CAMPS = (_TOPIC_NAMES[:4], _TOPIC_NAMES[4:])
GOOD = 0  # index of the good camp
CAMP_WORDS = tuple(sorted(k for t in camp for k in TOPICS[t]) for camp in CAMPS)
_CAMP_OF_WORD = {k: i for i, words in enumerate(CAMP_WORDS) for k in words}
_ANY_WORD = [w for w in vocabulary() if w not in SPECIAL_TOKENS]


@TASKS.register("keywords")
class KeywordsTask(Task):
    name = "keywords"

    def make_example(self, rng: random.Random) -> dict[str, Any]:
        topic = rng.choice(_TOPIC_NAMES)
        return {"prompt": f"write about {topic} :", "topic": topic}

    def contributions(self, example: dict[str, Any], tokens: list[str]) -> list[float]:
        unit = 1.0 / self.max_new_tokens
        out = []
        for tok in tokens:
            c = _CAMP_OF_WORD.get(tok)
            out.append(0.0 if c is None else (unit if c == GOOD else -unit))
        return out

    def _mix(self, example, rng, n, p_on, p_off) -> list[str]:
        camp = GOOD
        words = []
        for _ in range(n):
            u = rng.random()
            if u < p_on:
                words.append(rng.choice(CAMP_WORDS[camp]))
            elif u < p_on + p_off:
                words.append(rng.choice(CAMP_WORDS[1 - camp]))
            else:
                words.append(rng.choice(FILLER))
        return words

    def demonstration(self, example, rng):
        # Mostly filler with some keywords of either camp: gold starts near 0, far from its top.
        n = rng.randint(4, self.max_new_tokens - 1)
        return self._mix(example, rng, n, rng.uniform(0.0, 0.3), rng.uniform(0.0, 0.3)) + [EOS]

    def perturbations(self, example, rng):
        out = []
        for p_on, p_off in [(1.0, 0.0), (0.0, 1.0), (0.6, 0.2), (0.2, 0.6)]:
            n = rng.randint(2, self.max_new_tokens - 1)
            out.append(self._mix(example, rng, n, p_on, p_off) + [EOS])
        # Repetition of one keyword, and a response that runs to the length limit.
        out.append([rng.choice(CAMP_WORDS[GOOD])] * rng.randint(2, self.max_new_tokens - 1) + [EOS])
        out.append(self._mix(example, rng, self.max_new_tokens, rng.random(), rng.random() * 0.3))
        # Any words at all, and one word repeated: a policy under RL finds what the reward model
        # never saw (repeating a topic name was the first exploit found without these).
        out.append(rng.choices(_ANY_WORD, k=rng.randint(1, self.max_new_tokens)))
        out.append([rng.choice(_ANY_WORD)] * rng.randint(2, self.max_new_tokens))
        return [r if len(r) >= self.max_new_tokens or r[-1] == EOS else r + [EOS] for r in out]

    def edit(self, example, tokens, rng):
        body = [t for t in tokens if t != EOS] or [rng.choice(FILLER)]
        out = list(body)
        for _ in range(rng.randint(1, 3)):
            out[rng.randrange(len(out))] = self._mix(example, rng, 1, 0.4, 0.3)[0]
        return out + [EOS]
