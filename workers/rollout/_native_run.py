"""The native engine's :class:`~._types.GenerationRun`: one continuous decode batch.

A run keeps one decode batch of all its samples (at most ``max_batch_size`` rows
when that is set). Every step first prefills waiting samples into the free rows (a separate left-padded forward pass
whose KV cache then joins the decode batch; a migrated sample prefills its prompt and
its response so far), then decodes one token for every row. A row leaves the batch as
soon as it reaches its token budget, samples EOS (unless ``ignore_eos``) or completes
a stop string (:mod:`._stop`), and its :class:`~._types.FinishedSample` is reported
in that step. While a row is shorter than ``min_new_tokens``, EOS is masked out of
its sampling distribution.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import PreTrainedModel

from ._kv_batch import KVBatch, decode, prefill
from ._lean_decode import lean_decoder
from ._sampling import pack_row_seed, row_seed, sample_tokens, unpack_row_seed
from ._stop import StopStrings
from ._types import (
    FinishedSample,
    PartialSample,
    SamplingParams,
    budget_of,
    check_admissible,
    ends_response,
)


class _BatchCap(Protocol):
    @property
    def max_batch_size(self) -> int | None:
        """Most rows decoded at once (None: no cap)."""
        ...


class RunEngine(Protocol):
    """What a :class:`NativeRun` uses of its engine (a
    :class:`~._native.NativeRolloutEngine`)."""

    @property
    def model(self) -> PreTrainedModel:
        """The causal LM sampled from."""
        ...

    @property
    def config(self) -> _BatchCap:
        """The engine's settings (``max_batch_size``)."""
        ...

    @property
    def weights_version(self) -> int:
        """Changes whenever the engine's weights do."""
        ...

    def checked_tokens(self, tokens: Sequence[int], where: str) -> list[int]:
        """``tokens`` as a list of ints, all within the vocabulary."""
        ...

    def checked_prompt(self, prompt: Sequence[int], budget: int, where: str) -> list[int]:
        """``prompt`` checked: not empty, in the vocabulary, room for ``budget`` tokens."""
        ...

__all__ = ["NativeRun"]


@dataclass(kw_only=True, eq=False)
class _Row:
    """One sample of a run: its prompt, its response so far, its budget and its random stream."""

    index: int
    prompt: list[int]
    response: list[int]
    logprobs: list[float]
    budget: int
    """Most response tokens (carried ones included)."""
    seed: int | None
    """The row seed of its random stream (:mod:`._sampling`); None when sampling is greedy."""

    def finished(self) -> FinishedSample:
        return FinishedSample(index=self.index, response_ids=self.response, logprobs=self.logprobs)

    def partial(self) -> PartialSample:
        state = None if self.seed is None else pack_row_seed(self.seed)
        return PartialSample(
            index=self.index,
            prompt=self.prompt,
            response_ids=self.response,
            logprobs=self.logprobs,
            rng_state=state,
            max_new_tokens=self.budget,
        )


