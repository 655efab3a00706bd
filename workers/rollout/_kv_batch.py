"""The native engine's dynamic decode batch: rows that share one growing KV cache.

Rows stay right-aligned: each row's KV cache is ``[padding..., real tokens...]``, with
an attention mask of zeros on the padding and positions counted over real tokens
only (``cumsum(mask) - 1``). That is the convention of :mod:`._types`, so the
training engine's forward pass over ``prompt_ids ++ response_ids`` reproduces the
log-probs the engine reports. :func:`prefill` builds a batch from token sequences,
:func:`decode` extends every row by one token, and :class:`KVBatch` drops finished
rows and merges batches. :class:`DynamicBatch` is the decode batch
(:mod:`._decode_batch`) built on them, its rows' bookkeeping on tensors
(:mod:`._row_book`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ._decode_batch import Row, RunRules, distinct_sequences
from ._lean_decode import LeanDecoder, lean_decoder
from ._row_book import RowBook

if TYPE_CHECKING:  # transformers' model classes: seconds to import; a generating worker has them
    from transformers import DynamicCache, PreTrainedModel
    from transformers.cache_utils import DynamicLayer

__all__ = ["DynamicBatch", "KVBatch", "decode", "kv_layers", "prefill"]


class DynamicBatch:
    """The decode batch of the ``"dynamic"`` kind (:mod:`._decode_batch`): one
    :class:`KVBatch`, stepped through the lean decoder where the model has one, its
    rows' bookkeeping in a :class:`~._row_book.RowBook` in the same row order.

    Args:
        model: The causal LM sampled from.
        rules: How rows sample and end.
    """

    def __init__(self, model: PreTrainedModel, rules: RunRules) -> None:
        self._model = model
        self._rules = rules
        self._lean = lean_decoder(model)
        self._running: KVBatch | None = None
        self._book = RowBook(rules, next(model.parameters()).device)

    def __len__(self) -> int:
        return len(self._book)

    def join(self, rows: list[Row]) -> list[Row]:
        fresh, logits = prefill(self._model, [row.prompt + row.response for row in rows],
                                [row.index for row in rows], pad_token_id=self._rules.params.pad_token_id)
        if self._running is None:
            self._running = fresh
        else:
            self._running.extend(fresh)
        return self._advance(self._book.add(rows), logits)

    def decode(self) -> list[Row]:
        running = self._running
        if running is None or not len(running):
            return []
        logits = decode(self._model, running, self._lean)
        self._book.tick()
        return self._advance(slice(0, len(running)), logits)

    def leave(self) -> list[Row]:
        self._running = None
        return self._book.leave()

    def _advance(self, rows: slice, logits: torch.Tensor) -> list[Row]:
        """Sample one token for the batch's ``rows``, record it, and drop the rows that finished."""
        running = self._running
        assert running is not None
        tokens, ended = self._book.sample(rows, logits)
        running.next_tokens[rows] = tokens
        if not ended:
            return []
        finished = self._book.finish(ended)
        gone = set(ended)
        kept = [row for row in range(len(running)) if row not in gone]
        running.keep(kept)
        self._book.keep(kept)
        if not len(running):
            self._running = None
        return finished


@dataclass(kw_only=True)
class KVBatch:
    """Rows decoding together: their KV cache, attention mask and next inputs.

    Invariant: every row is right-aligned (its mask is zeros then ones), and the
    cache, ``mask`` and the row tensors all hold ``len(indices)`` rows."""

    indices: list[int]
    """The caller's id of each row."""
    cache: DynamicCache
    mask: torch.Tensor
    """[B, L] int64 over the cached tokens but the last ``unmasked`` (read it
    through :meth:`full_mask`)."""
    unmasked: int = 0
    """Columns cached since ``mask`` was last written, attended to by every row: an
    unpadded batch's decode steps need no mask, so they only count their column."""
    next_positions: torch.Tensor
    """[B] position of the token fed at the next step."""
    next_tokens: torch.Tensor
    """[B] the token fed at the next step (the last one sampled)."""
    padded: bool = True
    """Whether any row's cache starts with padding (``mask`` has a zero); without,
    a decode step attends to every column and needs no mask."""

    def __len__(self) -> int:
        return len(self.indices)

    def full_mask(self) -> torch.Tensor:
        """``mask`` over every cached column (the ``unmasked`` ones written now)."""
        if self.unmasked:
            ones = self.mask.new_ones((self.mask.shape[0], self.unmasked))
            self.mask, self.unmasked = torch.cat([self.mask, ones], dim=1), 0
        return self.mask

    def keep(self, rows: list[int]) -> None:
        """Keep only ``rows`` (positions in this batch, in that order; one given twice
        is copied), dropping padding nobody needs."""
        if len(rows) == len(self.indices):
            return
        select = torch.tensor(rows, dtype=torch.long, device=self.mask.device)
        self.indices = [self.indices[row] for row in rows]
        mask = self.full_mask().index_select(0, select)
        # Rows are right-aligned, so the longest row says how many columns are needed.
        lengths = mask.sum(dim=1)
        start = mask.shape[1] - int(lengths.max()) if rows else mask.shape[1]
        self.mask = mask[:, start:]
        self.padded = bool(rows) and int(lengths.min()) < self.mask.shape[1]
        self.next_positions = self.next_positions.index_select(0, select)
        self.next_tokens = self.next_tokens.index_select(0, select)
        for layer, keys, values in kv_layers(self.cache):
            layer.keys = keys.index_select(0, select)[:, :, start:]
            layer.values = values.index_select(0, select)[:, :, start:]

    def extend(self, other: KVBatch) -> None:
        """Append the rows of ``other``, left-padding whichever cache is shorter."""
        mine, theirs = self.full_mask(), other.full_mask()
        length = max(mine.shape[1], theirs.shape[1])
        self.padded = self.padded or other.padded or mine.shape[1] != theirs.shape[1]
        self.mask = torch.cat([_left_pad(mine, length), _left_pad(theirs, length)])
        self.indices = self.indices + other.indices
        self.next_positions = torch.cat([self.next_positions, other.next_positions])
        self.next_tokens = torch.cat([self.next_tokens, other.next_tokens])
        for (layer, keys, values), (_, more_keys, more_values) in zip(
            kv_layers(self.cache), kv_layers(other.cache), strict=True
        ):
            layer.keys = torch.cat([_left_pad(keys, length), _left_pad(more_keys, length)])
            layer.values = torch.cat([_left_pad(values, length), _left_pad(more_values, length)])


