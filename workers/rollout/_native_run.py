"""The native engine's :class:`~._types.GenerationRun`: samples waiting, running and done.

A run keeps its running samples in one decode batch (:mod:`._decode_batch`; at most
``max_batch_size`` rows when that is set). Every step first prefills waiting samples
into the free rows (a migrated sample prefills its prompt and its response so far),
then decodes one token for every row. A row leaves the batch as soon as it reaches
its token budget, samples EOS (unless ``ignore_eos``) or completes a stop string
(:mod:`._stop`), and its :class:`~._types.FinishedSample` is reported in that step.
While a row is shorter than ``min_new_tokens``, EOS is masked out of its sampling
distribution.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Protocol

from ._decode_batch import DecodeBatch, Row, RunRules
from ._sampling import row_seed, unpack_row_seed
from ._types import FinishedSample, PartialSample, budget_of, check_admissible

__all__ = ["NativeRun"]


class _BatchCap(Protocol):
    @property
    def max_batch_size(self) -> int | None:
        """Most rows decoded at once (None: no cap)."""
        ...


class RunEngine(Protocol):
    """What a :class:`NativeRun` uses of its engine (a
    :class:`~._native.NativeRolloutEngine`)."""

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


class NativeRun:
    """The :class:`~._types.GenerationRun` of a :class:`~._native.NativeRolloutEngine`
    (see the module docstring).

    Args:
        engine: The engine whose model the run samples from; the run is valid while
            the engine's weights stay those it started with.
        rules: How the run's samples sample and end.
        seed: The run's seed (each sample's stream derives from it and its index).
        batch: The decode batch its running samples go to (empty).
    """

    def __init__(self, engine: RunEngine, rules: RunRules, seed: int, batch: DecodeBatch) -> None:
        self._engine = engine
        self._rules = rules
        self._seed = seed
        self._batch = batch
        self._weights_version = engine.weights_version
        self._rows: dict[int, Row] = {}
        """Every pending sample by index, waiting or running."""
        self._waiting: deque[Row] = deque()
        self._closed = False

    @property
    def pending(self) -> int:
        """Samples not finished yet (waiting or running)."""
        return len(self._rows)

    def step(self) -> list[FinishedSample]:
        """One scheduling step; the samples that finished in it, in completion order."""
        self._check_usable("step")
        # Grad mode is off inside each model call only (prefill and decode), so a
        # consumer stepping the run keeps its own grad mode.
        finished: list[Row] = []
        cap = self._engine.config.max_batch_size
        free = len(self._waiting) if cap is None else cap - len(self._batch)
        if self._waiting and free > 0:
            joining = [self._waiting.popleft() for _ in range(min(free, len(self._waiting)))]
            finished += self._batch.join(joining)
        if len(self._batch):
            finished += self._batch.decode()
        return [self._rows.pop(row.index).finished() for row in finished]

    def export(self) -> list[PartialSample]:
        """Remove every unfinished sample and return it, in the order they joined."""
        self._batch.leave()  # brings the running rows' responses up to date
        exported = [row.partial() for row in self._rows.values()]
        self._rows.clear()
        self._waiting.clear()
        return exported

    def admit(self, samples: Sequence[PartialSample]) -> None:
        """Queue ``samples`` to continue here, with their carried random streams and budgets."""
        self._check_usable("admit")
        params = self._rules.params
        check_admissible(samples, params, self._rows)
        engine, rows = self._engine, []
        for partial in samples:
            where = f"PartialSample index={partial.index}"
            budget = budget_of(partial, params)
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
    ) -> Row:
        """A row of checked tokens, with its row seed when sampling."""
        seed = None
        greedy = self._rules.params.greedy
        if not greedy and rng_state is not None:
            seed = unpack_row_seed(rng_state, index=index)
        elif not greedy:
            seed = row_seed(self._seed, index, skip=len(response))
        return Row(index=index, prompt=prompt, response=response, logprobs=logprobs, budget=budget, seed=seed)

    def queue(self, rows: list[Row]) -> None:
        """Add ``rows`` (from :meth:`row`) to the samples waiting for a free batch row."""
        for row in rows:
            self._rows[row.index] = row
        self._waiting.extend(rows)

    def _check_usable(self, action: str) -> None:
        if self._closed:
            raise RuntimeError(f"cannot {action}: this run is closed; start a new one")
        if self._weights_version != self._engine.weights_version:
            raise RuntimeError(
                f"cannot {action}: the engine's weights changed since this run started; "
                "export() its unfinished samples and admit them into a new run"
            )
