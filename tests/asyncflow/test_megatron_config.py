"""``actor.engine`` / ``critic.engine``: checked when the configuration loads (one line
naming the key), and passed to the roles (the reference follows the actor). No Ray is
started here."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import msgspec
import pytest

from asyncflow.train import load_config
from asyncflow.train._roles import role_specs
from channels import ConfigError
from workers.engines import megatron_available
from workers.models import TinyModelConfig, save_tiny_model

HAVE_MEGATRON = megatron_available() is None
TINY = TinyModelConfig(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=2,
                       head_dim=32, num_hidden_layers=1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_tiny_model(tmp_path_factory.mktemp("model"), TINY, seed=0))


def _write(tmp: Path, model: str, overrides: dict[str, Any]) -> Path:
    """A valid YAML config with ``overrides`` (dotted keys) set."""
    data: dict[str, Any] = {"algorithm": {"name": "grpo"}, "output_dir": str(tmp / "run"), "model": {"path": model},
                            "data": {"arithmetic": {"digits": 1, "train_size": 40, "eval_size": 8}},
                            "pools": {"main": {"devices": 2}}}
    for dotted, value in overrides.items():
        *parents, leaf = dotted.split(".")
        node = data
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = copy.deepcopy(value)
    path = tmp / "run.yaml"
    path.write_bytes(msgspec.yaml.encode(data))
    return path


def test_an_unknown_engine_names_the_key(tmp_path: Path, model_dir: str) -> None:
    with pytest.raises(ConfigError, match=re.escape("$.actor.engine")):
        load_config(_write(tmp_path, model_dir, {"actor.engine": "deepspeed"}))


def test_megatron_with_a_generation_layout_is_refused(tmp_path: Path, model_dir: str) -> None:
    config = {"actor.engine": "megatron", "placement.actor": {"pool": "main", "t": 2, "gen": {"t": 1}}}
    with pytest.raises(ConfigError, match=re.escape('placement.actor.gen needs actor.engine = "native" '
                                                    "(got 'megatron')")):
        load_config(_write(tmp_path, model_dir, config))


@pytest.mark.skipif(HAVE_MEGATRON, reason="checks the message shown without megatron-core")
@pytest.mark.parametrize(("overrides", "key"), [
    ({"actor.engine": "megatron"}, "actor.engine"),
    ({"algorithm": {"name": "ppo"}, "critic.engine": "megatron"}, "critic.engine"),
])
def test_megatron_without_megatron_core_fails_on_load_naming_the_key(
        tmp_path: Path, model_dir: str, overrides: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(_write(tmp_path, model_dir, overrides))
    message = str(caught.value)  # "<file>: <key> = ...": the loader names the file first
    assert "\n" not in message
    assert f': {key} = "megatron": megatron-core is not installed: pip install' in message
    assert message.endswith(f'or set {key} = "native"')


def test_a_critic_engine_without_a_critic_is_not_checked(tmp_path: Path, model_dir: str) -> None:
    config = load_config(_write(tmp_path, model_dir, {"critic.engine": "megatron"}))  # GRPO places no critic
    assert config.critic.engine == "megatron"


def test_roles_get_their_sections_engine_and_the_reference_the_actors(tmp_path: Path, model_dir: str) -> None:
    config = load_config(_write(tmp_path, model_dir, {"algorithm": {"name": "ppo"}}))
    assert config.actor.engine == config.critic.engine == "native"
    # Set after loading: without megatron-core here the loader would refuse it.
    config = msgspec.structs.replace(config, actor=msgspec.structs.replace(config.actor, engine="megatron"))
    specs = role_specs(config, model_dir)
    assert specs["actor"].config.engine == specs["ref"].config.engine == "megatron"
    assert specs["critic"].config.engine == "native"
