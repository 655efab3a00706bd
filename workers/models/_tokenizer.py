"""A symbol-level tokenizer for the tiny models of synthetic tasks.

Every symbol of a small alphabet (by default the characters of arithmetic problems)
is one token. Ids are laid out as ``<pad>=0, <bos>=1, <eos>=2, <unk>=3`` followed by
the symbols in alphabet order. :meth:`CharTokenizer.save_pretrained` writes ordinary
Hugging Face tokenizer files (``tokenizer.json``, ``tokenizer_config.json``,
``special_tokens_map.json``), so ``transformers.AutoTokenizer`` and vLLM load the
directory like any other checkpoint. :meth:`CharTokenizer.encode` and
:meth:`CharTokenizer.decode` are plain Python, for task code in hot loops.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from channels import ConfigError

__all__ = [
    "ARITHMETIC_SYMBOLS",
    "SPECIAL_TOKENS",
    "CharTokenizer",
    "CharTokenizerConfig",
]

ARITHMETIC_SYMBOLS: tuple[str, ...] = tuple("0123456789+-*= ")
"""Default alphabet: digits, ``+ - * =`` and the space."""

SPECIAL_TOKENS: tuple[str, ...] = ("<pad>", "<bos>", "<eos>", "<unk>")
"""Special tokens, in id order (``<pad>`` is 0)."""

_PAD, _BOS, _EOS, _UNK = SPECIAL_TOKENS


@dataclass(frozen=True, kw_only=True)
class CharTokenizerConfig:
    """The alphabet and behaviour of a :class:`CharTokenizer`."""

    symbols: tuple[str, ...] = ARITHMETIC_SYMBOLS
    """Token strings after the special tokens, in id order; each may span several
    characters (the longest match wins when encoding)."""
    add_bos: bool = True
    """Whether encoding text prepends ``<bos>`` (as the saved HF tokenizer does)."""
    model_max_length: int = 256
    """Longest sequence the tokenizer files advertise to transformers."""

    def __post_init__(self) -> None:
        if not isinstance(self.symbols, tuple) or not self.symbols:
            raise ConfigError(
                "CharTokenizerConfig.symbols must be a non-empty tuple of strings, e.g. "
                f"tuple('0123456789+='); got {self.symbols!r}"
            )
        for symbol in self.symbols:
            if not isinstance(symbol, str) or not symbol:
                raise ConfigError(
                    f"CharTokenizerConfig.symbols holds {symbol!r}; every symbol must be a "
                    "non-empty string"
                )
            if symbol in SPECIAL_TOKENS:
                raise ConfigError(
                    f"CharTokenizerConfig.symbols holds the special token {symbol!r}; "
                    "remove it (special tokens are added automatically)"
                )
        if len(set(self.symbols)) != len(self.symbols):
            repeated = sorted({s for s in self.symbols if self.symbols.count(s) > 1})
            raise ConfigError(f"CharTokenizerConfig.symbols repeats {repeated}; list each once")
        if self.model_max_length < 1:
            raise ConfigError(
                f"CharTokenizerConfig.model_max_length must be >= 1, got {self.model_max_length}"
            )


class CharTokenizer:
    """Symbol-level tokenizer: one token per alphabet symbol, plus special tokens.

    Args:
        config: The alphabet and options.
    """

    def __init__(self, config: CharTokenizerConfig | None = None) -> None:
        self.config = config if config is not None else CharTokenizerConfig()
        self._tokens: tuple[str, ...] = SPECIAL_TOKENS + self.config.symbols
        self._ids = {token: i for i, token in enumerate(self._tokens)}
        # Longest symbols first so that multi-character symbols win over their prefixes.
        by_length = sorted(self.config.symbols, key=len, reverse=True)
        self._pattern = "|".join(re.escape(symbol) for symbol in by_length)
        self._regex = re.compile(f"{self._pattern}|(?s:.)")

    @property
    def vocab_size(self) -> int:
        """Number of tokens, special tokens included."""
        return len(self._tokens)

    @property
    def pad_token_id(self) -> int:
        """Id of ``<pad>`` (0)."""
        return self._ids[_PAD]

    @property
    def bos_token_id(self) -> int:
        """Id of ``<bos>``."""
        return self._ids[_BOS]

    @property
    def eos_token_id(self) -> int:
        """Id of ``<eos>``."""
        return self._ids[_EOS]

    @property
    def unk_token_id(self) -> int:
        """Id of ``<unk>`` (what the HF tokenizer maps unknown text to)."""
        return self._ids[_UNK]

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        """Turn text into token ids.

        Args:
            text: Text made only of the alphabet's symbols.
            add_bos: Prepend ``<bos>``; None uses ``config.add_bos``.

        Returns:
            The token ids.

        Raises:
            ValueError: If ``text`` holds a character outside the alphabet (the HF
                tokenizer would map it to ``<unk>``; task code should not).
        """
        ids = [self.bos_token_id] if (self.config.add_bos if add_bos is None else add_bos) else []
        for match in self._regex.finditer(text):
            token_id = self._ids.get(match.group())
            if token_id is None or token_id < len(SPECIAL_TOKENS):
                raise ConfigError(
                    f"text {text!r} holds {match.group()!r} at position {match.start()}, which is "
                    "not in CharTokenizerConfig.symbols; add it to the alphabet"
                )
            ids.append(token_id)
        return ids

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        """Turn token ids back into text.

        An id past the alphabet (a row of a model's padded vocabulary, see
        ``TinyModelConfig.vocab_size``, which an untrained model may sample) reads as
        ``<unk>``, as Hugging Face tokenizers read their padded ids.

        Args:
            ids: Token ids.
            skip_special_tokens: Drop ``<pad>``, ``<bos>``, ``<eos>`` and ``<unk>``.

        Returns:
            The text.

        Raises:
            ConfigError: If an id is negative.
        """
        pieces = []
        unk = self._ids[_UNK]
        for token_id in ids:
            if token_id < 0:
                raise ConfigError(f"token id {token_id} is negative")
            if token_id >= self.vocab_size:
                token_id = unk
            if skip_special_tokens and token_id < len(SPECIAL_TOKENS):
                continue
            pieces.append(self._tokens[token_id])
        return "".join(pieces)

    def to_tokenizers(self) -> Tokenizer:
        """Build the equivalent ``tokenizers.Tokenizer`` (what ``tokenizer.json`` holds).

        Returns:
            A word-level tokenizer whose pre-tokenizer isolates each symbol.
        """
        vocab = {token: i for i, token in enumerate(self._tokens)}
        tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=_UNK))
        tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(self._pattern), behavior="isolated")
        tokenizer.decoder = decoders.Fuse()
        tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
        if self.config.add_bos:
            tokenizer.post_processor = processors.TemplateProcessing(
                single=f"{_BOS} $A",
                pair=f"{_BOS} $A {_BOS} $B",
                special_tokens=[(_BOS, self.bos_token_id)],
            )
        return tokenizer

    def save_pretrained(self, directory: str | Path) -> Path:
        """Write Hugging Face tokenizer files into ``directory`` (created if needed).

        Args:
            directory: Target directory; existing tokenizer files are overwritten.

        Returns:
            The directory.
        """
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        self.to_tokenizers().save(str(path / "tokenizer.json"))
        special = {"bos_token": _BOS, "eos_token": _EOS, "pad_token": _PAD, "unk_token": _UNK}
        tokenizer_config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **special,
            "model_max_length": self.config.model_max_length,
            "padding_side": "left",
            "clean_up_tokenization_spaces": False,
        }
        _write_json(path / "tokenizer_config.json", tokenizer_config)
        _write_json(path / "special_tokens_map.json", special)
        return path

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> CharTokenizer:
        """Load a tokenizer written by :meth:`save_pretrained`.

        Args:
            directory: A directory holding ``tokenizer.json`` and ``tokenizer_config.json``.

        Returns:
            The tokenizer.

        Raises:
            ConfigError: If ``directory`` holds no ``tokenizer.json``, or its files do
                not describe a symbol-level tokenizer with this module's special tokens.
        """
        path = Path(directory)
        if not (path / "tokenizer.json").is_file():
            raise ConfigError(f"{path} holds no tokenizer.json: the character tokenizer of the arithmetic task "
                              "is saved beside its model (CharTokenizer.save_pretrained, as the SFT warm start does)")
        spec = json.loads((path / "tokenizer.json").read_text(encoding="utf-8"))
        vocab: dict[str, int] = spec.get("model", {}).get("vocab", {})
        tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
        if tokens[: len(SPECIAL_TOKENS)] != list(SPECIAL_TOKENS):
            raise ConfigError(
                f"{path / 'tokenizer.json'} is not a CharTokenizer file: its first tokens are "
                f"{tokens[: len(SPECIAL_TOKENS)]}, expected {list(SPECIAL_TOKENS)}"
            )
        settings = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
        config = CharTokenizerConfig(
            symbols=tuple(tokens[len(SPECIAL_TOKENS) :]),
            add_bos=spec.get("post_processor") is not None,
            model_max_length=int(settings.get("model_max_length", 256)),
        )
        return cls(config)


def _write_json(path: Path, content: Mapping[str, object]) -> None:
    path.write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
