"""Rule-based rewards: a plain batched Python function over decoded text.

The contract of a reward function (:data:`RewardFn`)::

    def fn(prompts: list[str], responses: list[str], answers: list[str]) -> Sequence[float]

- It is called with one rank's samples, in row order: three lists of the same
  length ``B >= 1``. ``prompts[i]`` is the prompt's text, ``responses[i]`` the
  generated text up to and without EOS, ``answers[i]`` the reference answer (the
  ``answer_ids`` field without padding); special tokens are dropped and nothing is
  stripped.
- It returns ``B`` finite real numbers (a list, tuple, 1-D numpy array or tensor of
  ints, floats or bools), score ``i`` for sample ``i``.
- It should be deterministic and side-effect free: when a call raises, the scorer
  calls it again one sample at a time to name the first sample that fails.
- It must reach the workers: give it as a ``"module:function"`` string of a module
  the workers can import (the usual way in configs), or as a picklable callable.
"""

from __future__ import annotations

import importlib
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from channels import AsyncflowError, ConfigError, SchemaError
from workers.rewards._decode import Decoder, decode_rows, load_decoder
from workers.rewards._inputs import ScoreInputs, masked_token_lists

RewardFn = Callable[[list[str], list[str], list[str]], Sequence[float]]
"""A batched rule reward; see the module docstring for the exact contract."""

DEFAULT_REWARD_FN = "workers.rewards:arithmetic_reward"
"""The rule of the arithmetic task: exact match with the answer."""


class RewardFunctionError(AsyncflowError):
    """A rule reward function raised, or returned something other than one number
    per sample. The message names the function and the sample."""


def arithmetic_reward(prompts: list[str], responses: list[str], answers: list[str]) -> list[float]:
    """The arithmetic task's rule: 1.0 when the response, stripped, equals the answer,
    stripped; else 0.0.

    Args:
        prompts: the problems (unused).
        responses: the generated text (up to EOS).
        answers: the reference answers.

    Returns:
        One score per sample.
    """
    del prompts
    return [float(r.strip() == a.strip()) for r, a in zip(responses, answers, strict=True)]


def split_function_spec(spec: object, *, key: str = "RuleRewardConfig.fn") -> tuple[str, str]:
    """``"module:function"`` as ``(module, function)``.

    Args:
        spec: the string.
        key: how the caller names the setting in messages (a config key).

    Raises:
        ConfigError: ``spec`` is not a ``module:function`` string.
    """
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise ConfigError(f"{key} must be a 'module:function' string, got {spec!r}; e.g. {DEFAULT_REWARD_FN!r}")
    module_name, attr_path = spec.split(":")
    return module_name, attr_path


def load_reward_fn(spec: str | RewardFn, *, key: str = "RuleRewardConfig.fn") -> RewardFn:
    """Resolve a reward function given as ``"module:function"`` (or return a callable).

    ``function`` may be dotted (``"pkg.mod:Class.method"``).

    Args:
        spec: the import path, or the function itself.
        key: how the caller names the setting in messages (a config key).

    Returns:
        The callable.

    Raises:
        ConfigError: the string is malformed, the module cannot be imported (or
            raises while importing), the attribute does not exist or is not callable.
    """
    if callable(spec):
        return spec
    module_name, attr_path = split_function_spec(spec, key=key)
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as e:  # the module's own code failing is the user's error too
        first = str(e).splitlines()[0] if str(e) else ""
        raise ConfigError(
            f"{key} = {spec!r}: cannot import module {module_name!r}: {type(e).__name__}: {first}; "
            "make the module importable (PYTHONPATH or the working directory)"
        ) from None
    for part in attr_path.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"{key} = {spec!r}: {getattr(target, '__name__', target)!r} has no "
                              f"attribute {part!r}; check the name after ':'")
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(f"{key} = {spec!r} names a {type(target).__name__}, not a function "
                          "fn(prompts, responses, answers) -> list[float]")
    return target


def reward_fn_name(fn: Callable[..., Any]) -> str:
    """``"module:qualname"`` of a function, for messages."""
    module = getattr(fn, "__module__", None) or "?"
    return f"{module}:{getattr(fn, '__qualname__', repr(fn))}"


