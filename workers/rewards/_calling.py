"""Calling one rule reward function on a batch of decoded samples, and the errors.

Two call forms, told apart by the function's signature (:func:`call_style`):

- keyword (TRL's): ``fn(prompts=[...], completions=[...], **columns)``, chosen
  when the function has a ``completions`` parameter, or a ``**kwargs`` and no
  ``responses`` parameter. ``columns`` are the rows' own columns (``answer``,
  ``solution``, ``difficulty``, ...; see :func:`workers.rewards.row_columns`); a
  function without ``**kwargs`` gets only the ones it names.
- positional (asyncflow's first form): ``fn(prompts, responses, answers)``, for
  any other signature; it needs the ``answer`` column.

Either may be ``async def``: the scorer awaits the result on the worker. A call
that runs past the function's ``timeout_s`` fails with :class:`RewardTimeoutError`
(the function's thread cannot be stopped: it runs on, its result unused).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import queue
import re
import threading
import weakref
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

from channels import USER_CODE_ERRORS, AsyncflowError, SchemaError

RewardFn = Callable[..., "Sequence[float] | Awaitable[Sequence[float]]"]
"""A batched rule reward: ``fn(prompts=..., completions=..., **columns)`` or
``fn(prompts, responses, answers)``, sync or async (see :mod:`workers.rewards`)."""

CallStyle = Literal["keyword", "positional"]
"""How a reward function is called (see :func:`call_style`)."""

ANSWER = "answer"
"""The column of reference answers (decoded from ``answer_ids``)."""


class RewardFunctionError(AsyncflowError):
    """A rule reward function raised, or returned something other than one finite
    number per sample. The message names the function and the sample."""


class RewardTimeoutError(RewardFunctionError):
    """A rule reward function did not return within its ``timeout_s``. The message
    names the function, the samples and the limit."""


class _Overran(Exception):
    """A call ran past its timeout (raised by :meth:`_CallThread.call`)."""


class _CallThread:
    """Runs calls on a daemon thread of its own, one at a time, each with a deadline.
    A call past its deadline keeps the thread (a thread cannot be stopped: the call
    runs on, its result unused); the next call gets a new one. One long-lived thread
    rather than one per call, which would add a thread's start to every call."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Any] | None = None

    def call(self, timeout_s: float, fn: Callable[[], Any]) -> Any:
        """``fn()`` on the thread.

        Raises:
            _Overran: it did not return within ``timeout_s``; whatever ``fn``
                raised otherwise.
        """
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(self._jobs,), name="reward-fn", daemon=True).start()
            weakref.finalize(self, self._jobs.put, None)  # the thread ends with its owner
        outcome: list[tuple[bool, Any]] = []
        done = threading.Event()
        self._jobs.put((fn, outcome, done))
        if not done.wait(timeout_s):
            self._jobs = None  # left to the call it runs
            raise _Overran
        ok, value = outcome[0]
        if not ok:
            raise value
        return value


def _serve(jobs: queue.SimpleQueue[Any]) -> None:
    while (job := jobs.get()) is not None:
        fn, outcome, done = job
        try:
            outcome.append((True, fn()))
        except BaseException as e:  # handed to the waiting thread, which raises it
            outcome.append((False, e))
        done.set()


def reward_fn_name(fn: Callable[..., Any]) -> str:
    """``"module:qualname"`` of a function, for messages."""
    module = getattr(fn, "__module__", None) or "?"
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__qualname__
    return f"{module}:{name}"


def function_label(fn: object) -> str:
    """The short name of a reward function in metrics (``reward/<label>/mean``): its
    ``__name__``, or the last part of a ``"module:function"`` string, with characters
    other than letters, digits and ``_`` dropped."""
    if isinstance(fn, str):
        raw = fn.rsplit(":", 1)[-1].rsplit(".", 1)[-1]
    else:
        raw = getattr(fn, "__name__", None) or type(fn).__name__
    return re.sub(r"[^A-Za-z0-9_]", "", raw) or "fn"


