"""The running part of a native run: the rows it carries and the two kinds of decode batch.

A :class:`~._native_run.NativeRun` keeps every sample of a run (waiting, running,
finished) and hands the running ones to a decode batch, which prefills them, samples
one token per row per step and says which rows finished:

- :class:`~._kv_batch.DynamicBatch`: a KV cache as long as the longest row, grown by
  each step and compacted as rows leave. What a step costs follows what it reads,
  which suits the CPU.
- :class:`~._static_batch.StaticBatch`: a KV cache preallocated with one slot per row
  (:class:`~._static_cache.StaticDecoder`), its decode step replayed as a CUDA graph
  on CUDA.

Both keep their rows' tokens, log-probs, lengths, budgets and row seeds on the
device (:class:`~._row_book.RowBook`).

Both give a sample the same tokens and log-probs (up to float rounding): its random
stream is a function of its row seed and position only (:mod:`._sampling`). Both
prefill rows with the same tokens once (a prompt's ``n`` samples in GRPO and its
kin) and copy the result to the rows that repeat them (:func:`distinct_sequences`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ._sampling import pack_row_seed
from ._stop import StopStrings
from ._types import FinishedSample, PartialSample, SamplingParams, ends_response

__all__ = ["DecodeBatch", "Row", "RunRules", "distinct_sequences"]


def distinct_sequences(sequences: Sequence[Sequence[int]]) -> tuple[list[list[int]], list[int]]:
    """The distinct token sequences of ``sequences`` in their first order, and for
    each sequence the position of its own among them (what a prefill of the
    distinct ones copies to that row)."""
    distinct: dict[tuple[int, ...], int] = {}
    source = [distinct.setdefault(tuple(sequence), len(distinct)) for sequence in sequences]
    return [list(sequence) for sequence in distinct], source


@dataclass(frozen=True, kw_only=True)
class RunRules:
    """How every row of a run samples and ends."""

    params: SamplingParams
    stop: StopStrings | None = None
    """Finds stop strings in responses; None when ``params.stop`` is empty."""
    early_banned: tuple[int, ...] = ()
    """Token ids masked out while a response is shorter than ``params.min_new_tokens``."""

    def ended(self, response: list[int], budget: int) -> bool:
        """Whether ``response`` (its newest token last) is finished under a budget of ``budget``."""
        return ends_response(response[-1], len(response), budget, self.params) or (
            self.stop is not None and self.stop.ended(response)
        )


@dataclass(kw_only=True, eq=False)
class Row:
    """One sample of a run: its prompt, its response so far, its budget and its random stream.

    While a decode batch runs the row, ``response`` and ``logprobs`` hold what it
    carried in only; the batch fills them in when the row finishes or leaves."""

    index: int
    prompt: list[int]
    response: list[int]
    logprobs: list[float]
    budget: int
    """Most response tokens (carried ones included)."""
    seed: int | None
    """The row seed of its random stream (:mod:`._sampling`); None when sampling is greedy."""

    def finished(self) -> FinishedSample:
        """The row as a finished sample."""
        return FinishedSample(index=self.index, response_ids=self.response, logprobs=self.logprobs)

    def partial(self) -> PartialSample:
        """The row as a sample to continue elsewhere, its random stream with it."""
        state = None if self.seed is None else pack_row_seed(self.seed)
        return PartialSample(
            index=self.index,
            prompt=self.prompt,
            response_ids=self.response,
            logprobs=self.logprobs,
            rng_state=state,
            max_new_tokens=self.budget,
        )


class DecodeBatch(Protocol):
    """The rows of a run that are decoding (see the module docstring)."""

    def __len__(self) -> int:
        """Rows running."""
        ...

    def join(self, rows: list[Row]) -> list[Row]:
        """Prefill ``rows`` (prompt and response so far) and sample their next token;
        they run from now on. Returns those that finished with that token."""
        ...

    def decode(self) -> list[Row]:
        """Sample one more token for every running row; the rows that finished, in
        completion order, their responses and log-probs complete."""
        ...

    def leave(self) -> list[Row]:
        """Remove every running row, its response and log-probs brought up to date."""
        ...
