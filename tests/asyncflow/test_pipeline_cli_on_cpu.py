"""PPO through ``asyncflow train`` with the actor, the critic and the reference each
split into two pipeline stages (``p = 2``) on real Ray workers: the actor's and the
critic's updates run as one fused schedule over gloo (the critic's pipeline
reversed), the rollout engine gets the stages' weights, and the run checkpoints and
exports the policy as one Hugging Face model; with fusion off the first step's
updates are the same."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncflow.algos._ppo import fusable
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
fuse_updates = {fuse}

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


def _run(tmp_path: Path, model_dir: str, name: str, *, fuse: bool) -> tuple[list[dict], Counter[str]]:
    """The run's metrics, and how many calls of each ``role.method`` its traced first step made."""
    path = config_file(tmp_path, name)
    path.write_text(CONFIG.format(out=tmp_path / name, model=model_dir, fuse=str(fuse).lower()))
    specs = role_specs(load_config(path), model_dir)
    assert {role: specs[role].layout for role in ("actor", "critic", "ref")} == dict.fromkeys(
        ("actor", "critic", "ref"), Layout(p=2, t=1, d=1))
    # Sharing the actor's pipeline ranks, the critic runs its pipeline the other way.
    assert specs["critic"].config.training.pipeline_reversed and not specs["actor"].config.training.pipeline_reversed
    assert fusable(specs["actor"], specs["critic"])  # PPO's step takes the fused call
    assert main(["train", str(path), "--no-progress", "--set", "train.trace_steps=1"]) == 0
    events = json.loads((tmp_path / name / "latest" / "trace.json").read_text())["traceEvents"]
    calls = Counter(e["name"] for e in events if e.get("ph") == "X" and e.get("cat") == "driver")
    return read_metrics(tmp_path / name / "latest" / "metrics.jsonl"), calls


def test_ppo_with_actor_critic_and_reference_in_two_pipeline_stages(tmp_path: Path, capsys) -> None:
    model_dir = str(save_tiny_model(tmp_path / "model", TWO_LAYERS, seed=0))
    apart, apart_calls = _run(tmp_path, model_dir, "apart", fuse=False)
    rows, calls = _run(tmp_path, model_dir, "run", fuse=True)
    # Fused, the first step's updates are one actor.update (the critic's inside it);
    # apart, the critic updates on its own.
    assert (calls["actor.update"], calls["critic.update"]) == (1, 0), calls
    assert (apart_calls["actor.update"], apart_calls["critic.update"]) == (1, 1), apart_calls
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("accuracy: ")
    updates = [r for r in rows if "actor/loss" in r]
    assert [r["step"] for r in updates] == [1, 2]
    assert all(r["actor/steps_skipped"] == 0 and "critic/loss" in r for r in updates)
    # The rollout engine samples with the stages' weights: its log-probs are the
    # actor's (a stage missing from the synced weights would show here).
    assert all(abs(r["actor/logprob_mismatch"]) < 1e-4 for r in updates)
    # The fused updates are the two updates in another order: the first step's match.
    first = next(r for r in apart if "actor/loss" in r)
    for key in ("actor/loss", "actor/grad_norm", "critic/loss", "critic/grad_norm", "critic/values"):
        assert updates[0][key] == pytest.approx(first[key], rel=1e-4, abs=1e-6), key
    assert (tmp_path / "run" / "latest" / "checkpoints" / "step_000002").is_dir()
    policy = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "latest" / "policy")
    start = AutoModelForCausalLM.from_pretrained(model_dir)
    changed = {name for name, t in policy.state_dict().items() if not torch.equal(t, start.state_dict()[name])}
    assert any(".layers.0." in n for n in changed) and any(".layers.1." in n for n in changed)


def _role(pool: str, p: int, *, t: int = 1, chunks: int = 1, reversed_: bool = False) -> SimpleNamespace:
    training = SimpleNamespace(pipeline_chunks=chunks, pipeline_reversed=reversed_)
    return SimpleNamespace(pool=SimpleNamespace(name=pool), layout=Layout(p=p, t=t, d=1),
                           config=SimpleNamespace(training=training))


@pytest.mark.parametrize(("critic", "expected"), [
    (_role("main", 2, reversed_=True), True),
    (_role("main", 2), False),  # the same direction: no bubbles to fill
    (_role("side", 2, reversed_=True), False),  # another pool
    (_role("main", 2, t=2, reversed_=True), False),  # other pipeline ranks
    (_role("main", 2, chunks=2, reversed_=True), False),  # interleaved
])
def test_fused_updates_need_one_pool_one_pipeline_layout_and_opposite_directions(critic: SimpleNamespace,
                                                                                  expected: bool) -> None:
    assert fusable(_role("main", 2), critic) is expected  # type: ignore[arg-type]
    assert not fusable(_role("main", 1), _role("main", 1, reversed_=True))  # type: ignore[arg-type]
