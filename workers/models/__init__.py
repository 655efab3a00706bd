"""Models for RLHF roles: tiny Hugging Face causal LMs, value models and their tokenizer.

Actor and reference roles use transformers causal LMs (Llama, Qwen2) loaded from a
local directory; critic, reward and cost roles wrap the same backbones in a
:class:`ValueModel`. Examples and tests build tiny random models with
:func:`save_tiny_model`; nothing is downloaded.
"""

from __future__ import annotations

from ._checkpoint import SUPPORTED_ARCHITECTURES, check_supported_checkpoint
from ._factory import (
    TinyModelConfig,
    build_tiny_model,
    load_model,
    save_tiny_model,
    tiny_hf_config,
)
from ._tokenizer import ARITHMETIC_SYMBOLS, SPECIAL_TOKENS, CharTokenizer, CharTokenizerConfig
from ._value_head import VALUE_HEAD_FILE, ValueModel

__all__ = [
    "ARITHMETIC_SYMBOLS",
    "SPECIAL_TOKENS",
    "SUPPORTED_ARCHITECTURES",
    "VALUE_HEAD_FILE",
    "CharTokenizer",
    "CharTokenizerConfig",
    "TinyModelConfig",
    "ValueModel",
    "build_tiny_model",
    "check_supported_checkpoint",
    "load_model",
    "save_tiny_model",
    "tiny_hf_config",
]
