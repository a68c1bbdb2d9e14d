"""Synthetic long-context tasks, generated offline and deterministic by (seed, index).

Each task is a dataclass of its knobs (context length, difficulty) with ``example(seed, index)`` returning
an :class:`Example` (prompt text, answer text). The texts use only the characters of
:class:`~sparrow.rl.tokenizer.CharTokenizer`, and the prompt is padded with distractors up to
``context_len`` characters, so the context length is exact in tokens for that tokenizer.

* :class:`KVRetrieval` — RULER ``niah_multikey`` style: many ``key=value`` pairs, one asked for.
* :class:`VariableTracking` — chains of assignments (``b=a``) hopping from a number to the asked
  variable, among distractor chains.
* :class:`NeedleQA` — a sentence ("the code of NAME is N") hidden in filler text; a question about it.
* :class:`KVListRetrieval` — like :class:`KVRetrieval`, but asks for several keys at once; the answer lists
  their values, and the number asked follows a power law: response lengths with a long tail.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass

_KEY_ALPHABET = string.ascii_lowercase + string.digits
_WORDS = ("the", "a", "of", "and", "to", "in", "is", "was", "for", "on", "with", "as", "by", "at", "it",
          "from", "that", "this", "which", "or", "be", "are", "an", "not", "but", "had", "has", "have", "one",
          "all", "were", "when", "there", "can", "more", "if", "no", "out", "so", "said", "what", "up",
          "its", "about", "into", "than", "them", "only", "other", "new", "some", "could", "time", "these",
          "two", "may", "then", "do", "first", "any", "my", "now", "such", "like", "our", "over", "man",
          "me", "even", "most", "made", "after", "also", "did", "many", "before", "must", "through", "back",
          "years", "where", "much", "your", "way", "well", "down", "should", "because", "each", "just")


@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str
    task: str
    index: int


def _rng(seed: int, index: int, salt: str) -> random.Random:
    return random.Random(f"{salt}:{seed}:{index}")


def _word(r: random.Random, n: int, alphabet: str = _KEY_ALPHABET) -> str:
    return "".join(r.choice(alphabet) for _ in range(n))


def _distinct_words(r: random.Random, count: int, length: int) -> list[str]:
    """``count`` distinct lowercase words of ``length`` letters, in draw order."""
    words: list[str] = []
    seen = set()
    while len(words) < count:
        w = _word(r, length, string.ascii_lowercase)
        if w not in seen:
            seen.add(w)
            words.append(w)
    return words


def _number(r: random.Random, n: int) -> str:
    return str(r.randrange(10 ** (n - 1), 10**n))


@dataclass(frozen=True)
class KVRetrieval:
    """``key=value;`` pairs (distinct keys), then ``?key=``; the answer is the value.

    Attributes:
        context_len: prompt length in characters (pairs are added until it is reached).
        key_len, value_len: characters per key / digits per value (difficulty: shorter keys are more
            confusable).
        min_pairs: at least this many pairs.
        vary_pairs: draw the number of pairs uniformly from ``[min_pairs, as many as fit]`` (the rest of the
            context is filler) instead of always filling the context: a curriculum of easier examples.
    """

    context_len: int = 256
    key_len: int = 3
    value_len: int = 3
    min_pairs: int = 2
    vary_pairs: bool = False

    def __post_init__(self) -> None:
        pair = self.key_len + self.value_len + 2
        if self.context_len < self.min_pairs * pair + self.key_len + 2:
            raise ValueError(f"context_len {self.context_len} is too short for {self.min_pairs} pairs of "
                             f"{pair} characters plus the question")
        if self.key_len < 1 or self.value_len < 1:
            raise ValueError("key_len and value_len must be >= 1")
        most = max(self.min_pairs, (self.context_len - self.key_len - 2) // pair)
        if most > 26**self.key_len:
            raise ValueError(f"context_len {self.context_len} holds {most} pairs but keys of {self.key_len} "
                             f"letters allow only {26 ** self.key_len} distinct keys")

    def example(self, seed: int, index: int) -> Example:
        r = _rng(seed, index, "kv")
        pair = self.key_len + self.value_len + 2
        budget = self.context_len - (self.key_len + 2)
        n = max(self.min_pairs, budget // pair)
        if self.vary_pairs:
            n = r.randint(self.min_pairs, n)
        keys = _distinct_words(r, n, self.key_len)
        values = [_number(r, self.value_len) for _ in keys]
        q = r.randrange(n)
        body = "".join(f"{k}={v};" for k, v in zip(keys, values))
        body += "." * (budget - len(body))  # exact length
        return Example(f"{body}?{keys[q]}=", values[q], "kv_retrieval", index)


@dataclass(frozen=True)
class KVListRetrieval:
    """``key=value;`` pairs (distinct keys), then ``?k1,k2,...,kn=``; the answer is ``v1;v2;...;vn``.

    The number of keys asked is drawn with probability proportional to ``n ** -tail`` for ``1 <= n <=``
    :attr:`most_asked` (``max_asked``, or fewer if the context cannot hold that many pairs and the question),
    so most answers are short and a few are long: a rollout batch with long-tailed response lengths
    (``n * (value_len + 1)`` tokens with ``<eos>``).

    Attributes:
        context_len: prompt length in characters.
        key_len, value_len: characters per key / digits per value.
        max_asked: most keys asked in one question.
        tail: power-law exponent of the number asked (larger: shorter answers).
    """

    context_len: int = 256
    key_len: int = 3
    value_len: int = 3
    max_asked: int = 32
    tail: float = 1.5

    def __post_init__(self) -> None:
        if self.key_len < 1 or self.value_len < 1 or self.max_asked < 1:
            raise ValueError("key_len, value_len and max_asked must be >= 1")
        if self.tail < 0:
            raise ValueError(f"tail must be >= 0, got {self.tail}")
        if self.most_asked < 1:
            raise ValueError(f"context_len {self.context_len} is too short for one pair and its question")

    @property
    def most_asked(self) -> int:
        """The most keys an example can ask at this context length."""
        pair = self.key_len + self.value_len + 2
        return min(self.max_asked, (self.context_len - 1) // (pair + self.key_len + 1), 26**self.key_len)

    def example(self, seed: int, index: int) -> Example:
        r = _rng(seed, index, "kvl")
        sizes = range(1, self.most_asked + 1)
        n = r.choices(sizes, weights=[k ** -self.tail for k in sizes])[0]
        pair = self.key_len + self.value_len + 2
        budget = self.context_len - (n * (self.key_len + 1) + 1)
        count = min(budget // pair, 26**self.key_len)
        keys = _distinct_words(r, count, self.key_len)
        values = [_number(r, self.value_len) for _ in keys]
        asked = r.sample(range(count), n)
        body = "".join(f"{k}={v};" for k, v in zip(keys, values))
        body += "." * (budget - len(body))
        question = "?" + ",".join(keys[i] for i in asked) + "="
        return Example(body + question, ";".join(values[i] for i in asked), "kv_list", index)


@dataclass(frozen=True)
class VariableTracking:
    """``x=12345;`` starts a chain ``y=x;z=y;...``; asked for the last variable of one chain.

    Attributes:
        context_len: prompt length in characters.
        hops: assignments in each chain after the number (difficulty).
        chains: chains in the context (one is asked; the others distract).
        value_len: digits of the number.
    """

    context_len: int = 256
    hops: int = 2
    chains: int = 3
    value_len: int = 4

    def __post_init__(self) -> None:
        need = self.chains * (self.value_len + 3 + self.hops * 6) + 6
        if self.context_len < need:
            raise ValueError(f"context_len {self.context_len} is too short for {self.chains} chains of "
                             f"{self.hops} hops (needs {need})")
        if self.hops < 1 or self.chains < 1:
            raise ValueError("hops and chains must be >= 1")

    def example(self, seed: int, index: int) -> Example:
        r = _rng(seed, index, "vt")
        names = _distinct_words(r, self.chains * (self.hops + 1), 2)
        chains = [names[c * (self.hops + 1):(c + 1) * (self.hops + 1)] for c in range(self.chains)]
        values = [_number(r, self.value_len) for _ in range(self.chains)]
        # interleave the statements of all chains, keeping each chain's order
        cursors = [0] * self.chains
        stmts = []
        while any(c <= self.hops for c in cursors):
            c = r.choice([i for i in range(self.chains) if cursors[i] <= self.hops])
            j = cursors[c]
            stmts.append(f"{chains[c][0]}={values[c]};" if j == 0 else f"{chains[c][j]}={chains[c][j - 1]};")
            cursors[c] += 1
        q = r.randrange(self.chains)
        question = f"?{chains[q][-1]}="
        budget = self.context_len - len(question)
        # distractor filler between statements
        filler_total = budget - sum(len(s) for s in stmts)
        cuts = sorted(r.randrange(filler_total + 1) for _ in range(len(stmts)))
        parts, prev = [], 0
        for s, cut in zip(stmts, cuts):
            parts.append("." * (cut - prev) + s)
            prev = cut
        body = "".join(parts) + "." * (filler_total - prev)
        return Example(body + question, values[q], "variable_tracking", index)


@dataclass(frozen=True)
class NeedleQA:
    """A needle sentence ``the code of NAME is N.`` in filler words; ``?code of NAME:``.

    Attributes:
        context_len: prompt length in characters.
        needles: needle sentences (one asked; the rest distract).
        value_len: digits of the code.
    """

    context_len: int = 512
    needles: int = 2
    value_len: int = 4

    def __post_init__(self) -> None:
        if self.context_len < self.needles * (24 + self.value_len) + 20:
            raise ValueError(f"context_len {self.context_len} is too short for {self.needles} needles")
        if self.needles < 1:
            raise ValueError("needles must be >= 1")

    def example(self, seed: int, index: int) -> Example:
        r = _rng(seed, index, "nq")
        names: list[str] = []
        while len(names) < self.needles:
            n = _word(r, 5, string.ascii_lowercase)
            if n not in names:
                names.append(n)
        codes = [_number(r, self.value_len) for _ in names]
        sentences = [f"the code of {n} is {c}. " for n, c in zip(names, codes)]
        q = r.randrange(self.needles)
        question = f"?code of {names[q]}:"
        budget = self.context_len - len(question)
        words = []
        length = sum(len(s) for s in sentences)
        while True:
            w = r.choice(_WORDS) + " "
            if length + len(w) > budget:
                break
            words.append(w)
            length += len(w)
        for s in sentences:
            words.insert(r.randrange(len(words) + 1), s)
        body = "".join(words)
        body += "." * (budget - len(body))
        return Example(body + question, codes[q], "needle_qa", index)
