"""Model-based rewards and the reward/cost roles, in-process (no Ray)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from channels import Batch, ConfigError, Layout
from workers import WorkerContext
from workers.models import TinyModelConfig, ValueModel, save_tiny_model
from workers.rewards import (
    ModelRewardConfig,
    RewardFunctionError,
    RuleRewardConfig,
    RuleScorer,
    ScoreInputs,
)
from workers.roles import COSTS, SCORES, CostWorker, RewardWorker, ScoreConfig

torch.set_num_threads(1)
TINY = TinyModelConfig(hidden_size=64, intermediate_size=128, num_attention_heads=1,
                       num_key_value_heads=1, head_dim=64)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_tiny_model(tmp_path_factory.mktemp("rm"), TINY, seed=4))


def _ctx(role: str) -> WorkerContext:
    return WorkerContext(role=role, pool="p", rank=0, world_size=1, global_rank=0, layout=Layout(),
                         device=torch.device("cpu"), process_group=None, mesh=None)


def _inputs() -> ScoreInputs:
    gen = torch.Generator().manual_seed(0)
    prompt_len = torch.tensor([3, 5, 1, 4])
    response_len = torch.tensor([4, 0, 6, 2])  # one empty response
    prompt_mask = (torch.arange(5)[None] >= 5 - prompt_len[:, None]).long()
    response_mask = (torch.arange(6)[None] < response_len[:, None]).long()
    return ScoreInputs(
        prompt_ids=torch.randint(4, 19, (4, 5), generator=gen) * prompt_mask,
        prompt_mask=prompt_mask,
        response_ids=torch.randint(4, 19, (4, 6), generator=gen) * response_mask,
        response_mask=response_mask,
    )


def test_model_score_is_the_value_at_the_last_response_token(model_dir: str) -> None:
    scorer = ModelRewardConfig(model_dir=model_dir, head_seed=2).build(torch.device("cpu"))
    inputs = _inputs()
    scores = scorer(inputs)
    assert scores.shape == (4,) and scores.dtype == torch.float32
    model = ValueModel.from_causal_lm(model_dir, seed=2)
    for i in range(4):  # one unpadded sequence at a time
        ids = torch.cat([inputs.prompt_ids[i][inputs.prompt_mask[i].bool()],
                         inputs.response_ids[i][inputs.response_mask[i].bool()]])
        with torch.no_grad():
            expected = model(ids[None])[0, -1]
        assert scores[i] == pytest.approx(float(expected), abs=1e-5), i
    one_by_one = ModelRewardConfig(model_dir=model_dir, head_seed=2, micro_batch_size=1).build(
        torch.device("cpu"))(inputs)
    torch.testing.assert_close(one_by_one, scores, atol=1e-5, rtol=0)


def test_a_bf16_reward_model_stores_bf16_weights_and_scores_close_to_fp32(model_dir: str) -> None:
    fp32 = ModelRewardConfig(model_dir=model_dir, head_seed=2, precision="fp32").build(torch.device("cpu"))
    bf16 = ModelRewardConfig(model_dir=model_dir, head_seed=2, precision="bf16").build(torch.device("cpu"))
    assert {p.dtype for p in bf16.model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in fp32.model.parameters()} == {torch.float32}
    expected, got = fp32(_inputs()), bf16(_inputs())
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=0.05 * float(expected.abs().max()), rtol=0)
    # "auto" is fp32 on the CPU; an unknown precision names the field.
    auto = ModelRewardConfig(model_dir=model_dir, head_seed=2).build(torch.device("cpu"))
    assert {p.dtype for p in auto.model.parameters()} == {torch.float32}
    with pytest.raises(ConfigError, match=r"ModelRewardConfig\.precision"):
        ModelRewardConfig(model_dir=model_dir, precision="fp8")  # type: ignore[arg-type]


def test_reward_and_cost_roles_write_their_fields(model_dir: str, tmp_path: Path) -> None:
    batch = Batch({"prompt_ids": _inputs().prompt_ids, "prompt_mask": _inputs().prompt_mask,
                   "response_ids": _inputs().response_ids, "response_mask": _inputs().response_mask})
    reward = RewardWorker(_ctx("rm"), ScoreConfig(scorer=ModelRewardConfig(model_dir=model_dir)))
    cost = CostWorker(_ctx("cost"), ScoreConfig(scorer=ModelRewardConfig(model_dir=model_dir,
                                                                          head_seed=9)))
    scores, costs = reward.score(batch)[SCORES], cost.score(batch)[COSTS]
    assert scores.shape == costs.shape == (4,)
    assert not torch.allclose(scores, costs)  # different heads


def test_rule_reward_role_names_the_uid_of_the_failing_sample(model_dir: str) -> None:
    role = RewardWorker(_ctx("reward"), ScoreConfig(scorer=RuleRewardConfig(
        fn="workers.rewards:arithmetic_reward", tokenizer_dir=model_dir)))
    x = _inputs()
    batch = Batch({"prompt_ids": x.prompt_ids, "prompt_mask": x.prompt_mask,
                   "response_ids": x.response_ids, "response_mask": x.response_mask,
                   "answer_ids": torch.zeros(4, 3, dtype=torch.int64), "uid": torch.arange(20, 24)})
    assert role.score(batch)[SCORES].shape == (4,)
    scorer = role.scorer
    assert isinstance(scorer, RuleScorer)

    def by_length(prompts: list[str], responses: list[str], answers: list[str]) -> list[float]:
        return [1.0 / len(response) for response in responses]  # sample 1's response is empty

    scorer.fn = by_length
    with pytest.raises(RewardFunctionError) as raised:
        role.score(batch)
    message = str(raised.value)
    assert "by_length raised on sample 1 of the 4 on this rank (uid 21): ZeroDivisionError" in message
    assert "response=''" in message
    scorer.fn = lambda p, r, a: [1.0, 2.0]  # wrong count
    with pytest.raises(RewardFunctionError, match="returned 2 scores for 4 samples"):
        role.score(batch)


def test_score_config_checks_its_scorer() -> None:
    with pytest.raises(ConfigError, match=r"ScoreConfig\.scorer"):
        ScoreConfig(scorer="workers.rewards:arithmetic_reward")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="micro_batch_size"):
        ModelRewardConfig(model_dir="x", micro_batch_size=0)
