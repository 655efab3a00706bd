"""The GRPO main-job recipe with the actor trained at t = 2 and generating at
t = 1 (the hybrid engine) runs end to end through ``asyncflow train`` on real Ray
workers; generation layouts that cannot work are refused at config time, naming the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncflow.cli import main
from asyncflow.train import load_config, read_metrics
from asyncflow.train._roles import role_specs
from channels import GenerationLayout, Layout
from support import config_file
from workers.models import TinyModelConfig, save_tiny_model

TWO_HEADS = TinyModelConfig(hidden_size=64, intermediate_size=128, num_attention_heads=2,
                            num_key_value_heads=2, head_dim=32, num_hidden_layers=1)

CONFIG = """
output_dir = "{out}"
seed = 3

[model]
path = "{model}"

[data.arithmetic]
digits = 1
train_size = 40
eval_size = 8

[train]
steps = 2
prompts_per_step = 4
checkpoint_every = 2
eval_size = 8

[algorithm]
name = "grpo"
sampling = {{ n = 2, temperature = 1.0, max_new_tokens = 3 }}

[actor]
lr = 1e-3
micro_batch_size = 8

[pools]
main = {{ devices = 2 }}

[placement]
actor = {{ pool = "main", t = 2, gen = {gen} }}
reward = {{ pool = "main" }}
"""


pytestmark = pytest.mark.usefixtures("shared_ray")  # one Ray instance for the module's runs


@pytest.fixture(autouse=True)
def _restore_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "HF_HUB_DISABLE_PROGRESS_BARS"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_tiny_model(tmp_path_factory.mktemp("model"), TWO_HEADS, seed=0))


def _config(tmp: Path, model: str, gen: str) -> Path:
    path = config_file(tmp, "run")
    path.write_text(CONFIG.format(out=tmp / "run", model=model, gen=gen))
    return path


def test_grpo_with_actor_trained_at_t2_generating_at_t1(tmp_path: Path, model_dir: str, capsys) -> None:
    specs = role_specs(load_config(_config(tmp_path, model_dir, "{ t = 1 }")), model_dir)
    assert specs["actor"].layout == Layout(t=2, d=1, gen=GenerationLayout(tg=1))
    assert specs["actor"].config.training.data_parallel == "replicate"
    assert main(["train", str(_config(tmp_path, model_dir, "{ t = 1 }")), "--no-progress"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("accuracy: ")
    rows = read_metrics(tmp_path / "run" / "latest" / "metrics.jsonl")
    assert [r["step"] for r in rows if "actor/loss" in r] == [1, 2]
    assert all(r["actor/steps_skipped"] == 0 for r in rows if "actor/loss" in r)
    state = json.loads((tmp_path / "run" / "latest" / "checkpoints" / "step_000002" / "state.json").read_text())
    assert state["step"] == 2


@pytest.mark.parametrize(("gen", "args", "message"), [
    ("{ t = 3 }", [], "placement.actor.gen.t = 3 must divide the actor's training t = 2"),
    ("{ t = 1, p = 2 }", [], "placement.actor.gen.p = 2: pipeline parallelism is not supported"),
    ("{ t = 1 }", ["--set", "actor.rollout_engine=vllm"], 'placement.actor.gen needs actor.rollout_engine = "native"'),
])
def test_impossible_generation_layouts_are_refused(tmp_path: Path, model_dir: str, capsys, gen: str,
                                                   args: list[str], message: str) -> None:
    assert main(["train", str(_config(tmp_path, model_dir, gen)), *args]) == 2
    assert message in capsys.readouterr().err