@torch.no_grad()
def prefill(
    model: PreTrainedModel,
    sequences: Sequence[Sequence[int]],
    indices: list[int],
    *,
    pad_token_id: int,
) -> tuple[KVBatch, torch.Tensor]:
    """Run ``sequences`` through ``model`` as one left-padded batch.

    Rows with the same tokens (a prompt's ``n`` samples in GRPO and its kin) are
    computed once: the batch runs the distinct sequences and its cache, mask and
    logits are then copied out to every row that repeats one.

    Args:
        model: A causal LM whose layers all use full attention.
        sequences: Token ids of each row (a prompt, or a prompt and the response so
            far for a migrated sample); none empty.
        indices: The caller's id of each row.
        pad_token_id: Fills the padding (masked out, so its value does not matter).

    Returns:
        The batch (its rows' ``next_tokens`` still to be sampled) and the logits of
        each row's next token, ``[B, V]`` float32.
    """
    distinct, source = distinct_sequences(sequences)
    if len(distinct) < len(sequences):
        batch, logits = _prefill(model, distinct, list(range(len(distinct))), pad_token_id=pad_token_id)
        batch.keep(source)  # one row per sequence again, in their order
        batch.indices = list(indices)
        return batch, logits.index_select(0, torch.tensor(source, device=logits.device))
    return _prefill(model, sequences, indices, pad_token_id=pad_token_id)


def _prefill(model: PreTrainedModel, sequences: Sequence[Sequence[int]], indices: list[int], *,
             pad_token_id: int) -> tuple[KVBatch, torch.Tensor]:
    """:func:`prefill` of every row as it comes."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    length = max(len(sequence) for sequence in sequences)
    ids = torch.full((len(sequences), length), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        ids[row, length - len(sequence) :] = torch.tensor(sequence, dtype=torch.long)
        mask[row, length - len(sequence) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    output = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions,
        past_key_values=DynamicCache(config=model.config),
        use_cache=True,
        logits_to_keep=1,
    )
    batch = KVBatch(
        indices=list(indices),
        cache=output.past_key_values,
        mask=mask,
        next_positions=mask.sum(dim=1),
        next_tokens=torch.zeros(len(indices), dtype=torch.long, device=device),
        padded=any(len(sequence) < length for sequence in sequences),
    )
    return batch, output.logits[:, -1, :].float()


@torch.no_grad()
def decode(model: PreTrainedModel, batch: KVBatch, lean: LeanDecoder | None = None) -> torch.Tensor:
    """Feed every row its last sampled token; return the next-token logits ``[B, V]``.
    With ``lean`` (the model's :class:`LeanDecoder`) the step skips transformers' plumbing."""
    batch.unmasked += 1
    if lean is not None:
        logits = lean.step(batch.next_tokens, batch.next_positions, batch.full_mask() if batch.padded else None,
                           [layer for layer, _, _ in kv_layers(batch.cache)])
        batch.next_positions = batch.next_positions + 1
        return logits
    output = model(
        input_ids=batch.next_tokens[:, None],
        attention_mask=batch.full_mask(),
        position_ids=batch.next_positions[:, None],
        past_key_values=batch.cache,
        use_cache=True,
    )
    batch.next_positions = batch.next_positions + 1
    return output.logits[:, -1, :].float()


def kv_layers(cache: DynamicCache) -> list[tuple[DynamicLayer, torch.Tensor, torch.Tensor]]:
    """Each layer of a full-attention cache with its keys and values ``[B, H, L, D]``."""
    from transformers.cache_utils import DynamicLayer

    entries = []
    for layer in cache.layers:
        # The engine rejects non-full-attention models, so every layer is dynamic.
        assert isinstance(layer, DynamicLayer), type(layer)
        assert layer.keys is not None and layer.values is not None
        entries.append((layer, layer.keys, layer.values))
    return entries


def _left_pad(tensor: torch.Tensor, length: int) -> torch.Tensor:
    """Zero-pad the sequence dimension (last for masks, -2 for caches) on the left."""
    dim = 1 if tensor.dim() == 2 else 2
    missing = length - tensor.shape[dim]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)
