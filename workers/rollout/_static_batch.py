"""The native engine's static decode batch: rows in the slots of a static KV cache,
their bookkeeping on the device.

A :class:`StaticBatch` keeps its running rows packed in slots ``0..n-1`` of a
:class:`~._static_cache.StaticDecoder` and, beside them on the device, each row's
response length, budget and row seed and its sampled tokens and log-probs so far. A
decode step is then the decoder's step, the sampler and a few tensor writes: nothing
per row in Python, and nothing read back to the host unless a row can have ended:

- with ``ignore_eos`` (or no EOS id) and no stop strings, a row ends at its budget,
  which the host knows: the step reads nothing back until a row finishes;
- with EOS, the step reads back which rows sampled it (one small copy);
- with stop strings, it reads back the step's tokens, whose text is looked at.

A finished row's tokens and log-probs are read back when it finishes; the last live
rows then move into the freed slots, so the next step computes a bucket no larger
than the live rows need.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from ._decode_batch import Row, RunRules
from ._sampling import sample_tokens, signed_seeds
from ._static_cache import DecoderPool, StaticDecoder

__all__ = ["StaticBatch"]


@dataclass(eq=False)
class _Slot:
    """A running row and what the host keeps of it."""

    row: Row
    carried: int
    """Response tokens it came with (already in ``row.response``)."""
    end: int
    """The decode step after which it reaches its budget (the batch's step count)."""
    text: list[int] | None
    """Its response so far, kept on the host only when stop strings are looked for."""


class _Columns:
    """Per-slot tensors on the device: response length, budget, row seed, and the
    response's tokens and log-probs (``width`` columns)."""

    def __init__(self, slots: int, width: int, device: torch.device) -> None:
        self.lengths = torch.zeros(slots, dtype=torch.long, device=device)
        self.budgets = torch.zeros(slots, dtype=torch.long, device=device)
        self.seeds = torch.zeros(slots, dtype=torch.long, device=device)
        self.tokens = torch.zeros((slots, width), dtype=torch.long, device=device)
        self.logprobs = torch.zeros((slots, width), dtype=torch.float32, device=device)

    def all(self) -> tuple[torch.Tensor, ...]:
        return self.lengths, self.budgets, self.seeds, self.tokens, self.logprobs

    def grown(self, slots: int, rows: int) -> _Columns:
        """A copy with ``slots`` slots, rows ``0..rows-1`` carried over."""
        width, device = self.tokens.shape[1], self.tokens.device
        grown = _Columns(slots, width, device)
        for old, new in zip(self.all(), grown.all(), strict=True):
            new[:rows] = old[:rows]
        return grown

    def move(self, sources: torch.Tensor, targets: torch.Tensor) -> None:
        for tensor in self.all():
            tensor.index_copy_(0, targets, tensor.index_select(0, sources))


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
        self._model = model
        self._rules = rules
        self._decoders = decoders
        self._min_slots = slots or 0
        self._device = next(model.parameters()).device
        self._decoder: StaticDecoder | None = None
        self._columns = _Columns(0, rules.params.max_new_tokens, self._device)
        self._slots: list[_Slot] = []
        self._steps = 0
        """Decode steps taken (the clock of ``_Slot.end``)."""
        params = rules.params
        self._eos_ends = not params.ignore_eos and params.eos_token_id is not None

    def __len__(self) -> int:
        return len(self._slots)

    def join(self, rows: list[Row]) -> list[Row]:
        live, sequences = len(self._slots), [row.prompt + row.response for row in rows]
        decoder = self._reserve(live + len(rows), max(len(row.prompt) + row.budget for row in rows))
        logits = decoder.prefill(live, sequences, pad_token_id=self._rules.params.pad_token_id)
        added = slice(live, live + len(rows))
        columns = self._columns
        decoder.positions[added] = self._tensor([len(s) for s in sequences])
        columns.lengths[added] = self._tensor([len(row.response) for row in rows])
        columns.budgets[added] = self._tensor([row.budget for row in rows])
        if not self._rules.params.greedy:
            columns.seeds[added] = self._tensor(signed_seeds([row.seed or 0 for row in rows]))
        text = self._rules.stop is not None
        self._slots += [
            _Slot(row, len(row.response), self._steps + row.budget - len(row.response) - 1,
                  list(row.response) if text else None)
            for row in rows
        ]
        return self._advance(added, logits)

    def decode(self) -> list[Row]:
        if self._decoder is None or not self._slots:
            return []
        live = len(self._slots)
        logits = self._decoder.step(live)
        self._steps += 1
        self._decoder.positions[:live] += 1
        return self._advance(slice(0, live), logits)

    def leave(self) -> list[Row]:
        rows = [slot.row for slot in self._slots]
        if self._slots:
            self._fill_in(list(range(len(self._slots))))
        self._slots = []
        self._give_back()
        return rows

    def _advance(self, rows: slice, logits: torch.Tensor) -> list[Row]:
        """Sample the next token of the slots ``rows``, record it, and let the rows that ended go."""
        columns, decoder = self._columns, self._decoder
        assert decoder is not None
        lengths = columns.lengths[rows]
        tokens, logprobs = sample_tokens(logits, self._rules.params, columns.seeds[rows], lengths=lengths,
                                         early_banned=self._rules.early_banned)
        columns.tokens[rows].scatter_(1, lengths[:, None], tokens[:, None])
        columns.logprobs[rows].scatter_(1, lengths[:, None], logprobs[:, None])
        lengths += 1
        decoder.tokens[rows] = tokens
        ended = self._ended(rows, tokens)
        if not ended:
            return []
        finished = [self._slots[slot].row for slot in ended]
        self._fill_in(ended)
        self._pack(ended)
        return finished

    def _ended(self, rows: slice, tokens: torch.Tensor) -> list[int]:
        """The slots among ``rows`` whose row has ended with ``tokens``, in slot order."""
        slots = range(rows.start, rows.stop)
        if self._rules.stop is not None:  # the text decides: every token comes to the host
            ended = []
            for slot, token in zip(slots, tokens.tolist(), strict=True):
                entry = self._slots[slot]
                assert entry.text is not None
                entry.text.append(token)
                if self._rules.ended(entry.text, entry.row.budget):
                    ended.append(slot)
            return ended
        if self._eos_ends:
            hit = (tokens == self._rules.params.eos_token_id) | (
                self._columns.lengths[rows] >= self._columns.budgets[rows])
            return (hit.nonzero()[:, 0] + rows.start).tolist()
        return [slot for slot in slots if self._slots[slot].end <= self._steps]

    def _fill_in(self, slots: list[int]) -> None:
        """Read the responses of ``slots`` back into their rows (after what they carried)."""
        index = torch.tensor(slots, device=self._device)
        columns = self._columns
        lengths = columns.lengths.index_select(0, index).tolist()
        tokens = columns.tokens.index_select(0, index).tolist()
        logprobs = columns.logprobs.index_select(0, index).tolist()
        for slot, length, row_tokens, row_logprobs in zip(slots, lengths, tokens, logprobs, strict=True):
            entry = self._slots[slot]
            row = entry.row
            row.response = row.response[: entry.carried] + row_tokens[entry.carried : length]
            row.logprobs = row.logprobs[: entry.carried] + row_logprobs[entry.carried : length]

    def _pack(self, ended: list[int]) -> None:
        """Drop the slots ``ended`` and move the last live rows into the holes."""
        live = len(self._slots) - len(ended)
        gone = set(ended)
        holes = [slot for slot in ended if slot < live]
        movers = [slot for slot in range(live, len(self._slots)) if slot not in gone]
        if holes:
            assert self._decoder is not None
            sources, targets = self._tensor(movers), self._tensor(holes)
            self._decoder.move(sources, targets)
            self._columns.move(sources, targets)
            for hole, mover in zip(holes, movers, strict=True):
                self._slots[hole] = self._slots[mover]
        del self._slots[live:]
        if not self._slots:
            self._give_back()

    def _reserve(self, slots: int, length: int) -> StaticDecoder:
        """A decoder with room for ``slots`` rows of ``length`` tokens, the live rows in it."""
        decoder, live = self._decoder, len(self._slots)
        if decoder is not None and decoder.slots >= slots and decoder.length >= length:
            return decoder
        if decoder is not None:
            slots, length = max(slots, decoder.slots), max(length, decoder.length)
        grown = self._decoders.lend(max(slots, self._min_slots), length)
        if decoder is not None:
            decoder.copy_to(grown, live)
        if grown.slots != self._columns.lengths.shape[0]:
            self._columns = self._columns.grown(grown.slots, live)
        self._decoder = grown
        return grown

    def _give_back(self) -> None:
        if self._decoder is not None:
            self._decoders.give_back(self._decoder)
            self._decoder = None

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self._device)