@dataclass(frozen=True, kw_only=True)
class RuleRewardConfig:
    """A rule-based reward: a Python function over decoded text."""

    tokenizer_dir: str
    """A model directory whose tokenizer decodes the samples (the policy's)."""
    fn: str | RewardFn = DEFAULT_REWARD_FN
    """The reward function, as ``"module:function"`` or a picklable callable (see
    :data:`RewardFn`)."""

    def __post_init__(self) -> None:
        if not isinstance(self.tokenizer_dir, str) or not self.tokenizer_dir:
            raise ConfigError(
                f"RuleRewardConfig.tokenizer_dir must be a directory path string, got {self.tokenizer_dir!r}"
            )
        if isinstance(self.fn, str):
            split_function_spec(self.fn)
        elif not callable(self.fn):
            raise ConfigError(f"RuleRewardConfig.fn must be a callable or a string, got {self.fn!r}")

    def build(self, device: torch.device) -> RuleScorer:
        """The scorer (imports the function and loads the tokenizer).

        Args:
            device: unused (rules run on the CPU).

        Returns:
            A :class:`RuleScorer`.

        Raises:
            ConfigError: the function or the tokenizer cannot be loaded.
        """
        del device
        return RuleScorer(load_reward_fn(self.fn), load_decoder(self.tokenizer_dir))


class RuleScorer:
    """Scores samples with a rule reward function over their decoded text.

    Args:
        fn: the function (see :data:`RewardFn`).
        decoder: the tokenizer that decodes prompts, responses and answers.
    """

    def __init__(self, fn: RewardFn, decoder: Decoder) -> None:
        self.fn = fn
        self.decoder = decoder
        self.name = reward_fn_name(fn)

    def texts(self, inputs: ScoreInputs) -> tuple[list[str], list[str], list[str]]:
        """The decoded prompts, responses and answers of ``inputs``.

        Raises:
            SchemaError: the inputs carry no answers.
        """
        if inputs.answer_ids is None:
            raise SchemaError(
                f"reward function {self.name} needs reference answers: put an 'answer_ids' "
                "field (right-padded with the pad id) with the prompts"
            )
        answers = inputs.answer_ids.reshape(inputs.num_rows, -1).tolist()
        return (
            decode_rows(self.decoder, masked_token_lists(inputs.prompt_ids, inputs.prompt_mask)),
            decode_rows(self.decoder, masked_token_lists(inputs.response_ids, inputs.response_mask)),
            decode_rows(self.decoder, answers, strip_pad=True),
        )

    def __call__(self, inputs: ScoreInputs) -> Tensor:
        """Score every sample.

        Args:
            inputs: the samples (``answer_ids`` required).

        Returns:
            ``[B]`` float32 scores.

        Raises:
            RewardFunctionError: the function raised (naming the first failing sample,
                its uid and text) or returned a wrong count or a non-number.
            SchemaError: the inputs carry no answers.
        """
        if inputs.num_rows == 0:
            return torch.zeros(0, dtype=torch.float32)
        prompts, responses, answers = self.texts(inputs)
        try:
            out = self.fn(prompts, responses, answers)
        except Exception as e:
            raise self._locate_failure(inputs, prompts, responses, answers, e) from e
        return torch.tensor(self._check_scores(out, inputs.num_rows), dtype=torch.float32)

    def _locate_failure(self, inputs: ScoreInputs, prompts: list[str], responses: list[str],
                        answers: list[str], batch_error: Exception) -> RewardFunctionError:
        """Call the function one sample at a time; the first failure names the sample."""
        n = len(prompts)
        for i in range(n):
            try:
                self.fn(prompts[i : i + 1], responses[i : i + 1], answers[i : i + 1])
            except Exception as e:
                uid = inputs.uid(i)
                return RewardFunctionError(
                    f"reward function {self.name} raised on sample {i} of the {n} on this rank"
                    f"{'' if uid is None else f' (uid {uid})'}: {type(e).__name__}: {e}; "
                    f"prompt={prompts[i]!r} response={responses[i]!r} answer={answers[i]!r}"
                )
        return RewardFunctionError(
            f"reward function {self.name} raised on a batch of {n} samples "
            f"({type(batch_error).__name__}: {batch_error}) but on none of them alone; it must "
            "score each sample independently of the others"
        )

    def _check_scores(self, out: Any, n: int) -> list[float]:
        if isinstance(out, torch.Tensor) or hasattr(out, "tolist"):
            out = out.tolist()
        if isinstance(out, str | bytes) or not isinstance(out, Sequence):
            raise RewardFunctionError(
                f"reward function {self.name} returned a {type(out).__name__}; it must return a "
                f"sequence of {n} numbers, one per sample"
            )
        if len(out) != n:
            raise RewardFunctionError(
                f"reward function {self.name} returned {len(out)} scores for {n} samples; it must "
                "return exactly one number per sample, in order"
            )
        scores = []
        for i, value in enumerate(out):
            if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
                raise RewardFunctionError(
                    f"reward function {self.name} returned {value!r} ({type(value).__name__}) as "
                    f"score {i}; every score must be a finite real number"
                )
            scores.append(float(value))
        return scores
