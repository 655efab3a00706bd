"""Tiny model factory: config validation, seeded build, save/load round trips."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from channels import ConfigError
from workers.models import (
    CharTokenizer,
    TinyModelConfig,
    build_tiny_model,
    load_model,
    save_tiny_model,
)

torch.set_num_threads(1)

INPUT = torch.tensor([[1, 5, 6, 17, 13, 17, 7, 16], [1, 8, 8, 14, 9, 16, 4, 4]])
CLASSES = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM}


def _logits(model: PreTrainedModel) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=INPUT).logits


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_save_then_load_gives_identical_logits(tmp_path: Path, architecture: str) -> None:
    config = TinyModelConfig(architecture=architecture)  # type: ignore[arg-type]
    directory = save_tiny_model(tmp_path / "model", config, seed=7)
    names = {p.name for p in directory.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= names
    loaded = load_model(directory)
    assert type(loaded) is CLASSES[architecture]
    assert loaded.dtype == torch.float32
    assert loaded.config.head_dim == 64
    assert loaded.config.vocab_size == CharTokenizer().vocab_size
    assert loaded.config.tie_word_embeddings is False
    assert loaded.generation_config.eos_token_id == CharTokenizer().eos_token_id
    assert torch.equal(_logits(loaded), _logits(build_tiny_model(config, seed=7)))


@pytest.mark.parametrize("kind", ["causal_lm", "value"])
def test_a_loaded_model_starts_every_tensor_on_a_cache_line(tmp_path: Path, kind: str) -> None:
    """As fresh tensors do (safetensors' own views sit 8 bytes off one, and MKL's
    products round differently there); the modules keep their parameter objects."""
    directory = save_tiny_model(tmp_path / "model", TinyModelConfig(), seed=7)
    loaded = load_model(directory, kind=kind)  # type: ignore[call-overload]
    tensors = [*loaded.parameters(), *loaded.buffers()]
    assert tensors and all(t.data_ptr() % 64 == 0 for t in tensors)
    assert all(isinstance(p, torch.nn.Parameter) for p in loaded.parameters())


def test_seed_decides_the_weights_and_leaves_global_rng_alone() -> None:
    state = torch.random.get_rng_state()
    first = build_tiny_model(TinyModelConfig(), seed=1)
    assert torch.equal(state, torch.random.get_rng_state())
    again = build_tiny_model(TinyModelConfig(), seed=1)
    other = build_tiny_model(TinyModelConfig(), seed=2)
    assert torch.equal(_logits(first), _logits(again))
    assert not torch.allclose(_logits(first), _logits(other))


def test_vocab_size_can_pad_the_tokenizer() -> None:
    model = build_tiny_model(TinyModelConfig(vocab_size=32, num_hidden_layers=1))
    assert model.get_input_embeddings().num_embeddings == 32
    assert model.get_output_embeddings().out_features == 32


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_plain_transformers_checkpoint_loads(tmp_path: Path, architecture: str) -> None:
    shape = dict(
        vocab_size=24,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    if architecture == "llama":
        original: PreTrainedModel = LlamaForCausalLM(LlamaConfig(**shape))
    else:
        original = Qwen2ForCausalLM(Qwen2Config(**shape))
    original.eval().save_pretrained(tmp_path)
    loaded = load_model(tmp_path)
    assert type(loaded) is CLASSES[architecture]
    assert torch.equal(_logits(loaded), _logits(original))


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    config = GPT2Config(vocab_size=20, n_positions=16, n_embd=32, n_layer=1, n_head=2)
    GPT2LMHeadModel(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="'gpt2'"):
        load_model(tmp_path)


def test_missing_directory_and_bad_kind(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"config\.json"):
        load_model(tmp_path)
    directory = save_tiny_model(tmp_path / "m", TinyModelConfig(num_hidden_layers=1))
    with pytest.raises(ValueError, match="kind"):
        load_model(directory, kind="reward")  # type: ignore[call-overload]


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"head_dim": 16, "hidden_size": 32}, "head_dim must be >= 32"),
        ({"hidden_size": 96}, "hidden_size=96 must equal"),
        ({"num_key_value_heads": 3, "num_attention_heads": 2}, "num_key_value_heads=3"),
        ({"vocab_size": 5}, "vocab_size=5"),
        ({"architecture": "gpt2"}, "architecture"),
        ({"num_hidden_layers": 0}, "num_hidden_layers"),
    ],
)
def test_config_errors_name_the_field(fields: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TinyModelConfig(**fields)  # type: ignore[arg-type]
