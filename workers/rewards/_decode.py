"""Turning token ids back into text for rule rewards, with the model directory's tokenizer."""

from __future__ import annotations

from collections.abc import Sized
from pathlib import Path
from typing import Any, Protocol, cast

from channels import ConfigError
from workers.models import load_tokenizer


class Decoder(Protocol):
    """What rule rewards need of a tokenizer (both :class:`CharTokenizer` and the
    transformers tokenizers have it)."""

    @property
    def pad_token_id(self) -> Any:
        """The padding id (None when the tokenizer has none)."""
        ...

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        """Token ids to text."""
        ...


def load_decoder(directory: str | Path) -> Decoder:
    """Load the tokenizer saved in a model directory (:func:`workers.models.load_tokenizer`:
    a :class:`CharTokenizer`, which decodes in plain Python, or a transformers one).

    Args:
        directory: a model directory holding tokenizer files.

    Returns:
        The tokenizer.

    Raises:
        ConfigError: the directory holds no tokenizer transformers can load.
    """
    try:
        return cast(Decoder, load_tokenizer(directory))
    except ConfigError as e:
        raise ConfigError(f"tokenizer_dir {str(directory)!r} holds no tokenizer ({e}); point it at the policy's "
                          "model directory (save_tiny_model writes the tokenizer there)") from None


UNKNOWN_TOKEN_TEXT = "\ufffd"
"""What an id the tokenizer does not know decodes to: one U+FFFD (the Unicode
replacement character) per such id, so that the text still shows something was
generated there (and an exact match with a reference fails)."""


def known_ids(decoder: Decoder) -> int | None:
    """How many ids the tokenizer decodes (``[0, n)``): ``len(decoder)`` (added tokens
    included) when it has one, else its ``vocab_size``; None when it tells neither."""
    size = len(decoder) if isinstance(decoder, Sized) else getattr(decoder, "vocab_size", None)
    return int(size) if isinstance(size, int) else None


def decode_ids(decoder: Decoder, ids: list[int], *, limit: int | None = None) -> str:
    """Decode one row, dropping special tokens; ids outside ``[0, limit)`` (a model whose
    vocabulary is larger than the tokenizer's, e.g. padded to a multiple of 64) become
    :data:`UNKNOWN_TOKEN_TEXT` each instead of failing.

    Args:
        decoder: the tokenizer.
        ids: token ids.
        limit: ids the tokenizer knows (:func:`known_ids`); None: all of them.

    Returns:
        The text.
    """
    if limit is None or all(0 <= i < limit for i in ids):
        return decoder.decode(ids, skip_special_tokens=True)
    pieces: list[str] = []
    run: list[int] = []
    for i in ids:
        if 0 <= i < limit:
            run.append(i)
            continue
        if run:  # decode the known ids between two unknown ones together
            pieces.append(decoder.decode(run, skip_special_tokens=True))
            run = []
        pieces.append(UNKNOWN_TOKEN_TEXT)
    if run:
        pieces.append(decoder.decode(run, skip_special_tokens=True))
    return "".join(pieces)


def decode_rows(decoder: Decoder, rows: list[list[int]], *, strip_pad: bool = False) -> list[str]:
    """Decode every row, dropping special tokens (and trailing padding).

    Ids the tokenizer does not know decode to :data:`UNKNOWN_TOKEN_TEXT` (see
    :func:`decode_ids`).

    Args:
        decoder: the tokenizer.
        rows: token ids per row.
        strip_pad: drop trailing pad ids first (for right-padded answers whose pad
            id a tokenizer may not treat as special).

    Returns:
        One string per row.
    """
    pad = decoder.pad_token_id
    limit = known_ids(decoder)
    out = []
    for ids in rows:
        if strip_pad and pad is not None:
            end = len(ids)
            while end and ids[end - 1] == pad:
                end -= 1
            ids = ids[:end]
        out.append(decode_ids(decoder, ids, limit=limit))
    return out
