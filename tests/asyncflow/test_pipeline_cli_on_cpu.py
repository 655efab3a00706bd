"""PPO through ``asyncflow train`` with the actor, the critic and the reference each
split into two pipeline stages (``p = 2``) on real Ray workers: the update runs the
1F1B schedule over gloo, the rollout engine gets the stages' weights, and the run
checkpoints and exports the policy as one Hugging Face model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncflow.cli import main
from asyncflow.train import load_config, read_metrics
from asyncflow.train._roles import role_specs
from channels import Layout
from support import config_file
from workers.models import TinyModelConfig, save_tiny_model

TWO_LAYERS = TinyModelConfig(hidden_size=64, intermediate_size=128, num_attention_heads=2,
                             num_key_value_heads=2, head_dim=32, num_hidden_layers=2)

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
name = "ppo"
sampling = {{ n = 2, temperature = 1.0, max_new_tokens = 3 }}
policy = {{ kl_coef = 0.05 }}

[actor]
lr = 1e-3
micro_batch_size = 4

[critic]
lr = 1e-3
micro_batch_size = 4

[pools]
main = {{ devices = 2 }}

[placement]
actor = {{ pool = "main", p = 2 }}
critic = {{ pool = "main", p = 2 }}
ref = {{ pool = "main", p = 2 }}
reward = {{ pool = "main" }}
"""

pytestmark = pytest.mark.usefixtures("shared_ray")


@pytest.fixture(autouse=True)
def _restore_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "HF_HUB_DISABLE_PROGRESS_BARS"):
        monkeypatch.delenv(name, raising=False)


def test_ppo_with_actor_critic_and_reference_in_two_pipeline_stages(tmp_path: Path, capsys) -> None:
    model_dir = str(save_tiny_model(tmp_path / "model", TWO_LAYERS, seed=0))
    path = config_file(tmp_path, "run")
    path.write_text(CONFIG.format(out=tmp_path / "run", model=model_dir))
    specs = role_specs(load_config(path), model_dir)
    assert {role: specs[role].layout for role in ("actor", "critic", "ref")} == dict.fromkeys(
        ("actor", "critic", "ref"), Layout(p=2, t=1, d=1))
    assert main(["train", str(path), "--no-progress"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("accuracy: ")
    rows = read_metrics(tmp_path / "run" / "latest" / "metrics.jsonl")
    updates = [r for r in rows if "actor/loss" in r]
    assert [r["step"] for r in updates] == [1, 2]
    assert all(r["actor/steps_skipped"] == 0 and "critic/loss" in r for r in updates)
    # The rollout engine samples with the stages' weights: its log-probs are the
    # actor's (a stage missing from the synced weights would show here).
    assert all(abs(r["actor/logprob_mismatch"]) < 1e-4 for r in updates)
    assert (tmp_path / "run" / "latest" / "checkpoints" / "step_000002").is_dir()
    policy = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "latest" / "policy")
    start = AutoModelForCausalLM.from_pretrained(model_dir)
    changed = {name for name, t in policy.state_dict().items() if not torch.equal(t, start.state_dict()[name])}
    assert any(".layers.0." in n for n in changed) and any(".layers.1." in n for n in changed)
