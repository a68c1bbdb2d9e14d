"""Reward components: each maps (example, completion text) to a float; :class:`CombinedReward` sums them."""

from __future__ import annotations

import abc
import re
from typing import Any, Mapping, Sequence


class Reward(abc.ABC):
    """``reward(answer, completion) -> float``; ``answer`` is the reference answer string."""

    name: str = "reward"

    @abc.abstractmethod
    def __call__(self, answer: str, completion: str) -> float: ...


class ExactMatch(Reward):
    """1.0 when the completion (up to the first stop / whitespace run at the ends) equals the answer."""

    name = "exact_match"

    def __call__(self, answer: str, completion: str) -> float:
        return 1.0 if completion.strip() == answer.strip() else 0.0


class CharAccuracy(Reward):
    """Partial credit: the fraction of answer characters reproduced in place, over the longer of the two
    strings (1.0 exactly when the completion equals the answer). A dense signal for synthetic tasks."""

    name = "char_accuracy"

    def __call__(self, answer: str, completion: str) -> float:
        a, c = answer.strip(), completion.strip()
        if not a and not c:
            return 1.0
        return sum(x == y for x, y in zip(a, c)) / max(len(a), len(c))


_BOXED = re.compile(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}")
_TAGGED = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_final_answer(text: str) -> str | None:
    """The last ``\\boxed{...}`` or ``<answer>...</answer>`` content, or None."""
    cands = [(m.end(), m.group(1)) for m in _BOXED.finditer(text)] + [(m.end(), m.group(1))
                                                                     for m in _TAGGED.finditer(text)]
    return max(cands)[1].strip() if cands else None


def _normalise(s: str) -> str:
    s = s.strip().strip("$").replace(" ", "").replace(",", "")
    try:
        f = float(s)
        return repr(int(f)) if f == int(f) else repr(f)
    except (ValueError, OverflowError):
        return s.lower()


class MathAnswer(Reward):
    """1.0 when the final ``\\boxed{}`` / ``<answer>`` content equals the reference (numbers compared by value)."""

    name = "math_answer"

    def __call__(self, answer: str, completion: str) -> float:
        got = extract_final_answer(completion)
        return 1.0 if got is not None and _normalise(got) == _normalise(answer) else 0.0


class FormatReward(Reward):
    """``value`` when the completion contains a final answer in the expected format, else 0.

    Args:
        style: ``"boxed"``, ``"answer_tags"`` or ``"digits"`` (only digits, for the synthetic tasks).
        value: reward for a well-formed completion.
    """

    name = "format"

    def __init__(self, style: str = "answer_tags", value: float = 0.1) -> None:
        if style not in ("boxed", "answer_tags", "digits"):
            raise ValueError(f"FormatReward style must be boxed, answer_tags or digits, got {style!r}")
        self.style, self.value = style, float(value)

    def __call__(self, answer: str, completion: str) -> float:
        if self.style == "boxed":
            ok = _BOXED.search(completion) is not None
        elif self.style == "answer_tags":
            ok = _TAGGED.search(completion) is not None
        else:
            ok = completion.strip().isdigit()
        return self.value if ok else 0.0


class CombinedReward(Reward):
    """Weighted sum of rewards. ``components``: rewards, or their configs (``{_component_: ..., ...}``, as a
    recipe's YAML lists them); ``weights``: one per component (default 1)."""

    name = "combined"

    def __init__(self, components: Sequence[Reward | Mapping[str, Any]], weights: Sequence[float] | None = None) -> None:
        if not components:
            raise ValueError("CombinedReward needs at least one component")
        components = [_instantiate(c) if isinstance(c, Mapping) else c for c in components]
        bad = [type(c).__name__ for c in components if not callable(c)]
        if bad:
            raise ValueError(f"CombinedReward components must be rewards, got {', '.join(bad)}")
        weights = list(weights) if weights is not None else [1.0] * len(components)
        if len(weights) != len(components):
            raise ValueError(f"{len(components)} reward components but {len(weights)} weights")
        self.components, self.weights = list(components), [float(w) for w in weights]

    def __call__(self, answer: str, completion: str) -> float:
        return sum(w * c(answer, completion) for c, w in zip(self.components, self.weights))

    def breakdown(self, answer: str, completion: str) -> Mapping[str, Any]:
        return {c.name: c(answer, completion) for c in self.components}


def _instantiate(cfg: Mapping[str, Any]) -> Reward:
    from omegaconf import DictConfig, OmegaConf
    from torchtune import config

    if "_component_" not in cfg:
        raise ValueError(f"a reward config needs a _component_, got keys {sorted(cfg)}")
    return config.instantiate(cfg if isinstance(cfg, DictConfig) else OmegaConf.create(dict(cfg)))