def function_labels(fns: Sequence[object]) -> tuple[str, ...]:
    """:func:`function_label` of each, made unique with ``_2``, ``_3``, ... suffixes."""
    out: list[str] = []
    for fn in fns:
        base = label = function_label(fn)
        n = 1
        while label in out:
            n += 1
            label = f"{base}_{n}"
        out.append(label)
    return tuple(out)


def call_style(fn: Callable[..., Any]) -> CallStyle:
    """Which form ``fn`` is called with: ``"keyword"`` when it has a ``completions``
    parameter, or ``**kwargs`` and no ``responses`` parameter; else ``"positional"``
    (also when its signature cannot be read)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return "positional"
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return "keyword" if "completions" in params or (var_kw and "responses" not in params) else "positional"


def _excerpt(text: str, width: int = 60) -> str:
    return repr(text if len(text) <= width else text[: width - 3] + "...")


def _await(awaitable: Awaitable[Any]) -> Any:
    async def wait() -> Any:
        return await awaitable

    try:
        asyncio.get_running_loop()
    except RuntimeError:  # the workers' compute thread: no loop runs here
        return asyncio.run(wait())
    # An in-process caller inside async code: a loop already runs on this thread.
    with ThreadPoolExecutor(1, thread_name_prefix="reward-fn") as pool:
        return pool.submit(asyncio.run, wait()).result()


@dataclass(frozen=True, kw_only=True)
class RewardBatch:
    """Decoded samples, in row order, as reward functions get them."""

    prompts: list[str]
    """The prompts' text (special tokens dropped)."""
    completions: list[str]
    """The generated text up to and without EOS (special tokens dropped)."""
    columns: dict[str, list[Any]] = field(default_factory=dict)
    """The rows' own columns, one Python value per row (``answer``, user columns)."""
    uids: list[int] | None = None
    """The prompts' ids, quoted in errors."""

    def row(self, i: int) -> RewardBatch:
        """Sample ``i`` alone."""
        return RewardBatch(prompts=self.prompts[i : i + 1], completions=self.completions[i : i + 1],
                           columns={k: v[i : i + 1] for k, v in self.columns.items()})


