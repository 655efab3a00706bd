"""A checkpoint's architecture from its ``config.json``, without transformers.

The driver checks a run's models (supported, heads for the layouts, context length
for the prompts, shape for the memory estimate) before any worker loads one.
Importing transformers' ``AutoConfig`` for that costs seconds of CPU (it imports
most of transformers), in the driver, while the workers import the same to load
the models. The architectures the loaders accept (Llama, Qwen2) are described by a
few ``config.json`` keys, which ``save_pretrained`` always writes; where a file
lacks one, transformers' own config class fills in its default (and the import is
paid then).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from channels import ConfigError

__all__ = ["SUPPORTED_ARCHITECTURES", "Architecture", "read_architecture"]

SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("llama", "qwen2")
"""Values of ``model_type`` (in ``config.json``) that the loaders accept."""

_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings")
"""Keys whose defaults differ between the architectures (Qwen2's key/value heads
default to 32, Llama's to the attention heads): taken from the file, or from
transformers' config class where the file has none."""
_LLAMA_KEYS = ("attention_bias", "mlp_bias")


@dataclass(frozen=True, kw_only=True)
class Architecture:
    """The sizes of a Llama or Qwen2 checkpoint (:func:`read_architecture`)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    """Query, key and value projections have biases (Qwen2's always; Llama's with ``attention_bias``)."""
    o_bias: bool
    """The output projection has a bias (Llama's with ``attention_bias``)."""
    mlp_bias: bool

    @property
    def parameters(self) -> int:
        """The causal LM's parameter count (``AutoModelForCausalLM``'s, a tied head counted once)."""
        h, heads, kv = self.hidden_size, self.num_attention_heads, self.num_key_value_heads
        q_width, kv_width = heads * self.head_dim, kv * self.head_dim
        attention = h * q_width + 2 * h * kv_width + q_width * h
        attention += (q_width + 2 * kv_width) * self.qkv_bias + h * self.o_bias
        mlp = 3 * h * self.intermediate_size + (2 * self.intermediate_size + h) * self.mlp_bias
        layer = attention + mlp + 2 * h  # and two RMSNorms
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return embeddings + self.num_hidden_layers * layer + h  # and the final norm


def read_architecture(path: str | Path) -> Architecture:
    """The architecture of the checkpoint in directory ``path``, checked to be one the
    loaders accept.

    Raises:
        ConfigError: ``path`` has no readable ``config.json``, its ``model_type`` is
            not in :data:`SUPPORTED_ARCHITECTURES`, or its sizes are not numbers.
    """
    path = Path(path)
    file = path / "config.json"
    if not file.is_file():
        raise ConfigError(f"{path} has no config.json; pass a local Hugging Face checkpoint directory "
                          "(save_tiny_model writes one)")
    try:
        raw = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{file} cannot be read as JSON: {e}") from None
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(f"{path} holds a {model_type!r} model; supported architectures "
                          f"(config.json model_type) are {SUPPORTED_ARCHITECTURES}")
    keys = _KEYS + (_LLAMA_KEYS if model_type == "llama" else ())
    if any(raw.get(key) is None for key in keys):
        raw = _with_defaults(path)
    try:
        return _architecture(model_type, raw)
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise ConfigError(f"{file} holds sizes that are not numbers: {e}") from None


def _architecture(model_type: str, raw: dict[str, Any]) -> Architecture:
    """The :class:`Architecture` of a config's keys (every one of ``_KEYS``, and of
    ``_LLAMA_KEYS`` for a Llama, present)."""
    heads = int(raw["num_attention_heads"])
    llama_bias = model_type == "llama" and bool(raw["attention_bias"])
    return Architecture(
        model_type=model_type, vocab_size=int(raw["vocab_size"]), hidden_size=int(raw["hidden_size"]),
        intermediate_size=int(raw["intermediate_size"]), num_hidden_layers=int(raw["num_hidden_layers"]),
        num_attention_heads=heads, num_key_value_heads=int(raw["num_key_value_heads"]),
        # Both architectures' attention takes hidden_size // heads where head_dim is unset.
        head_dim=int(raw.get("head_dim") or int(raw["hidden_size"]) // heads),
        max_position_embeddings=int(raw["max_position_embeddings"]),
        tie_word_embeddings=bool(raw["tie_word_embeddings"]),
        qkv_bias=model_type == "qwen2" or llama_bias, o_bias=llama_bias,
        mlp_bias=model_type == "llama" and bool(raw["mlp_bias"]),
    )


def _with_defaults(path: Path) -> dict[str, Any]:
    """``path``'s config as transformers' config class reads it: every key, the
    class's defaults where the file has none (seconds: imports transformers)."""
    from transformers import AutoConfig

    try:
        return dict(AutoConfig.from_pretrained(path, local_files_only=True).to_dict())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: {str(e).splitlines()[0]}") from None
