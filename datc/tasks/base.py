"""The task interface and the word-level vocabulary shared by the testbed tasks."""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from typing import Any

import torch

from datc.registry import Registry

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK]

# Words with no bearing on either task's gold reward: the "filler" a policy writes between
# the tokens that matter.
FILLER = (
    "the a an and of to in is it that this was for on with as be at by from or but not are "
    "so then very also just some more most all any each other such only own same than too "
    "well here there now"
).split()

TOPICS: dict[str, list[str]] = {
    "sports": "ball goal team score match coach player league win race court field".split(),
    "music": "song guitar drum melody band chord rhythm singer piano concert album tune".split(),
    "food": "bread cheese soup apple rice spice bake sauce fruit salad oven honey".split(),
    "space": "star planet orbit comet rocket galaxy moon solar nebula meteor crater telescope".split(),
    "ocean": "wave coral tide whale reef shark shell sailor harbor current island storm".split(),
    "forest": "tree leaf moss pine fern owl trail branch root bark acorn meadow".split(),
    "city": "street tower bridge subway traffic market plaza taxi avenue skyline crowd museum".split(),
    "winter": "snow ice frost sled scarf blizzard cocoa skate glacier chill mitten fireplace".split(),
}
MAX_NUMBER = 18
NUMBERS = [str(i) for i in range(MAX_NUMBER + 1)]
SCRATCH = "let me think step carry check hmm ok add sum first next".split()
PROMPT_WORDS = ["write", "about", ":", "compute", "plus", "=", "answer"]


def vocabulary() -> list[str]:
    """Every word of the testbed, specials first; one word is one token."""
    words = list(SPECIAL_TOKENS)
    for w in PROMPT_WORDS + FILLER + list(TOPICS) + [k for ks in TOPICS.values() for k in ks] + NUMBERS + SCRATCH:
        if w not in words:
            words.append(w)
    return words


class Task(ABC):
    """A prompt distribution with an exactly known gold reward.

    Responses are lists of token strings (the word-level tokenizer maps one word to one
    token), so a token's gold contribution is defined per sampled token, never on re-tokenized
    text. The gold reward of a response is the sum of its tokens' contributions.
    """

    name: str
    end_tokens: tuple[str, ...] = (EOS,)  # token strings that end a response (nothing after them counts)
    version: int = 1  # bump when the reward model's training data (edits, perturbations) changes: its caches rebuild

    def __init__(self, max_new_tokens: int = 16, **options: Any) -> None:
        self.max_new_tokens = max_new_tokens
        self.options = options

    @abstractmethod
    def make_example(self, rng: random.Random) -> dict[str, Any]:
        """A prompt row: ``{"prompt": str, ...task fields}``."""

    def make_split_example(self, rng: random.Random, split: str) -> dict[str, Any]:
        """A prompt row of ``split`` (``train`` or ``eval``); tasks with held-out prompts override it."""
        return self.make_example(rng)

    @abstractmethod
    def contributions(self, example: dict[str, Any], tokens: list[str]) -> list[float]:
        """Gold contribution of each response token (same length as ``tokens``)."""

    @abstractmethod
    def demonstration(self, example: dict[str, Any], rng: random.Random) -> list[str]:
        """A warm-start response: in-distribution text of mixed quality, ending with EOS."""

    @abstractmethod
    def perturbations(self, example: dict[str, Any], rng: random.Random) -> list[list[str]]:
        """Good, bad and extreme responses that widen the reward model's training data beyond
        the warm policy's samples (so it also scores what RL will push the policy towards)."""

    @abstractmethod
    def edit(self, example: dict[str, Any], tokens: list[str], rng: random.Random) -> list[str]:
        """A local edit of a sampled response (a few tokens swapped for better or worse ones):
        reward-model data next to the policy's own distribution, in the directions RL moves."""

    def gold(self, example: dict[str, Any], tokens: list[str]) -> float:
        return float(sum(self.contributions(example, tokens)))


TASKS: Registry[type[Task]] = Registry("task")


def gold_contributions(task: Task, example: dict[str, Any], tokens: list[str]) -> list[float]:
    """Per-token gold contributions, with everything after the first end token (``task.end_tokens``;
    the end token itself included) contributing 0."""
    out = [0.0] * len(tokens)
    end = next((i for i, t in enumerate(tokens) if t in task.end_tokens), len(tokens))
    out[:end] = task.contributions(example, tokens[:end])
    return out


def gold_of(task: Task, tok, examples, response_ids: torch.Tensor, response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gold reward (B,) and per-token gold contribution (B, T) of sampled responses (float32, on
    the CPU). The ids and lengths leave the tensors once and the contributions enter one tensor
    at the end: per-row tensor indexing cost more than the task's own Python."""
    B, T = response_ids.shape
    ids, lens = response_ids.tolist(), response_mask.sum(-1).tolist()
    rows = []
    for i in range(B):
        toks = tok.convert_ids_to_tokens(ids[i][: lens[i]])
        rows.append(gold_contributions(task, examples[i], toks) + [0.0] * (T - lens[i]))
    contrib = torch.tensor(rows, dtype=torch.float32).view(B, T)
    return contrib.sum(-1), contrib
