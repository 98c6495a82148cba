"""``reviews``: the real-language task. "Write a short review of <subject>." → free English text
from a real instruct model, scored by the AFINN sentiment lexicon.

Gold reward: the sum of the AFINN-en-165 valences (integers in [-5, 5]) of the words and
phrases in the response, as ``afinn.Afinn().score`` finds them (lower-cased, whitespace runs
read as one space, the lexicon's own regular expression), divided by ``scale`` valence points
(``data.norm_len``, 10 in the preset). It is not clipped, so the per-token contributions sum
exactly to the gold reward; the response budget bounds it (48 tokens: about ±10). Calibration
of SmolLM2-135M-Instruct's samples: valence sum mean 4.3, std 4.5, so gold is about 0.4 ± 0.45.

Per-token gold contribution: each matched word's (or phrase's) valence is shared equally among
the sampled tokens that hold at least one of its characters: " wonderful" as one token gets all
of +4/scale; "self" + "-" + "del" + "uded" share self-deluded's -2 four ways (a
phrase such as "not good" likewise, over its words' tokens; a token of spaces only gets none). Tokens are read
as the byte-level BPE strings the tokenizer produced (``Ġ`` = a leading space), decoded to UTF-8
text byte by byte, so a character split over two tokens belongs to the token that completes it.
Special tokens (``<|im_end|>``, ``<jupyter_code>``...) are never text: they contribute 0 and
separate words. Held-out prompts ask about subjects never seen in training.
"""

from __future__ import annotations

import codecs
import random
import re
from functools import lru_cache
from typing import Any

from datc.tasks.base import TASKS, Task

TEMPLATES = [
    "Write a short review of {}.",
    "Describe {} in a few sentences.",
    "What do you think of {}?",
    "Tell me about your experience with {}.",
    "Give your honest opinion of {}.",
    "Write a few sentences about {}.",
    "How would you describe {} to a friend?",
    "Share your thoughts on {}.",
]

SUBJECTS = """a small coffee shop|a budget smartphone|a long train journey|an old wooden chair|a rainy Monday morning|
a seaside hotel|a pair of running shoes|a city park|a jazz concert|a vegetarian restaurant|a public library|
a mountain hike|a used car|a science fiction novel|a cooking class|a crowded airport|a winter holiday|a new laptop|
a museum of modern art|a thunderstorm|a street food market|a children's birthday party|a yoga class|a dentist visit|
a camping trip|an electric scooter|a home-made pizza|a football match|a bakery|a video game|a noisy neighbour|
a farmers' market|a history documentary|a ski resort|a pet cat|a rock festival|a hospital waiting room|a river cruise|
a pair of headphones|a bicycle commute|a board game night|a botanical garden|a fast food chain|a music streaming app|
a job interview|a theme park|a small village|a rented apartment|a cooking blender|a school reunion|a summer beach|
a late-night bus|a public swimming pool|an online course|a wedding reception|a rooftop bar|a self-driving car|
a mystery film|a gym membership|a lake at sunset|a cheap motel|a gardening tool|a local bookshop|a tea house|
a coding bootcamp|a shopping mall|a hot air balloon ride|a smart watch|a zoo|a sushi bar|a power outage|a road trip|
a classical symphony|a furniture store|a flu shot|a chess club|a desert landscape|a subway system|a new sofa|
a science museum|a cruise ship|a vintage camera|a customer service call|a snowboard|a food delivery app|a farm stay|
a dance performance|a hair salon|a comedy show|a computer mouse|a night market|a mountain cabin|a traffic jam|
a language app|a fishing trip|a hotel breakfast|a poetry reading|an ice cream parlour|a train station|a robot vacuum|
an art gallery|a winter coat|a spa weekend|a pizza restaurant|a math textbook|a kayak tour|a city marathon""".replace("\n", "")
SUBJECT_LIST = [s.strip() for s in SUBJECTS.split("|") if s.strip()]
EVAL_SUBJECTS = SUBJECT_LIST[::5]  # held out: never in a training prompt
TRAIN_SUBJECTS = [s for i, s in enumerate(SUBJECT_LIST) if i % 5]

# Single-token sentiment words (leading space, byte-level BPE form) for the reward model's edits
# and perturbations: words RL may push the policy towards, in the policy's own token strings.
POSITIVE_WORDS = "good great wonderful love best nice amazing perfect happy beautiful excellent fantastic lovely enjoy fun".split()
NEGATIVE_WORDS = "bad terrible hate worst awful sad boring poor horrible ugly problem disappointing useless rude".split()
NEUTRAL_WORDS = "the a and it was with room place food time very people".split()

_SPECIAL = re.compile(r"^<[^\s<>]+>$")  # <|im_end|>, <|im_start|>, <jupyter_code>, ...


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Byte-level BPE's printable character for each byte, inverted (GPT-2's table)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}


@lru_cache(maxsize=1)
def _lexicon():
    from afinn import Afinn

    a = Afinn(language="en")
    return a._pattern, a._dict


