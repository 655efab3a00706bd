"""Stop strings for engines that sample token by token: when has a response ended?

vLLM looks for stop strings in its incremental detokenizer
(``vllm/v1/engine/detokenizer.py``): after each new token, once the response has
more than ``min_tokens`` tokens, it searches the text that token added plus the
``len(stop) - 1`` chars before it, so a stop string ends the response at the token
that completes it, and one completed while the response was shorter than
``min_tokens`` is never looked at again. :class:`StopStrings` applies the same rule
to the native engine's responses.

Decoding a whole response every step would cost time quadratic in its length, so only
its last tokens are decoded: enough of them for the longest stop string (a character
is at most 4 UTF-8 bytes, and every token but a skipped special token adds at least
one byte). A trailing U+FFFD (a character whose bytes are not all there yet) does not
count as text, as in vLLM, which holds such bytes back until the character is whole.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Protocol, cast

from workers.models import has_tokenizer

__all__ = ["StopStrings", "TextDecoder", "load_tokenizer"]

_INCOMPLETE = "\ufffd"
_SLACK_TOKENS = 4
"""Tokens decoded before the window a stop string can span, so that how the first
token of a decoded slice is rendered (a dropped leading space, say) cannot matter."""


class TextDecoder(Protocol):
    """What stop strings need of a tokenizer: ids to text (any Hugging Face tokenizer,
    or the tiny models' ``CharTokenizer``)."""

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        """Token ids to text, without special tokens when ``skip_special_tokens``."""
        ...


class StopStrings:
    """Finds where a response completes one of its stop strings.

    Args:
        decoder: The model's tokenizer.
        stop: The stop strings (non-empty).
        min_new_tokens: Responses of at most this many tokens are not checked.
    """

    def __init__(self, decoder: TextDecoder, stop: Sequence[str], *, min_new_tokens: int) -> None:
        self._decoder = decoder
        self._stop = tuple(stop)
        self._min_new_tokens = min_new_tokens
        self._window = 4 * max(len(text) for text in self._stop) + _SLACK_TOKENS

    def ended(self, response: Sequence[int]) -> bool:
        """Whether the last token of ``response`` completes a stop string.

        Args:
            response: The response's tokens so far, the newest last (carried tokens
                of a migrated sample included).

        Returns:
            True when the text that the last token added, with the chars before it,
            holds one of the stop strings and ``response`` is longer than
            ``min_new_tokens``.
        """
        if len(response) <= self._min_new_tokens:
            return False
        tail = list(response[-(self._window + 1) :])
        text = self._text(tail)
        new_chars = len(text) - len(self._text(tail[:-1]))
        if new_chars <= 0:
            return False
        for stop in self._stop:
            # Search from the first place where a match would reach the new chars.
            if text.find(stop, max(len(text) - new_chars - len(stop) + 1, 0)) != -1:
                return True
        return False

    def _text(self, ids: list[int]) -> str:
        return self._decoder.decode(ids, skip_special_tokens=True).rstrip(_INCOMPLETE)


def load_tokenizer(model_dir: str | os.PathLike[str]) -> TextDecoder | None:
    """The tokenizer saved in ``model_dir`` (``transformers.AutoTokenizer``, local
    files only), for a :class:`~._native.NativeRolloutEngine`'s stop strings; None
    when the directory holds no tokenizer files.

    Raises:
        OSError: If the tokenizer files are there but transformers cannot load them.
    """
    if not has_tokenizer(model_dir):
        return None
    from transformers import AutoTokenizer

    return cast(TextDecoder, AutoTokenizer.from_pretrained(os.fspath(model_dir), local_files_only=True))
