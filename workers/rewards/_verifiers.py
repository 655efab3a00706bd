"""Built-in verifiers: keyword-form reward functions for common checks.

Each is ``fn(prompts, completions, **columns) -> list[float]`` scoring 1.0 or 0.0
per sample; name them in a config as ``"workers.rewards:exact_match"``,
``"workers.rewards:numeric_match"`` or ``"workers.rewards:format_check"``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

DEFAULT_FORMAT = r"####\s*-?[\d,]*\.?\d+\s*$"
""":data:`format_check`'s pattern: the completion ends in a GSM8K-style final answer
``#### <number>``."""

_NUMBER = r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+"
_HASHES = re.compile(rf"####\s*\$?\s*({_NUMBER})")
_BOXED = re.compile(rf"\\boxed\{{\s*\$?\s*({_NUMBER})\s*\}}")
_ANY = re.compile(_NUMBER)


def exact_match(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[str],
                **columns: Any) -> list[float]:
    """1.0 where the completion, stripped, equals the ``answer`` column, stripped; else 0.0.

    Args:
        prompts: unused.
        completions: the generated text.
        answer: the reference answers.
        columns: the rows' other columns (unused).

    Returns:
        One score per sample.
    """
    del prompts, columns
    return [float(c.strip() == str(a).strip()) for c, a in zip(completions, answer, strict=True)]


def extract_number(text: str) -> float | None:
    """The final answer in ``text`` as a number: the last ``#### 42``, else the last
    ``\\boxed{42}``, else the last number anywhere (commas and a leading ``$`` allowed);
    None when there is none."""
    for pattern in (_HASHES, _BOXED, _ANY):
        found = pattern.findall(text)
        if found:
            return float(found[-1].replace(",", ""))
    return None


def numeric_match(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[Any],
                  **columns: Any) -> list[float]:
    """1.0 where the completion's final number (:func:`extract_number`) equals the
    ``answer`` column's (relative tolerance 1e-6); 0.0 otherwise, also when the
    completion holds no number.

    ``answer`` may be text (``"72"``, or a whole solution ending in ``#### 72``) or a
    number column.

    Args:
        prompts: unused.
        completions: the generated text.
        answer: the reference answers.
        columns: the rows' other columns (unused).

    Returns:
        One score per sample.

    Raises:
        ValueError: a reference answer holds no number (a data error; the reward
            role names the sample).
    """
    del prompts, columns
    scores = []
    for completion, ref in zip(completions, answer, strict=True):
        expected = float(ref) if isinstance(ref, int | float) else extract_number(str(ref))
        if expected is None:
            raise ValueError(f"the answer {str(ref)[:60]!r} holds no number; numeric_match needs numeric answers")
        got = extract_number(completion)
        scores.append(float(got is not None and math.isclose(got, expected, rel_tol=1e-6, abs_tol=1e-9)))
    return scores


@dataclass(frozen=True)
class FormatCheck:
    """A reward of 1.0 where the completion matches a regular expression (``re.search``
    with ``re.DOTALL``: anchor with ``^``/``$`` to match the whole text), else 0.0.

    :data:`format_check` is one with :data:`DEFAULT_FORMAT`. For another pattern,
    make one in a module of yours and name it in the config::

        # my_rewards.py
        from workers.rewards import FormatCheck
        think_answer = FormatCheck(r"^<think>.*?</think>\\s*<answer>.*?</answer>$", name="think_answer")

        # config: function = "my_rewards:think_answer"

    Args:
        pattern: the regular expression.
        name: the name in messages and metrics (``reward/<name>/mean``).
    """

    pattern: str = DEFAULT_FORMAT
    name: str = "format_check"

    def __post_init__(self) -> None:
        re.compile(self.pattern, re.DOTALL)  # a bad pattern fails where the object is made

    @property
    def __name__(self) -> str:
        """The name in messages and metrics."""
        return self.name

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], **columns: Any) -> list[float]:
        """Score each completion: 1.0 when the pattern is found in it.

        Args:
            prompts: unused.
            completions: the generated text.
            columns: the rows' other columns (unused).

        Returns:
            One score per sample.
        """
        del prompts, columns
        regex = re.compile(self.pattern, re.DOTALL)
        return [float(regex.search(c) is not None) for c in completions]


format_check = FormatCheck()
"""Checks that a completion ends in ``#### <number>`` (see :class:`FormatCheck`)."""
