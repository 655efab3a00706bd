"""The bookkeeping of a decode batch's running rows, on the device.

Both kinds of decode batch (:mod:`._decode_batch`) keep their running rows in a
:class:`RowBook`: row ``i`` of the book is row ``i`` of the batch's KV cache. Beside
the host's list of rows, the book holds on the device each row's response length and
budget, the uniforms of its random stream for every position (drawn once, when it
joins: a step then looks its uniform up instead of computing it) and its sampled
tokens and log-probs so far, so that a step records its tokens with a few tensor
writes, nothing per row in Python, and reads nothing back unless a row can have
ended:

- with ``ignore_eos`` (or no EOS id) and no stop strings, a row ends at its budget,
  which the host knows: nothing is read back until a row finishes;
- with EOS, the step reads back which rows sampled it (one small copy);
- with stop strings, it reads back the step's tokens, whose text is looked at.

A finished row's tokens and log-probs are read back into its :class:`~._decode_batch.Row`
when it finishes or leaves. The batch decides how rows are removed: the dynamic one
keeps the others in order (:meth:`RowBook.keep`), the static one moves its last rows
into the holes (:meth:`RowBook.move`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._decode_batch import Row, RunRules
from ._sampling import sample_tokens, signed_seeds, stream_uniforms, uniform_dtype

__all__ = ["RowBook"]


@dataclass(eq=False)
class _Entry:
    """A running row and what the host keeps of it."""

    row: Row
    carried: int
    """Response tokens it came with (already in ``row.response``)."""
    end: int
    """The decode step after which it reaches its budget (the book's step count)."""
    text: list[int] | None
    """Its response so far, kept on the host only when stop strings are looked for."""


class _Columns:
    """Per-row tensors on the device: response length, budget, and per response
    position (``width`` columns) the uniform its token is drawn with (``draws``
    columns: ``width`` when sampling, 0 when greedy), the token and its log-prob."""

    def __init__(self, rows: int, width: int, draws: int, device: torch.device) -> None:
        self.lengths = torch.zeros(rows, dtype=torch.long, device=device)
        self.budgets = torch.zeros(rows, dtype=torch.long, device=device)
        self.uniforms = torch.zeros((rows, draws), dtype=uniform_dtype(device), device=device)
        self.tokens = torch.zeros((rows, width), dtype=torch.long, device=device)
        self.logprobs = torch.zeros((rows, width), dtype=torch.float32, device=device)

    def all(self) -> tuple[torch.Tensor, ...]:
        return self.lengths, self.budgets, self.uniforms, self.tokens, self.logprobs

    def grown(self, rows: int, live: int) -> _Columns:
        """A copy with room for ``rows`` rows, rows ``0..live-1`` carried over."""
        grown = _Columns(rows, self.tokens.shape[1], self.uniforms.shape[1], self.tokens.device)
        for old, new in zip(self.all(), grown.all(), strict=True):
            new[:live] = old[:live]
        return grown


class RowBook:
    """The running rows of a decode batch and their bookkeeping (see the module docstring).

    Args:
        rules: How rows sample and end.
        device: Where the logits come from, and the bookkeeping lives.
        compiled: Sample with the compiled sampler where it has one
            (:func:`~._sampling.sample_tokens`' ``compiled``).
    """

    def __init__(self, rules: RunRules, device: torch.device, *, compiled: bool = False) -> None:
        self._rules = rules
        self._device = device
        self._compiled = compiled
        width = rules.params.max_new_tokens
        self._columns = _Columns(0, width, 0 if rules.params.greedy else width, device)
        self._entries: list[_Entry] = []
        self._steps = 0
        """Decode steps taken (the clock of ``_Entry.end``)."""
        params = rules.params
        self._eos_ends = not params.ignore_eos and params.eos_token_id is not None

    def __len__(self) -> int:
        return len(self._entries)

    def reserve(self, rows: int) -> None:
        """Room for ``rows`` rows (at least: it grows by doubling)."""
        room = self._columns.lengths.shape[0]
        if rows > room:
            self._columns = self._columns.grown(max(rows, 2 * room), len(self._entries))

    def add(self, rows: list[Row]) -> slice:
        """Append ``rows`` (after the running ones); the book's rows they are."""
        live = len(self._entries)
        self.reserve(live + len(rows))
        added, columns = slice(live, live + len(rows)), self._columns
        columns.lengths[added] = self._tensor([len(row.response) for row in rows])
        columns.budgets[added] = self._tensor([row.budget for row in rows])
        if not self._rules.params.greedy:  # each row's whole stream, a uniform per position
            seeds = self._tensor(signed_seeds([row.seed or 0 for row in rows]))
            positions = torch.arange(columns.uniforms.shape[1], device=self._device)
            columns.uniforms[added] = stream_uniforms(seeds[:, None], positions[None], columns.uniforms.dtype)
        text = self._rules.stop is not None
        self._entries += [
            _Entry(row, len(row.response), self._steps + row.budget - len(row.response) - 1,
                   list(row.response) if text else None)
            for row in rows
        ]
        return added

    def tick(self) -> None:
        """Count one decode step of every running row (before it samples)."""
        self._steps += 1

    def sample(self, rows: slice, logits: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """Sample the next token of the book's ``rows`` from their ``logits`` and record
        it; return the tokens and the rows (of the book) that ended with them."""
        columns = self._columns
        lengths = columns.lengths[rows]
        uniforms = None if self._rules.params.greedy else columns.uniforms[rows].gather(1, lengths[:, None])[:, 0]
        tokens, logprobs = sample_tokens(logits, self._rules.params, None, lengths=lengths, uniforms=uniforms,
                                         early_banned=self._rules.early_banned, compiled=self._compiled)
        columns.tokens[rows].scatter_(1, lengths[:, None], tokens[:, None])
        columns.logprobs[rows].scatter_(1, lengths[:, None], logprobs[:, None])
        lengths += 1
        return tokens, self._ended(rows, tokens)

    def finish(self, ended: list[int]) -> list[Row]:
        """The rows ``ended`` with their responses read back (they stay in the book
        until the batch removes them)."""
        self._fill_in(ended)
        return [self._entries[row].row for row in ended]

    def keep(self, rows: list[int]) -> None:
        """Keep only ``rows``, in that order."""
        index = self._tensor(rows)
        for tensor in self._columns.all():
            tensor[: len(rows)] = tensor.index_select(0, index)
        self._entries = [self._entries[row] for row in rows]

    def move(self, sources: torch.Tensor, targets: torch.Tensor, sources_list: list[int],
             targets_list: list[int]) -> None:
        """Move rows ``sources`` into rows ``targets`` (index tensors, and the same as lists)."""
        for tensor in self._columns.all():
            tensor.index_copy_(0, targets, tensor.index_select(0, sources))
        for target, source in zip(targets_list, sources_list, strict=True):
            self._entries[target] = self._entries[source]

    def truncate(self, rows: int) -> None:
        """Keep rows ``0..rows-1``."""
        del self._entries[rows:]

    def leave(self) -> list[Row]:
        """Every running row, its response up to date; the book is empty after."""
        rows = self.finish(list(range(len(self._entries))))
        self._entries = []
        return rows

    def _ended(self, rows: slice, tokens: torch.Tensor) -> list[int]:
        """The book's rows among ``rows`` that ended with ``tokens``, in order."""
        if self._rules.stop is not None:  # the text decides: every token comes to the host
            ended = []
            for row, token in zip(range(rows.start, rows.stop), tokens.tolist(), strict=True):
                entry = self._entries[row]
                assert entry.text is not None
                entry.text.append(token)
                if self._rules.ended(entry.text, entry.row.budget):
                    ended.append(row)
            return ended
        if self._eos_ends:
            columns = self._columns
            hit = (tokens == self._rules.params.eos_token_id) | (columns.lengths[rows] >= columns.budgets[rows])
            return (hit.nonzero()[:, 0] + rows.start).tolist()
        entries = self._entries[rows]
        if not entries or min(entry.end for entry in entries) > self._steps:
            return []
        return [rows.start + k for k, entry in enumerate(entries) if entry.end <= self._steps]

    def _fill_in(self, rows: list[int]) -> None:
        """Read the responses of ``rows`` back into their rows (after what they carried)."""
        if not rows:
            return
        index = self._tensor(rows)
        columns = self._columns
        lengths = columns.lengths.index_select(0, index).tolist()
        tokens = columns.tokens.index_select(0, index).tolist()
        logprobs = columns.logprobs.index_select(0, index).tolist()
        for row, length, row_tokens, row_logprobs in zip(rows, lengths, tokens, logprobs, strict=True):
            entry = self._entries[row]
            sample = entry.row
            sample.response = sample.response[: entry.carried] + row_tokens[entry.carried : length]
            sample.logprobs = sample.logprobs[: entry.carried] + row_logprobs[entry.carried : length]
            entry.carried = length

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self._device)
