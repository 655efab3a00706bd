"""Rule-based rewards: plain batched Python functions over decoded text, weighted.

A reward function is called with one rank's samples, in row order, in one of two
forms, told apart by its signature (:func:`workers.rewards.call_style`):

- keyword (TRL's)::

      def fn(prompts: list[str], completions: list[str], **columns) -> Sequence[float]

  chosen when it has a ``completions`` parameter, or ``**kwargs`` and no
  ``responses`` one. ``columns`` are the rows' own columns, one Python value per
  row: ``answer`` (decoded from ``answer_ids``), any ``<name>_ids`` column decoded
  to text ``<name>``, uint8 text columns, numbers for ``[B]`` columns (see
  :func:`workers.rewards.row_columns`). A function without ``**kwargs`` gets only
  the columns it names, and only a parameter without default must be present.
- positional (the first form)::

      def fn(prompts: list[str], responses: list[str], answers: list[str]) -> Sequence[float]

  for any other signature; it needs ``answer_ids``.

In both, ``prompts[i]`` is the prompt's text and the completion (response) the
generated text up to and without EOS; special tokens are dropped and nothing is
stripped. Ids the tokenizer does not know (a model vocabulary larger than the
tokenizer's) read as U+FFFD each. The function:

- returns ``B`` finite real numbers (a list, tuple, 1-D numpy array or tensor of
  ints, floats or bools), score ``i`` for sample ``i``;
- may be ``async def``: the scorer awaits it;
- should be deterministic and side-effect free: when a call raises, the scorer
  calls it again one sample at a time to name the first sample that fails;
- must reach the workers: give it as a ``"module:function"`` string of a module
  the workers can import (the usual way in configs), or as a picklable callable.

Several functions are combined by weight (``RuleRewardConfig(fn=[f, g],
weights=[1.0, 0.5])``): the score is ``sum(w_k * f_k)``; the reward role reports
each function's own mean as ``reward/<name>/mean``.
"""

from __future__ import annotations

import importlib
import math
import numbers
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from channels import ConfigError, SchemaError
from workers.rewards._calling import (
    ANSWER,
    RewardBatch,
    RewardFn,
    RewardFunction,
    function_labels,
)
from workers.rewards._columns import row_columns
from workers.rewards._decode import Decoder, decode_rows, load_decoder
from workers.rewards._inputs import ScoreInputs, masked_token_lists

DEFAULT_REWARD_FN = "workers.rewards:arithmetic_reward"
"""The rule of the arithmetic task: exact match with the answer."""

DEFAULT_TIMEOUT_S = 600.0
"""How long one call of a reward function may take by default: a function that
hangs (code it runs that loops, a request never answered) fails its run after ten
minutes instead of holding it for ever."""


def split_function_spec(spec: object, *, key: str = "RuleRewardConfig.fn", form: str = "module:function",
                        example: str = DEFAULT_REWARD_FN) -> tuple[str, str]:
    """``"module:function"`` as ``(module, function)``.

    Args:
        spec: the string.
        key: how the caller names the setting in messages (a config key).
        form: the form messages ask for (``"module:Class"`` for a class).
        example: a right value, shown in messages.

    Raises:
        ConfigError: ``spec`` is not a ``module:function`` string.
    """
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise ConfigError(f"{key} must be a {form!r} string, got {spec!r}; e.g. {example!r}")
    module_name, attr_path = spec.split(":")
    return module_name, attr_path


def load_reward_fn(spec: str | RewardFn, *, key: str = "RuleRewardConfig.fn", form: str = "module:function",
                   example: str = DEFAULT_REWARD_FN,
                   expected: str = "a function fn(prompts, completions, **columns) -> list[float]") -> RewardFn:
    """Resolve a reward function given as ``"module:function"`` (or return a callable).

    ``function`` may be dotted (``"pkg.mod:Class.method"``). Other callables
    (environment classes, tools) load through it too, named in messages by ``form``,
    ``example`` and ``expected``.

    Args:
        spec: the import path, or the function itself.
        key: how the caller names the setting in messages (a config key).
        form: the form messages ask for (``"module:Class"`` for a class).
        example: a right value, shown in messages.
        expected: what ``spec`` must name, for messages.

    Returns:
        The callable.

    Raises:
        ConfigError: the string is malformed, the module cannot be imported (or
            raises while importing), the attribute does not exist or is not callable.
    """
    if callable(spec):
        return spec
    module_name, attr_path = split_function_spec(spec, key=key, form=form, example=example)
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as e:  # the module's own code failing is the user's error too
        first = str(e).splitlines()[0] if str(e) else ""
        raise ConfigError(
            f"{key} = {spec!r}: cannot import module {module_name!r}: {type(e).__name__}: {first}; "
            + _import_fix(e, module_name)
        ) from None
    for part in attr_path.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"{key} = {spec!r}: {getattr(target, '__name__', target)!r} has no "
                              f"attribute {part!r}; check the name after ':'")
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(f"{key} = {spec!r} names {_a(type(target).__name__)}, not {expected}")
    return target