def token_bytes(token: str) -> bytes | None:
    """The bytes a byte-level BPE token string stands for; None for a special token."""
    if _SPECIAL.match(token):
        return None
    dec = _byte_decoder()
    return bytes(dec[c] for c in token if c in dec)


def text_and_owners(tokens: list[str]) -> tuple[str, list[int]]:
    """The response's text as AFINN reads it (lower-cased, whitespace runs as one space) and, for
    each of its characters, the index of the token that holds it (-1 for a separator)."""
    dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
    chars: list[tuple[str, int]] = []
    for i, tok in enumerate(tokens):
        raw = token_bytes(tok)
        if raw is None:
            chars += [(c, -1) for c in dec.decode(b"", final=True)]  # a split character ends here
            dec.reset()
            chars.append((" ", -1))
            continue
        for b in raw:
            chars += [(c, i) for c in dec.decode(bytes([b]))]
    chars += [(c, len(tokens) - 1) for c in dec.decode(b"", final=True)]
    text, owners, in_space = [], [], False
    for c, i in chars:
        if c.isspace():
            if not in_space:
                text.append(" ")
                owners.append(i)
            in_space = True
            continue
        in_space = False
        low = c.lower()
        text.append(low)
        owners += [i] * len(low)
    return "".join(text), owners


def valence_contributions(tokens: list[str]) -> list[float]:
    """Per-token AFINN valence (unscaled): each matched entry's valence shared equally among the
    tokens holding its non-space characters. Sums to ``Afinn().score(decoded text)``."""
    pattern, lexicon = _lexicon()
    text, owners = text_and_owners(tokens)
    out = [0.0] * len(tokens)
    for m in pattern.finditer(text):
        holders = sorted({owners[k] for k in range(m.start(), m.end()) if owners[k] >= 0 and text[k] != " "})
        if not holders:
            continue
        share = lexicon[m.group()] / len(holders)
        for i in holders:
            out[i] += share
    return out


@TASKS.register("reviews")
class ReviewsTask(Task):
    """Gold = AFINN valence sum / ``scale``. The constructor's first argument (``data.norm_len``)
    is the scale, in valence points per unit of gold."""

    name = "reviews"
    end_tokens = ("<|im_end|>", "<|endoftext|>")
    version = 2  # 2: edits swap any whole word (1 swapped only words before punctuation)

    @property
    def scale(self) -> float:
        return float(self.max_new_tokens)

    def make_example(self, rng: random.Random) -> dict[str, Any]:
        return self._example(rng, TRAIN_SUBJECTS)

    def make_split_example(self, rng: random.Random, split: str) -> dict[str, Any]:
        return self._example(rng, EVAL_SUBJECTS if split == "eval" else TRAIN_SUBJECTS)

    def _example(self, rng: random.Random, subjects: list[str]) -> dict[str, Any]:
        subject = rng.choice(subjects)
        return {"prompt": rng.choice(TEMPLATES).format(subject), "subject": subject}

    def contributions(self, example: dict[str, Any], tokens: list[str]) -> list[float]:
        return [v / self.scale for v in valence_contributions(tokens)]

    def demonstration(self, example, rng):
        raise NotImplementedError("reviews is for instruct models, which need no warm start (policy.warm_start.steps=0)")

    def perturbations(self, example, rng):
        """All-positive, all-negative and one-word-repeated responses: where RL may push."""
        n = 24
        out = [["Ġ" + rng.choice(POSITIVE_WORDS) for _ in range(n)], ["Ġ" + rng.choice(NEGATIVE_WORDS) for _ in range(n)],
               ["Ġ" + rng.choice(POSITIVE_WORDS)] * n,
               ["Ġ" + rng.choice(POSITIVE_WORDS + NEGATIVE_WORDS + NEUTRAL_WORDS) for _ in range(n)]]
        return [r + [self.end_tokens[0]] for r in out]

    def edit(self, example, tokens, rng):
        """One to three whole-word tokens (``Ġword`` followed by a word boundary) swapped for a
        positive, negative or neutral word: local changes of known gold next to the policy's text.
        The next token continues the word when it starts with a letter byte (byte-level BPE
        writes the bytes of letters as characters below 256; a space, newline or other control
        byte as ``Ġ``, ``Ċ``, ... above 255, which ``str.isalpha`` also calls letters)."""
        body = [t for t in tokens if t not in self.end_tokens]

        def continues(t: str) -> bool:
            return t[:1].isalpha() and ord(t[0]) < 256

        words = [i for i, t in enumerate(body) if t.startswith("Ġ") and t[1:].isalpha()
                 and (i + 1 == len(body) or not continues(body[i + 1]))]
        out = list(body)
        for i in rng.sample(words, min(len(words), rng.randint(1, 3))):
            out[i] = "Ġ" + rng.choice(rng.choice([POSITIVE_WORDS, NEGATIVE_WORDS, NEUTRAL_WORDS]))
        return out + [self.end_tokens[0]]
