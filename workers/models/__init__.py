"""Models for RLHF roles: tiny Hugging Face causal LMs, value models and their tokenizer.

Actor and reference roles use transformers causal LMs (Llama, Qwen2) loaded from a
local directory; critic, reward and cost roles wrap the same backbones in a
:class:`ValueModel` (which also loads one-label sequence classifiers, the usual
format of reward models). :func:`load_prompt_tokenizer` gives a policy's tokenizer
as prompts and episodes need it (:class:`PromptTokenizer`). :func:`gguf_to_hf_dir` turns a user's GGUF file into a
checkpoint directory; :func:`read_architecture` reads a checkpoint's sizes without
transformers. Examples and tests build tiny random models with
:func:`save_tiny_model`; nothing is downloaded.
"""

from __future__ import annotations

from ._architecture import Architecture, read_architecture
from ._checkpoint import check_supported_checkpoint, save_pretrained_here
from ._factory import (
    TinyModelConfig,
    build_tiny_model,
    load_model,
    save_tiny_model,
    tiny_hf_config,
)
from ._gguf import GgufModel, gguf_to_hf_dir, read_gguf_header, smollm2_gguf
from ._prompt_tokenizer import PromptTokenizer, load_prompt_tokenizer
from ._tokenizer import SPECIAL_TOKENS, CharTokenizer, CharTokenizerConfig
from ._tokenizer_dir import TOKENIZER_FILES, has_tokenizer, load_tokenizer
from ._value_head import VALUE_HEAD_FILE, ValueModel

__all__ = [
    "SPECIAL_TOKENS",
    "TOKENIZER_FILES",
    "VALUE_HEAD_FILE",
    "Architecture",
    "CharTokenizer",
    "CharTokenizerConfig",
    "GgufModel",
    "PromptTokenizer",
    "TinyModelConfig",
    "ValueModel",
    "build_tiny_model",
    "check_supported_checkpoint",
    "gguf_to_hf_dir",
    "has_tokenizer",
    "load_model",
    "load_prompt_tokenizer",
    "load_tokenizer",
    "read_architecture",
    "read_gguf_header",
    "save_pretrained_here",
    "save_tiny_model",
    "smollm2_gguf",
    "tiny_hf_config",
]
