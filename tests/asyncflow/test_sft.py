"""SFT warm start on the arithmetic source: the loss falls, the warm start saves a loadable model, errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncflow.train._sft import SFTConfig, evaluate_greedy, sft_warm_start
from channels import ConfigError
from workers.data import ArithmeticTaskConfig, generate_splits, sft_batch
from workers.engines import TrainingConfig, TrainingEngine
from workers.models import CharTokenizer, TinyModelConfig, build_tiny_model, load_model
from workers.objectives import NLLLoss
from workers.rollout import NativeRolloutConfig, NativeRolloutEngine

torch.set_num_threads(1)

MODEL = TinyModelConfig(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=16,
)
TASK = ArithmeticTaskConfig(train_size=256, eval_size=64)


def test_a_few_sft_steps_reduce_the_loss() -> None:
    tokenizer = CharTokenizer()
    batch = sft_batch(generate_splits(TASK).train[:64], tokenizer)
    engine = TrainingEngine(
        build_tiny_model(MODEL, seed=0), config=TrainingConfig(lr=3e-3), loss=NLLLoss()
    )
    losses = [engine.train_step(batch)["loss"] for _ in range(8)]
    assert losses[-1] < 0.7 * losses[0]


def test_sft_warm_start_saves_a_model_the_loaders_and_rollout_accept(tmp_path: Path) -> None:
    config = SFTConfig(
        model=MODEL, steps=6, batch_size=16, warmup_steps=2, stop_at_train_accuracy=None
    )
    metrics = sft_warm_start(tmp_path / "sft", config, TASK)
    assert metrics["steps"] == 6.0 and metrics["train_accuracy"] == -1.0
    assert metrics["loss"] > 0 and metrics["num_parameters"] > 0
    assert 0.0 <= metrics["eval_accuracy"] <= 1.0
    model = load_model(tmp_path / "sft")
    tokenizer = CharTokenizer.from_pretrained(tmp_path / "sft")
    assert tokenizer.vocab_size == CharTokenizer().vocab_size
    engine = NativeRolloutEngine(model, config=NativeRolloutConfig(max_batch_size=64))
    result = evaluate_greedy(engine, generate_splits(TASK).eval, tokenizer, max_new_tokens=4)
    assert result["accuracy"] == pytest.approx(metrics["eval_accuracy"])
    assert result["num_problems"] == 64.0


def test_sft_stops_at_max_seconds_and_can_skip_evaluation(tmp_path: Path) -> None:
    config = SFTConfig(
        model=MODEL, steps=50, batch_size=8, max_seconds=1e-6, evaluate=False
    )
    metrics = sft_warm_start(tmp_path / "sft", config, TASK)
    assert metrics["steps"] == 1.0 and "eval_accuracy" not in metrics


def test_a_prompt_longer_than_the_context_is_a_config_error(tmp_path: Path) -> None:
    short = TinyModelConfig(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=8,
    )
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        sft_warm_start(tmp_path / "sft", SFTConfig(model=short, steps=1), TASK)
    assert not (tmp_path / "sft").exists()


def test_a_warm_start_that_diverges_saves_nothing(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"SFTConfig\.lr must be a finite number > 0, got inf"):
        SFTConfig(lr=float("inf"))
    with pytest.raises(ConfigError, match=r"the SFT warm start diverged: loss nan at step \d+ .*lower sft\.lr \(1e\+30\)"):
        sft_warm_start(tmp_path / "sft", SFTConfig(model=MODEL, lr=1e30, steps=20, warmup_steps=0,
                                                   stop_at_train_accuracy=None), TASK)
    assert not (tmp_path / "sft").exists()  # no NaN model for a later run to take up


def test_empty_data_and_bad_settings_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="train_size"):
        ArithmeticTaskConfig(train_size=0)
    with pytest.raises(ConfigError, match=r"SFTConfig\.steps"):
        SFTConfig(steps=0)
    with pytest.raises(ConfigError, match="stop_at_train_accuracy"):
        SFTConfig(stop_at_train_accuracy=1.5)
    engine = NativeRolloutEngine(build_tiny_model(MODEL), config=NativeRolloutConfig())
    with pytest.raises(ConfigError, match="no problems"):
        evaluate_greedy(engine, [], CharTokenizer(), max_new_tokens=4)


def test_the_warm_start_trains_where_its_device_setting_says() -> None:
    assert SFTConfig(device="cpu").torch_device() == torch.device("cpu")
    assert SFTConfig().torch_device().type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ConfigError, match=r"SFTConfig\.device"):
        SFTConfig(device="tpu")  # type: ignore[arg-type]
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA GPU"):
            SFTConfig(device="cuda").torch_device()
