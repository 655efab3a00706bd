"""The arithmetic prompt source (``[data] source = "arithmetic"``): synthetic
problems with a verifiable answer, generated from a seed.

An :class:`ArithmeticTaskConfig` names a problem family (operand digits, operators)
and the sizes of two splits; :func:`generate_splits` draws distinct problems from the
family. The train split never holds a held-out problem, nor its mirror image for a
commutative operator (``b+a`` when ``a+b`` is held out), so held-out accuracy
measures generalisation rather than recall. Equal configs give equal splits on every
machine (Python's ``random.Random`` is seeded from the config alone).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import msgspec

from channels import ConfigError

OPERATORS: tuple[str, ...] = ("+", "-", "*")
"""Operators a task may use."""

COMMUTATIVE: frozenset[str] = frozenset({"+", "*"})
"""Operators whose mirror image ``b op a`` has the same answer as ``a op b``."""


class ArithmeticTaskConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A family of arithmetic problems ``"<a><op><b>="`` and its train/eval splits."""

    digits: int = 2
    """Most digits of an operand: operands are drawn uniformly from ``[0, 10**digits)``."""
    operators: tuple[str, ...] = ("+",)
    """Operators drawn uniformly per problem, any of ``"+"``, ``"-"``, ``"*"``."""
    train_size: int = 7000
    """Problems in the train split (at least 1)."""
    eval_size: int = 1000
    """Problems in the held-out eval split (at least 1); the train split holds none of them
    nor their mirror images under commutative operators."""
    seed: int = 0
    """Seed of the draw; equal configs give equal splits."""

    def __post_init__(self) -> None:
        _check_int("digits", self.digits, minimum=1)
        _check_int("train_size", self.train_size, minimum=1)
        _check_int("eval_size", self.eval_size, minimum=1)
        _check_int("seed", self.seed, minimum=None)
        if not self.operators or any(op not in OPERATORS for op in self.operators):
            raise ConfigError(
                f"ArithmeticTaskConfig.operators must be a non-empty tuple drawn from {OPERATORS}, "
                f"got {self.operators!r}"
            )
        if len(set(self.operators)) != len(self.operators):
            raise ConfigError(
                f"ArithmeticTaskConfig.operators repeats an operator: {self.operators!r}"
            )
        # Each held-out problem may take its mirror image out of the train pool, so
        # 2 * eval_size bounds what the eval split removes.
        wanted = self.train_size + 2 * self.eval_size
        if wanted > self.num_distinct_problems:
            raise ConfigError(
                f"ArithmeticTaskConfig needs train_size + 2 * eval_size = {wanted} <= the "
                f"{self.num_distinct_problems} distinct problems of digits={self.digits} with "
                f"operators={self.operators!r}; lower train_size or eval_size, or raise digits"
            )

    @property
    def num_distinct_problems(self) -> int:
        """How many different problems the family holds."""
        return len(self.operators) * (10**self.digits) ** 2

    @property
    def max_prompt_chars(self) -> int:
        """Longest prompt, in characters (= symbols): two operands, the operator and ``=``."""
        return 2 * self.digits + 2

    @property
    def max_answer_chars(self) -> int:
        """Longest answer, in characters, over the configured operators."""
        lengths = {"+": self.digits + 1, "-": self.digits + 1, "*": 2 * self.digits}
        return max(lengths[op] for op in self.operators)


class ArithmeticProblem(msgspec.Struct, frozen=True, kw_only=True, array_like=True, gc=False):
    """One problem: ``left <operator> right``."""

    left: int
    """First operand."""
    operator: str
    """``"+"``, ``"-"`` or ``"*"``."""
    right: int
    """Second operand."""

    @property
    def prompt(self) -> str:
        """The text the model sees, e.g. ``"12+34="``."""
        return f"{self.left}{self.operator}{self.right}="

    @property
    def answer(self) -> str:
        """The exact answer the verifier expects, e.g. ``"46"``."""
        if self.operator == "+":
            return str(self.left + self.right)
        if self.operator == "-":
            return str(self.left - self.right)
        return str(self.left * self.right)


class TaskSplits(msgspec.Struct, frozen=True, kw_only=True):
    """The two disjoint splits of a task."""

    train: tuple[ArithmeticProblem, ...]
    """Problems to train on (SFT and RL prompts)."""
    eval: tuple[ArithmeticProblem, ...]
    """Held-out problems to measure accuracy on."""


def generate_splits(config: ArithmeticTaskConfig) -> TaskSplits:
    """Draw the eval problems, then the train problems, of ``config``.

    Problems are drawn uniformly at random (operator, then both operands) and kept when
    new: first ``eval_size`` problems that are pairwise distinct up to commutation, then
    ``train_size`` distinct problems that are neither held out nor the mirror image of a
    held-out one. Growing ``train_size`` therefore never changes the eval split.

    Args:
        config: The task.

    Returns:
        The splits, in draw order.
    """
    rng = random.Random(config.seed)
    base = 10**config.digits
    held_out: set[tuple[str, int, int]] = set()
    eval_problems: list[ArithmeticProblem] = []
    while len(eval_problems) < config.eval_size:
        problem = _draw(rng, base, config.operators)
        if _canonical(problem) not in held_out:
            held_out.add(_canonical(problem))
            eval_problems.append(problem)
    seen: set[ArithmeticProblem] = set()
    train_problems: list[ArithmeticProblem] = []
    while len(train_problems) < config.train_size:
        problem = _draw(rng, base, config.operators)
        if problem not in seen and _canonical(problem) not in held_out:
            seen.add(problem)
            train_problems.append(problem)
    return TaskSplits(train=tuple(train_problems), eval=tuple(eval_problems))


def _draw(rng: random.Random, base: int, operators: Sequence[str]) -> ArithmeticProblem:
    operator = operators[rng.randrange(len(operators))]
    return ArithmeticProblem(left=rng.randrange(base), operator=operator, right=rng.randrange(base))


def _canonical(problem: ArithmeticProblem) -> tuple[str, int, int]:
    """The problem up to commutation: ``a+b`` and ``b+a`` share a key, ``a-b`` does not."""
    left, right = problem.left, problem.right
    if problem.operator in COMMUTATIVE:
        left, right = min(left, right), max(left, right)
    return problem.operator, left, right


def _check_int(name: str, value: object, *, minimum: int | None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"ArithmeticTaskConfig.{name} must be an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise ConfigError(f"ArithmeticTaskConfig.{name} must be >= {minimum}, got {value}")
