"""The tokenizer saved in a model directory, found one way for every reader (the
prompt encoder, the reward's decoder, the rollout's stop strings).

A directory holds either the repository's :class:`CharTokenizer` (the tiny
synthetic-task models) or any tokenizer ``transformers.AutoTokenizer`` loads from
local files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from channels import ConfigError

from ._tokenizer import SPECIAL_TOKENS, CharTokenizer

__all__ = ["TOKENIZER_FILES", "has_tokenizer", "is_char_tokenizer_dir", "load_tokenizer"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")
"""Files one of which every tokenizer transformers loads from a directory has."""


def has_tokenizer(model_dir: str | os.PathLike[str]) -> bool:
    """Whether ``model_dir`` holds tokenizer files (any of :data:`TOKENIZER_FILES`)."""
    return any((Path(model_dir) / name).is_file() for name in TOKENIZER_FILES)


def is_char_tokenizer_dir(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` holds what :meth:`CharTokenizer.save_pretrained` writes (a
    word-level ``tokenizer.json`` whose first tokens are :data:`SPECIAL_TOKENS`)."""
    path = Path(path)
    if not (path / "tokenizer_config.json").is_file():
        return False
    try:
        spec = json.loads((path / "tokenizer.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    model = spec.get("model") if isinstance(spec, dict) else None
    if not isinstance(model, dict) or model.get("type") != "WordLevel":
        return False
    vocab = model.get("vocab")
    if not isinstance(vocab, dict):
        return False
    by_id = {i: token for token, i in vocab.items()}
    return [by_id.get(i) for i in range(len(SPECIAL_TOKENS))] == list(SPECIAL_TOKENS)


def load_tokenizer(model_dir: str | os.PathLike[str]) -> Any:
    """Load the tokenizer saved in a model directory: a :class:`CharTokenizer`, or a
    ``transformers`` tokenizer (local files only).

    Raises:
        ConfigError: the directory does not exist, holds no tokenizer files, or
            transformers cannot load them.
    """
    path = Path(model_dir)
    if not path.is_dir():
        raise ConfigError(f"the model directory {path} does not exist; point the model at a local "
                          "checkpoint directory")
    if not has_tokenizer(path):
        raise ConfigError(f"the model directory {path} holds no tokenizer files (one of "
                          f"{', '.join(TOKENIZER_FILES)}); save the tokenizer with the model")
    if is_char_tokenizer_dir(path):
        return CharTokenizer.from_pretrained(path)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ConfigError(f"the tokenizer files in {path} do not load with transformers.AutoTokenizer "
                          f"({type(e).__name__}: {first_line})") from None