def _a(noun: str) -> str:
    return f"{'an' if noun[:1] in 'aeiou' else 'a'} {noun}"


def _import_fix(error: Exception, module_name: str) -> str:
    """What to do about ``module_name`` failing to import with ``error``: put it where
    it is found when it was not, else fix where its own import failed."""
    missing = error.name if isinstance(error, ModuleNotFoundError) else None
    if missing is not None and (module_name == missing or module_name.startswith(f"{missing}.")):
        return "put the module beside the config file or in the working directory, or on PYTHONPATH"
    if isinstance(error, SyntaxError) and error.filename:
        return f"the module was found, but {error.filename}:{error.lineno} is not valid Python; fix it"
    frames = [f for f in traceback.extract_tb(error.__traceback__) if "importlib" not in f.filename]
    at = f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    if missing is not None:
        return f"the module was found, but it imports {missing!r}, which is not installed{at}; install it"
    return f"the module was found, but running it failed{at}; fix it"


def _check_weight(key: str, w: object) -> float:
    if isinstance(w, bool) or not isinstance(w, numbers.Real) or not math.isfinite(float(w)):
        raise ConfigError(f"{key} must be a finite number, got {w!r}; e.g. 1.0")
    return float(w)


@dataclass(frozen=True, kw_only=True)
class RuleRewardConfig:
    """A rule-based reward: one Python function over decoded text, or a weighted sum
    of several."""

    tokenizer_dir: str
    """A model directory whose tokenizer decodes the samples (the policy's)."""
    fn: str | RewardFn | Sequence[str | RewardFn] = DEFAULT_REWARD_FN
    """The reward function, as ``"module:function"`` or a picklable callable (see the
    call forms in :mod:`workers.rewards`), or a list of them, summed by ``weights``."""
    weights: Sequence[float] | None = None
    """One weight per function in ``fn`` (None: 1.0 each); the score is
    ``sum(weights[k] * fn[k](...))``."""
    timeout_s: float | None = DEFAULT_TIMEOUT_S
    """Seconds one call of a function may take on a rank's samples; past it the call
    fails with :class:`~workers.rewards.RewardTimeoutError` (the function runs on
    in its thread, its result unused). None: no limit."""

    def __post_init__(self) -> None:
        if not isinstance(self.tokenizer_dir, str) or not self.tokenizer_dir:
            raise ConfigError(
                f"RuleRewardConfig.tokenizer_dir must be a directory path string, got {self.tokenizer_dir!r}"
            )
        single = isinstance(self.fn, str) or callable(self.fn)
        if not single and not (isinstance(self.fn, Sequence) and self.fn):
            raise ConfigError(f"RuleRewardConfig.fn must be a callable, a 'module:function' string or a "
                              f"non-empty list of them, got {self.fn!r}")
        fns = (self.fn,) if single else tuple(self.fn)  # type: ignore[arg-type]
        for k, f in enumerate(fns):
            key = "RuleRewardConfig.fn" if single else f"RuleRewardConfig.fn[{k}]"
            if isinstance(f, str):
                split_function_spec(f, key=key)
            elif not callable(f):
                raise ConfigError(f"{key} must be a callable or a 'module:function' string, got {f!r}")
        object.__setattr__(self, "fn", fns[0] if single else fns)
        if self.weights is not None:
            if isinstance(self.weights, str) or not isinstance(self.weights, Sequence) \
                    or len(self.weights) != len(fns):
                raise ConfigError(f"RuleRewardConfig.weights must be a list of {len(fns)} numbers, one per "
                                  f"function in fn, got {self.weights!r}")
            object.__setattr__(self, "weights", tuple(
                _check_weight(f"RuleRewardConfig.weights[{k}]", w) for k, w in enumerate(self.weights)))
        if self.timeout_s is not None and (isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, int | float)
                                           or not self.timeout_s > 0):
            raise ConfigError(f"RuleRewardConfig.timeout_s must be a number of seconds > 0 or None (no limit), "
                              f"got {self.timeout_s!r}")

    @property
    def functions(self) -> tuple[str | RewardFn, ...]:
        """``fn`` as a tuple (one entry for a single function)."""
        return (self.fn,) if isinstance(self.fn, str) or callable(self.fn) else tuple(self.fn)

    @property
    def labels(self) -> tuple[str, ...]:
        """Each function's short name in metrics (``reward/<label>/mean``), unique."""
        return function_labels(self.functions)

    def build(self, device: torch.device) -> RuleScorer:
        """The scorer (imports the functions and loads the tokenizer).

        Args:
            device: unused (rules run on the CPU).

        Returns:
            A :class:`RuleScorer`.

        Raises:
            ConfigError: a function or the tokenizer cannot be loaded.
        """
        del device
        fns = self.functions
        loaded = [load_reward_fn(f, key="RuleRewardConfig.fn" if len(fns) == 1 else f"RuleRewardConfig.fn[{k}]")
                  for k, f in enumerate(fns)]
        return RuleScorer(loaded, load_decoder(self.tokenizer_dir), weights=self.weights, labels=self.labels,
                          timeout_s=self.timeout_s)


