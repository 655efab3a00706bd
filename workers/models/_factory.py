"""Build, save and load the tiny Hugging Face models that examples and tests train.

Nothing is downloaded: :func:`build_tiny_model` initialises a Llama or Qwen2 causal
LM at random from a seed, :func:`save_tiny_model` writes it as an ordinary HF
checkpoint directory (``config.json``, ``model.safetensors``,
``generation_config.json`` and the tokenizer files of :class:`CharTokenizer`), and
:func:`load_model` loads any local checkpoint of the supported architectures, as a
causal LM (actor, reference) or with a value head (critic, reward, cost).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

import torch

from channels import ConfigError

from ._architecture import SUPPORTED_ARCHITECTURES, read_architecture
from ._checkpoint import save_pretrained_here
from ._tokenizer import CharTokenizer, CharTokenizerConfig
from ._value_head import VALUE_HEAD_FILE, ValueModel, is_value_model_dir

if TYPE_CHECKING:  # transformers' model classes: seconds to import; imported where a model is built
    from transformers import GenerationConfig, PretrainedConfig, PreTrainedModel

__all__ = [
    "TinyModelConfig",
    "build_tiny_model",
    "load_model",
    "save_tiny_model",
    "tiny_hf_config",
]

MIN_HEAD_DIM = 32
"""Smallest head size vLLM's CPU attention kernels accept."""


@dataclass(frozen=True, kw_only=True)
class TinyModelConfig:
    """Shape of a tiny randomly initialised causal LM (float32)."""

    architecture: Literal["llama", "qwen2"] = "llama"
    """Hugging Face architecture: ``"llama"`` (LlamaForCausalLM) or ``"qwen2"``."""
    hidden_size: int = 128
    """Width of the residual stream; must equal ``num_attention_heads * head_dim``."""
    intermediate_size: int = 256
    """Width of the MLP."""
    num_hidden_layers: int = 2
    """Number of decoder layers."""
    num_attention_heads: int = 2
    """Number of query heads."""
    num_key_value_heads: int = 2
    """Number of key/value heads; must divide ``num_attention_heads``."""
    head_dim: int = 64
    """Size of one attention head; at least 32 (vLLM on CPU rejects 16)."""
    max_position_embeddings: int = 256
    """Longest sequence (prompt plus response) the model accepts."""
    vocab_size: int | None = None
    """Embedding rows; None uses the tokenizer's size, a larger value pads the vocabulary."""
    rms_norm_eps: float = 1e-6
    """Epsilon of the RMS norms."""
    rope_theta: float = 10000.0
    """Base of the rotary position embedding."""
    initializer_range: float = 0.02
    """Standard deviation of the random initialisation."""
    tie_word_embeddings: bool = False
    """Share the input embedding with the output projection."""
    tokenizer: CharTokenizerConfig = field(default_factory=CharTokenizerConfig)
    """Alphabet of the tokenizer saved beside the model."""

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"TinyModelConfig.architecture must be one of {SUPPORTED_ARCHITECTURES}, "
                f"got {self.architecture!r}"
            )
        for name in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"TinyModelConfig.{name} must be a positive int, got {value!r}")
        self._check_heads()
        tokenizer_size = CharTokenizer(self.tokenizer).vocab_size
        if self.vocab_size is not None and self.vocab_size < tokenizer_size:
            raise ConfigError(
                f"TinyModelConfig.vocab_size={self.vocab_size} is smaller than the tokenizer "
                f"({tokenizer_size} tokens); use None or a value >= {tokenizer_size}"
            )

    def _check_heads(self) -> None:
        if not isinstance(self.head_dim, int) or self.head_dim < MIN_HEAD_DIM:
            raise ConfigError(
                f"TinyModelConfig.head_dim must be >= {MIN_HEAD_DIM} (vLLM on CPU rejects "
                f"smaller heads), got {self.head_dim!r}; 64 is known to work"
            )
        if self.hidden_size != self.num_attention_heads * self.head_dim:
            raise ConfigError(
                f"TinyModelConfig.hidden_size={self.hidden_size} must equal num_attention_heads "
                f"* head_dim = {self.num_attention_heads} * {self.head_dim} (vLLM derives the "
                "head size from them); change hidden_size or num_attention_heads"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"TinyModelConfig.num_key_value_heads={self.num_key_value_heads} must divide "
                f"num_attention_heads={self.num_attention_heads}"
            )

    @property
    def resolved_vocab_size(self) -> int:
        """The embedding size: ``vocab_size`` or the tokenizer's size."""
        if self.vocab_size is not None:
            return self.vocab_size
        return CharTokenizer(self.tokenizer).vocab_size


def tiny_hf_config(config: TinyModelConfig) -> PretrainedConfig:
    """Translate a :class:`TinyModelConfig` into the transformers config it describes.

    Args:
        config: The tiny model's shape.

    Returns:
        A ``LlamaConfig`` or ``Qwen2Config`` with the tokenizer's special-token ids.
    """
    tokenizer = CharTokenizer(config.tokenizer)
    common: dict[str, Any] = dict(
        vocab_size=config.resolved_vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        initializer_range=config.initializer_range,
        tie_word_embeddings=config.tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        dtype="float32",
    )
    if config.architecture == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(**common, use_sliding_window=False)
    from transformers import LlamaConfig

    return LlamaConfig(**common)


