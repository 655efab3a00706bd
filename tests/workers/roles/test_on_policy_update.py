"""``actor.update`` without ``old_logprobs`` (on-policy: no ``log_prob`` call) makes
the same update as with them: same loss and metrics, same parameters after; over two
replicated data-parallel ranks it takes one all-reduce."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from roles_testlib import TINY, advantages_for, local_ctx, prompt_columns, run_ranks

from channels import Batch, Layout
from workers import WorkerContext
from workers.engines import MESH_DIM_NAMES, TrainingConfig
from workers.host._meshes import mesh_from_groups, new_reconnectable_group
from workers.models import save_tiny_model
from workers.objectives import PolicyLoss
from workers.roles import ActorConfig, ActorWorker, UpdateConfig
from workers.rollout import SamplingParams

torch.set_num_threads(1)

LOSS = PolicyLoss(kl_coef=0.1, entropy_coef=0.01, clip_ratio_low=0.1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_tiny_model(tmp_path_factory.mktemp("policy"), TINY, seed=0))


def _actor(model_dir: str, micro_batch_size: int, ctx: WorkerContext | None = None) -> ActorWorker:
    training = TrainingConfig(lr=1e-2, micro_batch_size=micro_batch_size)
    config = ActorConfig(model_dir=model_dir, training=training,
                         sampling=SamplingParams(max_new_tokens=6, temperature=1.0))
    return ActorWorker(ctx or local_ctx("actor"), config)


def _rows(actor: ActorWorker) -> dict[str, torch.Tensor]:
    """The actor's samples with advantages, and a reference a little off the policy
    (so that the KL term and its metric are not 0)."""
    rollout = actor.generate(Batch(prompt_columns()), n=3)
    old = actor.log_prob(Batch(rollout))["old_logprobs"]
    ref = old + 0.05 * torch.randn(old.shape, generator=torch.Generator().manual_seed(1)) * rollout["response_mask"]
    return {**rollout, "advantages": advantages_for(rollout), "ref_logprobs": ref}


@pytest.mark.parametrize(("micro_batch_size", "schedule"), [
    (64, UpdateConfig()),                                    # one step, one micro-batch
    # One step accumulated over micro-batches; unshuffled, so that log_prob's pass
    # pads its micro-batches alike (else old_logprobs move by float rounding).
    (3, UpdateConfig(shuffle=False)),
    (4, UpdateConfig(epochs=2, mini_batches=2)),             # several steps: a no-grad pass first
])
def test_update_without_old_logprobs_equals_the_update_with_log_prob(model_dir: str, micro_batch_size: int,
                                                                     schedule: UpdateConfig) -> None:
    with_pass, without = _actor(model_dir, micro_batch_size), _actor(model_dir, micro_batch_size)
    rows = _rows(with_pass)
    loss = LOSS
    for update in range(2):  # the second starts from weights the first changed
        got_with = with_pass.update(Batch({**rows, "old_logprobs": with_pass.log_prob(Batch(rows))["old_logprobs"]}),
                                    loss=loss, schedule=schedule)
        got_without = without.update(Batch(rows), loss=loss, schedule=schedule)
        assert got_with.keys() == got_without.keys()
        for key, value in got_with.items():
            # The mismatch is float noise (1e-7) on the current policy's samples.
            noise = 1e-6 if key.startswith("actor/logprob_mismatch") else 1e-7
            assert got_without[key] == pytest.approx(value, rel=1e-5, abs=noise), key
        assert got_without["actor/kl_to_ref"] > 0
        if update == 0:  # the rows are the current policy's samples
            assert got_without["actor/logprob_mismatch"] < 1e-5
        for (name, a), (_, b) in zip(with_pass.engine.model.named_parameters(),
                                     without.engine.model.named_parameters(), strict=True):
            assert torch.equal(a, b), name
    # The rollout engine got the new weights too: the same greedy samples.
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    assert torch.equal(with_pass.generate(Batch(prompt_columns()), params=greedy)["response_ids"],
                       without.generate(Batch(prompt_columns()), params=greedy)["response_ids"])


@contextlib.contextmanager
def _all_reduces() -> Iterator[list[object]]:
    calls: list[object] = []
    real = dist.all_reduce

    def counting(*args: object, **kwargs: object) -> object:
        calls.append(args)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    dist.all_reduce = counting  # type: ignore[assignment]
    try:
        yield calls
    finally:
        dist.all_reduce = real


def _replica_rank(rank: int, out: Path, *, model_dir: str, rows_path: str) -> None:
    timeout = timedelta(seconds=60)
    ctx = WorkerContext(role="actor", pool="policy", rank=rank, world_size=2, global_rank=rank, layout=Layout(d=2),
                        device=torch.device("cpu"), process_group=new_reconnectable_group((0, 1), timeout),
                        mesh=mesh_from_groups(torch.tensor([0, 1]).view(1, 2, 1), MESH_DIM_NAMES, "cpu", timeout))
    actor = _actor(model_dir, 64, ctx)
    assert actor.engine.parallel.replicated
    rows = torch.load(rows_path, weights_only=False)
    mine = {k: v[[slice(0, 5), slice(5, None)][rank]] for k, v in rows.items()}  # uneven on purpose
    with _all_reduces() as calls:
        metrics = actor.update(Batch(mine), loss=LOSS)
    torch.save({"metrics": metrics, "all_reduces": len(calls)}, out / f"rank{rank}.pt")


def test_an_on_policy_update_over_replicas_takes_one_all_reduce(model_dir: str, tmp_path: Path) -> None:
    one = _actor(model_dir, 64)
    rows = _rows(one)
    torch.save(rows, tmp_path / "rows.pt")
    out = run_ranks(2, functools.partial(_replica_rank, model_dir=model_dir, rows_path=str(tmp_path / "rows.pt")),
                    tmp_path)
    expected = one.update(Batch(rows), loss=LOSS)
    assert {"actor/logprob_mismatch", "actor/logprob_mismatch_max", "actor/kl_to_ref"} <= expected.keys()
    ranks = [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(2)]
    # Each rank reports its own count (the metrics protocol sums them).
    assert sum(got["metrics"]["actor/response_tokens"] for got in ranks) == expected["actor/response_tokens"]
    for got in ranks:
        # The gradients, the loss normaliser, the metrics and the rollout consistency
        # (means and a max) in one all-reduce.
        assert got["all_reduces"] == 1
        assert got["metrics"].keys() == expected.keys()
        for key, value in expected.items():
            if key == "actor/response_tokens":
                continue
            noise = 1e-6 if key.startswith("actor/logprob_mismatch") else 1e-7
            assert got["metrics"][key] == pytest.approx(value, rel=1e-5, abs=noise), key
