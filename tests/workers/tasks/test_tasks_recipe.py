"""The tuned recipe: its settings, their engine objects, and one GRPO step wired as documented."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch

from channels import ConfigError
from workers.engines import LossAggregation, TrainingEngine, grpo_advantages
from workers.models import CharTokenizer, TinyModelConfig, load_model
from workers.rollout import NativeRolloutConfig, NativeRolloutEngine
from workers.tasks import (
    ARITHMETIC_RECIPE,
    ArithmeticRecipe,
    ArithmeticTaskConfig,
    GRPORecipe,
    SFTConfig,
    decode_responses,
    exact_match_reward,
    generate_splits,
    prompt_batch,
    sft_warm_start,
)

torch.set_num_threads(1)


def test_recipe_settings_and_engine_objects() -> None:
    grpo = ARITHMETIC_RECIPE.grpo
    assert grpo.rollout_batch_size == grpo.prompts_per_step * grpo.samples_per_prompt
    training = grpo.training_config()
    assert (training.lr, training.warmup_steps) == (grpo.lr, grpo.warmup_steps)
    assert training.loss_aggregation is LossAggregation.TOKEN_MEAN
    loss = grpo.policy_loss()
    assert loss.required_fields == ("old_logprobs", "advantages")  # no KL: no reference
    params = grpo.sampling_params(ARITHMETIC_RECIPE.task, CharTokenizer(), seed=5)
    assert params.max_new_tokens == 4  # "198" + <eos>
    assert (params.temperature, params.seed) == (grpo.temperature, 5)
    assert params.eos_token_id == CharTokenizer().eos_token_id
    assert ARITHMETIC_RECIPE.sft.model.head_dim >= 32


def test_with_seed_reseeds_every_phase_and_the_recipe_round_trips() -> None:
    recipe = ARITHMETIC_RECIPE.with_seed(7)
    assert (recipe.task.seed, recipe.sft.seed, recipe.grpo.seed) == (7, 7, 7)
    encoded = msgspec.json.encode(recipe)
    assert msgspec.json.decode(encoded, type=ArithmeticRecipe) == recipe
    with pytest.raises(msgspec.ValidationError, match="prompts_per_stp"):
        msgspec.json.decode(b'{"grpo": {"prompts_per_stp": 3}}', type=ArithmeticRecipe)


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"steps": 0}, "steps"),
        ({"samples_per_prompt": 0}, "samples_per_prompt"),
        ({"temperature": 0.0}, "temperature"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
    ],
)
def test_invalid_grpo_settings_are_config_errors(settings: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        GRPORecipe(**settings)  # type: ignore[arg-type]


def test_one_grpo_step_with_the_recipe_objects(tmp_path: Path) -> None:
    model = TinyModelConfig(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=16,
    )
    task = ArithmeticTaskConfig(train_size=64, eval_size=16)
    sft = SFTConfig(task=task, model=model, steps=3, batch_size=8, evaluate=False)
    sft_warm_start(tmp_path, sft)
    grpo = GRPORecipe(prompts_per_step=4, samples_per_prompt=4, lr=1e-3, warmup_steps=0)
    tokenizer = CharTokenizer.from_pretrained(tmp_path)
    engine = TrainingEngine(
        load_model(tmp_path), config=grpo.training_config(), loss=grpo.policy_loss()
    )
    rollout = NativeRolloutEngine(load_model(tmp_path), config=NativeRolloutConfig())
    problems = generate_splits(task).train[:4]
    prompts = prompt_batch(problems, tokenizer, first_uid=100)
    n = grpo.samples_per_prompt
    out = rollout.generate(
        [tokenizer.encode(p.prompt) for p in problems for _ in range(n)],
        grpo.sampling_params(task, tokenizer, seed=0),
    )
    responses = decode_responses(out.response_ids, out.response_mask, tokenizer)
    scores = exact_match_reward(
        [p.prompt for p in problems for _ in range(n)],
        responses,
        [p.answer for p in problems for _ in range(n)],
    )
    uid = prompts["uid"].repeat_interleave(n)
    # Give one group a success so that the step has a gradient whatever the sampling.
    scores[0], scores[1] = 1.0, 0.0
    advantages = grpo_advantages(torch.tensor(scores), uid)
    before = {k: v.clone() for k, v in rollout.model.state_dict().items()}
    metrics = engine.train_step(
        {
            "prompt_ids": out.prompt_ids,
            "prompt_mask": out.prompt_mask,
            "response_ids": out.response_ids,
            "response_mask": out.response_mask,
            "old_logprobs": out.logprobs,
            "advantages": advantages,
        }
    )
    assert metrics["step_skipped"] == 0.0 and metrics["grad_norm"] > 0
    assert rollout.update_weights(engine.named_full_weights()) == len(before)
    changed = [k for k, v in rollout.model.state_dict().items() if not torch.equal(v, before[k])]
    assert changed