class RewardFunction:
    """One reward function, ready to call on :class:`RewardBatch` es.

    Args:
        fn: the function (either call form, sync or async).
        label: its short name in metrics.
        timeout_s: seconds a call may take (each of the one-sample calls that look for
            a failing sample too); None: no limit.
    """

    def __init__(self, fn: Callable[..., Any], *, label: str | None = None, timeout_s: float | None = None) -> None:
        self.fn = fn
        self.timeout_s = timeout_s
        self._thread = _CallThread()
        self.name = reward_fn_name(fn)
        self.label = label if label is not None else function_label(fn)
        self.style: CallStyle = call_style(fn)
        self._accepts: frozenset[str] | None = None  # None: every column (**kwargs)
        self._needs: tuple[str, ...] = (ANSWER,) if self.style == "positional" else ()
        if self.style == "keyword":
            params = inspect.signature(fn).parameters
            if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
                self._accepts = frozenset(params)
            self._needs = tuple(n for n, p in params.items() if p.default is inspect.Parameter.empty
                                and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                                and n not in ("prompts", "completions"))

    def check_columns(self, columns: Sequence[str]) -> None:
        """Raise when the function needs a column the rows lack.

        Raises:
            SchemaError: naming the column and how to provide it.
        """
        missing = [n for n in self._needs if n not in columns]
        if not missing:
            return
        if self.style == "positional":
            raise SchemaError(
                f"reward function {self.name} is called as fn(prompts, responses, answers) and needs reference "
                "answers: put an 'answer_ids' field (right-padded with the pad id) with the prompts, or write it "
                "as fn(prompts, completions, **columns), which gets only the columns the rows have"
            )
        raise SchemaError(
            f"reward function {self.name} takes {missing[0]!r}, but the rows have no such column (they have "
            f"{sorted(columns)}); put a {missing[0] + '_ids'!r} (token ids) or uint8 {missing[0]!r} (text_column) "
            "field with the prompts, or give the parameter a default"
        )

    def _invoke(self, batch: RewardBatch) -> Any:
        if self.timeout_s is None:
            return self._invoke_here(batch)
        return self._thread.call(self.timeout_s, lambda: self._invoke_here(batch))

    def _invoke_here(self, batch: RewardBatch) -> Any:
        if self.style == "positional":
            out = self.fn(batch.prompts, batch.completions, batch.columns[ANSWER])
        else:
            kwargs = {"prompts": batch.prompts, "completions": batch.completions, **batch.columns}
            if self._accepts is not None:
                kwargs = {k: v for k, v in kwargs.items() if k in self._accepts}
            out = self.fn(**kwargs)
        return _await(out) if inspect.isawaitable(out) else out

    def __call__(self, batch: RewardBatch) -> list[float]:
        """Score every sample of ``batch``.

        Returns:
            One float per sample.

        Raises:
            SchemaError: the function needs a column the rows lack.
            RewardFunctionError: the function raised (naming the first failing sample,
                its uid and an excerpt of its text) or returned a wrong count, a
                non-number or a NaN/inf.
            RewardTimeoutError: the function did not return within ``timeout_s``.
        """
        self.check_columns(list(batch.columns))
        try:
            out = self._invoke(batch)
        except _Overran:
            raise self._overran(batch, None) from None
        except USER_CODE_ERRORS as e:  # sys.exit() included: the function's error
            raise self._locate_failure(batch, e) from e
        return self._check_scores(out, len(batch.prompts))

    def _overran(self, batch: RewardBatch, sample: int | None) -> RewardTimeoutError:
        n = len(batch.prompts)
        if sample is None:
            uids = "" if not batch.uids else f" (uids {', '.join(map(str, batch.uids[:4]))}{', ...' if n > 4 else ''})"
            what = f"the {n} samples on this rank{uids}"
        else:
            uid = "" if batch.uids is None else f" (uid {batch.uids[sample]})"
            what = f"sample {sample} of the {n} on this rank{uid}, alone: {self._describe(batch, sample)}"
        return RewardTimeoutError(
            f"reward function {self.name} did not return within its timeout_s of {self.timeout_s:g} s on {what}; "
            "it may hang, or need longer: bound its own waits (a timeout per sample for code it runs or a "
            "request it makes), or raise timeout_s ([reward] timeout_s in a run's config; 0: no limit)"
        )

    def _describe(self, batch: RewardBatch, i: int) -> str:
        """Sample ``i``'s text, as errors quote it."""
        if self.style == "positional":
            return (f"prompt={_excerpt(batch.prompts[i])} response={_excerpt(batch.completions[i])} "
                    f"answer={_excerpt(str(batch.columns[ANSWER][i]))}")
        return f"prompt={_excerpt(batch.prompts[i])} completion={_excerpt(batch.completions[i])}"

    def _locate_failure(self, batch: RewardBatch, batch_error: BaseException) -> RewardFunctionError:
        """Call the function one sample at a time; the first failure (or a call past
        the timeout) names the sample."""
        n = len(batch.prompts)
        for i in range(n):
            try:
                self._invoke(batch.row(i))
            except _Overran:
                return self._overran(batch, i)
            except USER_CODE_ERRORS as e:
                uid = "" if batch.uids is None else f" (uid {batch.uids[i]})"
                return RewardFunctionError(
                    f"reward function {self.name} raised on sample {i} of the {n} on this rank{uid}: "
                    f"{type(e).__name__}: {e}; {self._describe(batch, i)}; fix the function so that it scores "
                    "this sample"
                )
        return RewardFunctionError(
            f"reward function {self.name} raised on a batch of {n} samples "
            f"({type(batch_error).__name__}: {batch_error}) but on none of them alone; it must "
            "score each sample independently of the others"
        )

    def _check_scores(self, out: Any, n: int) -> list[float]:
        if hasattr(out, "tolist"):  # a tensor or numpy array
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
                    f"score {i}; every score must be a finite real number (return 0.0 for a sample it cannot judge)"
                )
            scores.append(float(value))
        return scores