class NativeRun:
    """The :class:`~._types.GenerationRun` of a :class:`~._native.NativeRolloutEngine`
    (see the module docstring).

    Args:
        engine: The engine whose model the run samples from; the run is valid while
            the engine's weights stay those it started with.
        params: How to sample, for every sample of the run.
        seed: The run's seed (each sample's stream derives from it and its index).
        stop: Finds stop strings in responses; None when ``params.stop`` is empty.
        early_banned: Token ids masked out while a response is shorter than
            ``params.min_new_tokens``.
    """

    def __init__(
        self,
        engine: RunEngine,
        params: SamplingParams,
        seed: int,
        *,
        stop: StopStrings | None = None,
        early_banned: tuple[int, ...] = (),
    ) -> None:
        self._early_banned = early_banned
        self._engine = engine
        self._params = params
        self._seed = seed
        self._stop = stop
        self._weights_version = engine.weights_version
        self._rows: dict[int, _Row] = {}
        """Every pending sample by index, waiting or running."""
        self._waiting: deque[_Row] = deque()
        self._running: KVBatch | None = None
        self._closed = False
        self._lean = lean_decoder(engine.model)

    @property
    def pending(self) -> int:
        """Samples not finished yet (waiting or running)."""
        return len(self._rows)

    def step(self) -> list[FinishedSample]:
        """One scheduling step; the samples that finished in it, in completion order."""
        self._check_usable("step")
        # Grad mode is off inside each model call only (prefill and decode), so a
        # consumer stepping the run keeps its own grad mode.
        model = self._engine.model
        finished: list[FinishedSample] = []
        running = self._running
        cap = self._engine.config.max_batch_size
        busy = len(running) if running is not None else 0
        free = len(self._waiting) if cap is None else cap - busy
        if self._waiting and free > 0:
            joining = [self._waiting.popleft() for _ in range(min(free, len(self._waiting)))]
            fresh, logits = prefill(
                model,
                [row.prompt + row.response for row in joining],
                [row.index for row in joining],
                pad_token_id=self._params.pad_token_id,
            )
            finished += self._advance(fresh, logits)
            if running is None:
                running = fresh
            elif len(fresh):
                running.extend(fresh)
        if running is not None and len(running):
            finished += self._advance(running, decode(model, running, self._lean))
        self._running = running if running is not None and len(running) else None
        return finished

    def export(self) -> list[PartialSample]:
        """Remove every unfinished sample and return it, in the order they joined."""
        exported = [row.partial() for row in self._rows.values()]
        self._rows.clear()
        self._waiting.clear()
        self._running = None
        return exported

    def admit(self, samples: Sequence[PartialSample]) -> None:
        """Queue ``samples`` to continue here, with their carried random streams and budgets."""
        self._check_usable("admit")
        check_admissible(samples, self._params, self._rows)
        engine, rows = self._engine, []
        for partial in samples:
            where = f"PartialSample index={partial.index}"
            budget = budget_of(partial, self._params)
            prompt = engine.checked_prompt(partial.prompt, budget, where)
            response = engine.checked_tokens(partial.response_ids, f"{where} response_ids")
            logprobs = list(partial.logprobs)
            rows.append(
                self.row(partial.index, prompt, response, logprobs, budget, partial.rng_state)
            )
        self.queue(rows)

    def close(self) -> None:
        """Drop every pending sample; later steps and admits raise. Idempotent."""
        self.export()
        self._closed = True

    def row(
        self,
        index: int,
        prompt: list[int],
        response: list[int],
        logprobs: list[float],
        budget: int,
        rng_state: bytes | None = None,
    ) -> _Row:
        """A row of checked tokens, with its row seed when sampling."""
        seed = None
        if not self._params.greedy and rng_state is not None:
            seed = unpack_row_seed(rng_state, index=index)
        elif not self._params.greedy:
            seed = row_seed(self._seed, index, skip=len(response))
        return _Row(
            index=index,
            prompt=prompt,
            response=response,
            logprobs=logprobs,
            budget=budget,
            seed=seed,
        )

    def queue(self, rows: list[_Row]) -> None:
        """Add ``rows`` (from :meth:`row`) to the samples waiting for a free batch row."""
        for row in rows:
            self._rows[row.index] = row
        self._waiting.extend(rows)

    def _advance(self, batch: KVBatch, logits: torch.Tensor) -> list[FinishedSample]:
        """Sample one token per row, record it, and drop the rows that finished."""
        params = self._params
        rows = [self._rows[index] for index in batch.indices]
        tokens, logprobs = sample_tokens(
            logits,
            params,
            [row.seed for row in rows],
            lengths=[len(row.response) for row in rows],
            early_banned=self._early_banned,
        )
        batch.next_tokens = tokens
        finished, keep = [], []
        for position, (row, token, logprob) in enumerate(
            zip(rows, tokens.tolist(), logprobs.tolist(), strict=True)
        ):
            row.response.append(token)
            row.logprobs.append(logprob)
            if ends_response(token, len(row.response), row.budget, params) or (
                self._stop is not None and self._stop.ended(row.response)
            ):
                finished.append(self._rows.pop(row.index).finished())
            else:
                keep.append(position)
        batch.keep(keep)
        return finished

    def _check_usable(self, action: str) -> None:
        if self._closed:
            raise RuntimeError(f"cannot {action}: this run is closed; start a new one")
        if self._weights_version != self._engine.weights_version:
            raise RuntimeError(
                f"cannot {action}: the engine's weights changed since this run started; "
                "export() its unfinished samples and admit them into a new run"
            )