def build_tiny_model(config: TinyModelConfig, *, seed: int = 0) -> PreTrainedModel:
    """Initialise a tiny causal LM at random, in float32 and eval mode.

    The global torch RNG is left untouched: the seed applies inside a forked RNG.

    Args:
        config: The model's shape.
        seed: Seed of the random initialisation; equal seeds give equal weights.

    Returns:
        A ``LlamaForCausalLM`` or ``Qwen2ForCausalLM``.
    """
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    hf_config = tiny_hf_config(config)
    model_class = Qwen2ForCausalLM if config.architecture == "qwen2" else LlamaForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(hf_config)
    model.generation_config = _generation_config(hf_config)
    return model.float().eval()


def save_tiny_model(directory: str | Path, config: TinyModelConfig, *, seed: int = 0) -> Path:
    """Build a tiny model and write it as a Hugging Face checkpoint directory.

    Args:
        directory: Target directory (created if needed).
        config: The model's shape and tokenizer alphabet.
        seed: Seed of the random initialisation.

    Returns:
        The directory, holding ``config.json``, ``model.safetensors``,
        ``generation_config.json`` and the tokenizer files.
    """
    path = Path(directory)
    model = build_tiny_model(config, seed=seed)
    # Inside a process group transformers would write only on the default group's
    # rank 0; this function writes what its caller asked for, on any rank.
    save_pretrained_here(model, path)
    model.generation_config.save_pretrained(path)
    CharTokenizer(config.tokenizer).save_pretrained(path)
    return path


@overload
def load_model(
    directory: str | Path, *, kind: Literal["causal_lm"] = "causal_lm", head_seed: int = 0
) -> PreTrainedModel: ...


@overload
def load_model(
    directory: str | Path, *, kind: Literal["value"], head_seed: int = 0
) -> ValueModel: ...


def load_model(
    directory: str | Path,
    *,
    kind: Literal["causal_lm", "value"] = "causal_lm",
    head_seed: int = 0,
) -> PreTrainedModel | ValueModel:
    """Load a local checkpoint of a supported architecture, in float32 and eval mode,
    every tensor in memory of its own that starts on a cache line (as copies of it
    do: see ``_in_aligned_memory``).

    Args:
        directory: A Hugging Face checkpoint directory (nothing is downloaded).
        kind: ``"causal_lm"`` for actor and reference models; ``"value"`` for critic,
            reward and cost models. A value model loads its head from the directory
            when it has one (a value-head file, or the ``score`` of a one-label
            ``...ForSequenceClassification``; see :class:`ValueModel`), else starts a
            fresh head on the causal LM's backbone.
        head_seed: Seed of a fresh value head (ignored when the directory has a head).

    Returns:
        A transformers causal LM, or a :class:`ValueModel`.

    Raises:
        ConfigError: If ``directory`` has no ``config.json``.
        ValueError: If the architecture is not supported, ``kind`` is unknown, or a
            value-model directory is loaded as a causal LM.
    """
    path = Path(directory)
    read_architecture(path)
    is_value = is_value_model_dir(path)
    if kind == "value":
        if is_value:
            return _in_aligned_memory(ValueModel.from_pretrained(path))
        return _in_aligned_memory(ValueModel.from_causal_lm(path, seed=head_seed))
    if kind != "causal_lm":
        raise ConfigError(f"load_model kind must be 'causal_lm' or 'value', got {kind!r}")
    if is_value:
        raise ConfigError(
            f"{path} holds a value model ({VALUE_HEAD_FILE} or a sequence classifier); load "
            "it with kind='value' (as a critic, reward or cost model)"
        )
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    return _in_aligned_memory(model.eval())


_ALIGNMENT = 64
"""Bytes: where torch's CPU allocator starts every tensor (a cache line)."""

_M = TypeVar("_M", bound=torch.nn.Module)


def _in_aligned_memory(model: _M) -> _M:
    """``model`` with every parameter and buffer that does not start on an
    :data:`_ALIGNMENT` boundary copied into fresh memory (in place: the modules and
    parameters stay the same objects).

    transformers loads a safetensors checkpoint's tensors 8 bytes off a cache line,
    where every copy of them starts on one, and MKL's matrix products round
    differently between the two (by about 1e-7 in a decode step's log-probs). Loaded
    this way, the training parameters compute as any copy of them does: a rollout
    engine's, or the weights another pool receives.
    """
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        if tensor.data_ptr() % _ALIGNMENT:  # loaded on the CPU
            tensor.data = tensor.data.clone()
    return model


def _generation_config(hf_config: PretrainedConfig) -> GenerationConfig:
    from transformers import GenerationConfig

    return GenerationConfig(
        bos_token_id=hf_config.bos_token_id,
        eos_token_id=hf_config.eos_token_id,
        pad_token_id=hf_config.pad_token_id,
    )
