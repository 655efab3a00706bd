"""A run's prompts (``asyncflow.train._prompts.run_prompts``), from the built-in
arithmetic source and from files: what does not fit is named by the keys of the
user's configuration (the response length, the prompt limit, the prompts per
step), before any worker is spawned. No Ray is started here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncflow.train import load_config
from asyncflow.train._config import response_width
from asyncflow.train._prompts import run_prompts
from channels import ConfigError
from support_hf import save_tiny_hf_llama
from workers.models import TinyModelConfig, save_tiny_model

RUN = """
output_dir = "{{out}}"
[model]
path = "{{model}}"
[train]
steps = 1
prompts_per_step = 4
[algorithm]
name = "grpo"
sampling = {{{{ n = 2, max_new_tokens = {new} }}}}
"""

ARITHMETIC = RUN.format(new=3) + """
[data.arithmetic]
digits = 1
train_size = 12
eval_size = 4
"""

FILES = RUN.format(new=4) + """
[data]
train = "{train}"
eval = "{train}"
[reward]
function = "workers.rewards:exact_match"
"""


def _prompts(template: str, tmp_path: Path, model: Path, overrides: dict[str, object], **files: Path) -> object:
    path = tmp_path / "run.toml"
    path.write_text(template.format(out=tmp_path / "out", model=model, **files))
    config = load_config(path, overrides)
    return run_prompts(config, str(model), response_width(config))


@pytest.fixture(scope="module")
def char_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("char"), TinyModelConfig(max_position_embeddings=16), seed=0)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_hf_llama(tmp_path_factory.mktemp("hf"), seed=0, chat_template=False, max_position_embeddings=32)


@pytest.fixture
def train_file(tmp_path: Path) -> Path:
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n"
                            for i in range(6)))
    return path


def test_more_prompts_per_step_than_the_arithmetic_problems(tmp_path: Path, char_model: Path) -> None:
    assert _prompts(ARITHMETIC, tmp_path, char_model, {}).train_size == 12  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match=r"^train.prompts_per_step = 13 is more than the 12 training prompts "
                                          r"\(data.arithmetic.train_size\); lower it or give more prompts$"):
        _prompts(ARITHMETIC, tmp_path, char_model, {"train.prompts_per_step": 13})


def test_more_prompts_per_step_than_the_files_rows(tmp_path: Path, hf_model: Path, train_file: Path) -> None:
    assert _prompts(FILES, tmp_path, hf_model, {}, train=train_file).train_size == 6  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match=rf"^train.prompts_per_step = 7 is more than the 6 training prompts "
                                          rf"\(data.train = '{train_file}'\); lower it or give more prompts$"):
        _prompts(FILES, tmp_path, hf_model, {"train.prompts_per_step": 7}, train=train_file)


def test_responses_too_long_for_the_arithmetic_models_context(tmp_path: Path, char_model: Path) -> None:
    with pytest.raises(ConfigError, match=r"> the model's max_position_embeddings=16; lower "
                                          r"algorithm.sampling.max_new_tokens or data.arithmetic.digits, or start "
                                          r"from a model with a longer context$"):
        _prompts(ARITHMETIC, tmp_path, char_model, {"algorithm.sampling.max_new_tokens": 12})


@pytest.mark.parametrize(("overrides", "said"), [
    ({"algorithm.sampling.max_new_tokens": 32},
     r"^algorithm.sampling.max_new_tokens \(32\) leaves no room for a prompt in the model's context of 32 "
     r"tokens; lower it$"),
    ({"algorithm.sampling.max_new_tokens": 30},
     r"all 6 prompts are longer than 2 tokens \(the shortest has \d+\); lower "
     r"algorithm.sampling.max_new_tokens \(30\) or shorten the prompts$"),
    ({"data.max_prompt_tokens": 30},
     r"^data.max_prompt_tokens \(30\) \+ algorithm.sampling.max_new_tokens \(4\) is more than the model's context "
     r"of 32 tokens; lower one of them$"),
    ({"data.max_prompt_tokens": 2},
     r"all 6 prompts are longer than 2 tokens \(the shortest has \d+\); raise data.max_prompt_tokens or shorten "
     r"the prompts$"),
])
def test_responses_and_prompts_too_long_for_the_files_models_context(
        tmp_path: Path, hf_model: Path, train_file: Path, overrides: dict[str, object], said: str) -> None:
    with pytest.raises(ConfigError, match=said):
        _prompts(FILES, tmp_path, hf_model, overrides, train=train_file)