class RuleScorer:
    """Scores samples with rule reward functions over their decoded text: the
    weighted sum of the functions' scores.

    Args:
        fn: the function, or several (see the call forms in :mod:`workers.rewards`).
        decoder: the tokenizer that decodes prompts, responses and token columns.
        weights: one per function (None: 1.0 each).
        labels: each function's short name (None: from the functions' names).
        timeout_s: seconds one call of a function may take (None: no limit).
    """

    def __init__(self, fn: RewardFn | Sequence[RewardFn], decoder: Decoder, *,
                 weights: Sequence[float] | None = None, labels: Sequence[str] | None = None,
                 timeout_s: float | None = None) -> None:
        fns: list[RewardFn] = [fn] if callable(fn) else list(fn)
        names = function_labels(fns) if labels is None else tuple(labels)
        self.timeout_s = timeout_s
        self.functions = tuple(RewardFunction(f, label=n, timeout_s=timeout_s) for f, n in zip(fns, names, strict=True))
        self.weights = tuple(1.0 for _ in fns) if weights is None else tuple(float(w) for w in weights)
        if len(self.weights) != len(fns):
            raise ConfigError(f"RuleScorer: {len(self.weights)} weights for {len(fns)} functions; give one each")
        self.decoder = decoder

    @property
    def fn(self) -> RewardFn:
        """The first function (the only one of a single-function scorer); setting it
        makes the scorer score with that function alone, weight 1."""
        return self.functions[0].fn

    @fn.setter
    def fn(self, fn: RewardFn) -> None:
        self.functions = (RewardFunction(fn, timeout_s=self.timeout_s),)
        self.weights = (1.0,)

    @property
    def name(self) -> str:
        """The first function's ``module:qualname``."""
        return self.functions[0].name

    def texts(self, inputs: ScoreInputs) -> tuple[list[str], list[str], list[str]]:
        """The decoded prompts, responses and answers of ``inputs`` (the positional form's
        arguments).

        Raises:
            SchemaError: the inputs carry no answers.
        """
        batch = self.batch(inputs)
        if ANSWER not in batch.columns:
            raise SchemaError("the samples carry no reference answers: put an 'answer_ids' field "
                              "(right-padded with the pad id) with the prompts")
        return batch.prompts, batch.completions, list(batch.columns[ANSWER])

    def batch(self, inputs: ScoreInputs) -> RewardBatch:
        """``inputs`` decoded: prompts, completions and the columns (``answer_ids`` as
        ``answer``; see :func:`workers.rewards.row_columns`).

        Raises:
            SchemaError: a ``<name>_ids`` column is not integer token ids.
        """
        columns = dict(inputs.columns)
        if inputs.answer_ids is not None:
            columns.setdefault("answer_ids", inputs.answer_ids.reshape(inputs.num_rows, -1))
        return RewardBatch(
            prompts=decode_rows(self.decoder, masked_token_lists(inputs.prompt_ids, inputs.prompt_mask)),
            completions=decode_rows(self.decoder, masked_token_lists(inputs.response_ids, inputs.response_mask)),
            columns=row_columns(columns, self.decoder),
            uids=None if inputs.uids is None else [inputs.uid(i) or 0 for i in range(inputs.num_rows)],
        )

    def score(self, inputs: ScoreInputs) -> tuple[Tensor, dict[str, Tensor]]:
        """The weighted score of every sample, and each function's own scores.

        Args:
            inputs: the samples.

        Returns:
            ``([B] float32 weighted sums, {label: [B] float32 scores of that function}``).

        Raises:
            RewardFunctionError: a function raised (naming it, the first failing
                sample, its uid and text) or returned a wrong count, a non-number or
                a NaN/inf; :class:`~workers.rewards.RewardTimeoutError` when it did
                not return within ``timeout_s``.
            SchemaError: a function needs a column the rows lack.
        """
        if inputs.num_rows == 0:
            empty = torch.zeros(0, dtype=torch.float32)
            return empty, {f.label: empty for f in self.functions}
        batch = self.batch(inputs)
        for f in self.functions:  # before any call: a missing column is a data error, not the function's
            f.check_columns(list(batch.columns))
        parts = {f.label: torch.tensor(f(batch), dtype=torch.float64) for f in self.functions}
        total = sum((w * p for w, p in zip(self.weights, parts.values(), strict=True)),
                    torch.zeros(inputs.num_rows, dtype=torch.float64))
        return total.to(torch.float32), {k: v.to(torch.float32) for k, v in parts.items()}

    def __call__(self, inputs: ScoreInputs) -> Tensor:
        """Score every sample: the weighted sum of the functions' scores (see :meth:`score`).

        Returns:
            ``[B]`` float32 scores.
        """
        return self.score(inputs)[0]
