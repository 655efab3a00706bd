"""``[reward]`` with several weighted functions: loaded, checked on load, and turned
into the reward role's scorer."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncflow.train import load_config
from asyncflow.train._roles import _scorer
from channels import ConfigError
from workers.models import TinyModelConfig, save_tiny_model
from workers.rewards import RuleRewardConfig

TINY = TinyModelConfig(hidden_size=64, intermediate_size=128, num_attention_heads=1, num_key_value_heads=1,
                       head_dim=64)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_tiny_model(tmp_path_factory.mktemp("model"), TINY, seed=0))


def _config(tmp: Path, model: str, reward: str) -> Path:
    path = tmp / "run.toml"
    path.write_text(f'output_dir = "{tmp / "run"}"\n[model]\npath = "{model}"\n'
                    f'[data.arithmetic]\ndigits = 1\ntrain_size = 40\neval_size = 8\n[reward]\n{reward}\n')
    return path


def test_weighted_functions_load_and_become_the_scorer(tmp_path: Path, model_dir: str) -> None:
    config = load_config(_config(tmp_path, model_dir, 'functions = [\n'
                                 '  { function = "workers.rewards:numeric_match", weight = 1 },\n'
                                 '  { function = "workers.rewards:format_check", weight = 0.2 },\n]'))
    scorer = _scorer(config.reward, model_dir).scorer
    assert isinstance(scorer, RuleRewardConfig)
    assert scorer.fn == ("workers.rewards:numeric_match", "workers.rewards:format_check")
    assert scorer.weights == (1.0, 0.2) and scorer.labels == ("numeric_match", "format_check")


def test_a_single_function_keeps_working(tmp_path: Path, model_dir: str) -> None:
    config = load_config(_config(tmp_path, model_dir, 'function = "workers.rewards:exact_match"'))
    scorer = _scorer(config.reward, model_dir).scorer
    assert isinstance(scorer, RuleRewardConfig)
    assert scorer.fn == "workers.rewards:exact_match" and scorer.weights is None


@pytest.mark.parametrize("reward, named", [
    ('functions = [{ function = "workers.rewards:exact_match" }, { function = "no_such_mod_af:f" }]',
     "reward.functions[1].function = 'no_such_mod_af:f': cannot import module"),
    ('functions = [{ function = "workers.rewards:nope", weight = 1.0 }]', "has no attribute 'nope'"),
    ('functions = [{ function = "no_colon" }]', "reward.functions[0].function must be a 'module:function'"),
    ('functions = [{ function = "workers.rewards:exact_match", weight = nan }]',
     "reward.functions[0].weight must be a finite number"),
    ('functions = [{ function = "workers.rewards:exact_match", wieght = 1.0 }]', "wieght"),
    ('function = "workers.rewards:exact_match"\nfunctions = [{ function = "workers.rewards:format_check" }]',
     "both function"),
])
def test_bad_weighted_functions_name_the_key(tmp_path: Path, model_dir: str, reward: str, named: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(_config(tmp_path, model_dir, reward))
    assert named in str(info.value) and "\n" not in str(info.value)
