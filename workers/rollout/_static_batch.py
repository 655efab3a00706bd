"""The native engine's static decode batch: rows in the slots of a static KV cache.

A :class:`StaticBatch` keeps its running rows packed in slots ``0..n-1`` of a
:class:`~._static_cache.StaticDecoder`, and their bookkeeping in a
:class:`~._row_book.RowBook` whose row ``i`` is slot ``i``. A decode step is then the
decoder's step, the sampler and a few tensor writes: nothing per row in Python, and
nothing read back to the host unless a row can have ended (see :mod:`._row_book`).
When rows finish, the last live rows move into the freed slots, so the next step
computes a bucket no larger than the live rows need.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ._decode_batch import Row, RunRules
from ._row_book import RowBook
from ._static_cache import DecoderPool, StaticDecoder

if TYPE_CHECKING:  # transformers' model classes: seconds to import; a generating worker has them
    from transformers import PreTrainedModel

__all__ = ["StaticBatch"]


class StaticBatch:
    """The decode batch of the ``"static"`` kind (:mod:`._decode_batch`; see the
    module docstring).

    Args:
        model: The causal LM sampled from (a model the static decoder supports).
        rules: How rows sample and end.
        decoders: Lends the batch its decoder, which goes back when the batch empties.
        slots: The most rows the batch will hold at once when known (the engine's
            ``max_batch_size``), so that one decoder serves every wave.
    """

    def __init__(self, model: PreTrainedModel, rules: RunRules, decoders: DecoderPool, *,
                 slots: int | None) -> None:
        self._rules = rules
        self._decoders = decoders
        self._min_slots = slots or 0
        self._device = next(model.parameters()).device
        self._decoder: StaticDecoder | None = None
        self._book = RowBook(rules, self._device, compiled=decoders.compiled)

    def __len__(self) -> int:
        return len(self._book)

    def join(self, rows: list[Row]) -> list[Row]:
        live, sequences = len(self._book), [row.prompt + row.response for row in rows]
        decoder = self._reserve(live + len(rows), max(len(row.prompt) + row.budget for row in rows))
        logits = decoder.prefill(live, sequences, pad_token_id=self._rules.params.pad_token_id)
        added = self._book.add(rows)
        decoder.positions[added] = torch.tensor([len(s) for s in sequences], device=self._device)
        return self._advance(added, logits)

    def decode(self) -> list[Row]:
        if self._decoder is None or not len(self._book):
            return []
        live = len(self._book)
        logits = self._decoder.step(live)
        self._book.tick()
        self._decoder.positions[:live] += 1
        return self._advance(slice(0, live), logits)

    def leave(self) -> list[Row]:
        rows = self._book.leave()
        self._give_back()
        return rows

    def _advance(self, rows: slice, logits: torch.Tensor) -> list[Row]:
        """Sample the next token of the slots ``rows``, and let the rows that ended go."""
        assert self._decoder is not None
        tokens, ended = self._book.sample(rows, logits)
        self._decoder.tokens[rows] = tokens
        if not ended:
            return []
        finished = self._book.finish(ended)
        self._pack(ended)
        return finished

    def _pack(self, ended: list[int]) -> None:
        """Drop the slots ``ended`` and move the last live rows into the holes."""
        live = len(self._book) - len(ended)
        gone = set(ended)
        holes = [slot for slot in ended if slot < live]
        movers = [slot for slot in range(live, len(self._book)) if slot not in gone]
        if holes:
            assert self._decoder is not None
            sources, targets = self._tensor(movers), self._tensor(holes)
            self._decoder.move(sources, targets)
            self._book.move(sources, targets, movers, holes)
        self._book.truncate(live)
        if not len(self._book):
            self._give_back()

    def _reserve(self, slots: int, length: int) -> StaticDecoder:
        """A decoder with room for ``slots`` rows of ``length`` tokens, the live rows in it."""
        decoder, live = self._decoder, len(self._book)
        if decoder is not None and decoder.slots >= slots and decoder.length >= length:
            return decoder
        if decoder is not None:
            slots, length = max(slots, decoder.slots), max(length, decoder.length)
        grown = self._decoders.lend(max(slots, self._min_slots), length)
        if decoder is not None:
            decoder.copy_to(grown, live)
        self._book.reserve(grown.slots)
        self._decoder = grown
        return grown

    def _give_back(self) -> None:
        if self._decoder is not None:
            self._decoders.give_back(self._decoder)
            self._decoder = None

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self._device)
