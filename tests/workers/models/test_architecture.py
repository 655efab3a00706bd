"""A checkpoint's architecture read from its config.json without transformers
(workers.models.read_architecture): the sizes transformers' own config reads, and
the parameter count of the model it builds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, Qwen2Config

from channels import ConfigError
from workers.models import read_architecture

ROOT = Path(__file__).parents[3]
SMALL = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=6,
             max_position_embeddings=64)

CONFIGS = {
    "llama": LlamaConfig(**SMALL),
    "llama, tied, grouped-query": LlamaConfig(**SMALL, num_key_value_heads=2, tie_word_embeddings=True),
    "llama, own head_dim, biases": LlamaConfig(**SMALL, num_key_value_heads=3, head_dim=16, attention_bias=True,
                                              mlp_bias=True),
    "qwen2": Qwen2Config(**SMALL, num_key_value_heads=2),
    "qwen2, tied": Qwen2Config(**SMALL, num_key_value_heads=6, tie_word_embeddings=True),
}


def _built(path: Path) -> tuple[Any, int]:
    """transformers' config of ``path`` and the parameters of the model it builds."""
    hf = AutoConfig.from_pretrained(path, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    return hf, sum(p.numel() for p in model.parameters())


def _check_against_transformers(path: Path) -> None:
    architecture = read_architecture(path)
    hf, parameters = _built(path)
    assert architecture.parameters == parameters
    assert architecture.model_type == hf.model_type
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings"):
        assert getattr(architecture, key) == getattr(hf, key), key
    assert architecture.head_dim == (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_sizes_and_parameters_are_transformers_own(tmp_path: Path, name: str) -> None:
    CONFIGS[name].save_pretrained(tmp_path)
    _check_against_transformers(tmp_path)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_keys_a_file_lacks_take_the_architectures_defaults(tmp_path: Path, model_type: str) -> None:
    # Qwen2 and Llama default the key/value heads differently (32; the attention heads)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, "num_attention_heads": 8,
                                                      "hidden_size": 256, "num_hidden_layers": 1}))
    _check_against_transformers(tmp_path)
    assert read_architecture(tmp_path).num_key_value_heads == (32 if model_type == "qwen2" else 8)


def test_unusable_directories_are_configuration_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"has no config\.json; pass a local Hugging Face checkpoint directory"):
        read_architecture(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"config.json cannot be read as JSON: Expecting property name"):
        read_architecture(tmp_path)
    sizes = {key: 8 for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                "num_attention_heads", "num_key_value_heads", "max_position_embeddings")}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", **sizes, "tie_word_embeddings": False,
                                                      "hidden_size": "wide"}))
    with pytest.raises(ConfigError, match=r"config.json holds sizes that are not numbers: invalid literal"):
        read_architecture(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ConfigError, match=r"holds a 'gpt2' model; supported architectures .* are \('llama', 'qwen2'\)"):
        read_architecture(tmp_path)


def test_reading_a_complete_config_imports_no_transformers(tmp_path: Path) -> None:
    CONFIGS["qwen2"].save_pretrained(tmp_path)
    probe = ("import sys\nfrom workers.models import read_architecture\n"
             "print(read_architecture(sys.argv[1]).parameters, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                         check=True, timeout=120).stdout.split()
    assert out == [str(_built(tmp_path)[1]), "False"]
