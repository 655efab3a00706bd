"""Turning token ids back into text for rule rewards, with the model directory's tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol, cast

from channels import ConfigError
from workers.models import CharTokenizer


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
    """Load the tokenizer saved in a model directory.

    A :class:`CharTokenizer` directory (the tiny models') loads as one, which decodes
    in plain Python; any other directory goes through ``transformers.AutoTokenizer``
    (local files only).

    Args:
        directory: a model directory holding tokenizer files.

    Returns:
        The tokenizer.

    Raises:
        ConfigError: the directory holds no tokenizer transformers can load.
    """
    path = Path(directory)
    try:
        return CharTokenizer.from_pretrained(path)
    except (OSError, ValueError, KeyError, json.JSONDecodeError):
        pass  # not a CharTokenizer directory: try transformers
    from transformers import AutoTokenizer

    try:
        return cast(Decoder, AutoTokenizer.from_pretrained(path, local_files_only=True))
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"tokenizer_dir {str(path)!r} holds no tokenizer ({type(e).__name__}: {e}); point "
            "it at the policy's model directory (save_tiny_model writes the tokenizer there)"
        ) from None


def decode_rows(decoder: Decoder, rows: list[list[int]], *, strip_pad: bool = False) -> list[str]:
    """Decode every row, dropping special tokens (and trailing padding).

    Args:
        decoder: the tokenizer.
        rows: token ids per row.
        strip_pad: drop trailing pad ids first (for right-padded answers whose pad
            id a tokenizer may not treat as special).

    Returns:
        One string per row.
    """
    pad = decoder.pad_token_id
    out = []
    for ids in rows:
        if strip_pad and pad is not None:
            end = len(ids)
            while end and ids[end - 1] == pad:
                end -= 1
            ids = ids[:end]
        out.append(decoder.decode(ids, skip_special_tokens=True))
    return out
