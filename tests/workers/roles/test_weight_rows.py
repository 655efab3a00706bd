"""Weights as rows: the parts of a weights future make the whole tensors back, for
tensor-parallel shards along any dimension and whole parameters cut with padding;
anything else is refused by name."""

from __future__ import annotations

import pytest
import torch
from roles_testlib import local_ctx, small_lm

from channels import ConfigError, FieldSpec
from workers.roles import WEIGHTS_VERSION
from workers.roles._weights import (
    _part,
    assemble_shards,
    assemble_weights,
    weight_buckets,
    weight_rows,
)


def test_shards_and_padded_parts_assemble_into_the_whole_tensors() -> None:
    gen = torch.Generator().manual_seed(0)
    col, row, whole = (torch.randn(shape, generator=gen) for shape in ((6, 4), (4, 6), (5, 3)))
    rows = {
        "col": torch.stack(list(col.chunk(2, 0))),    # tensor parallel along rows
        "row": torch.stack(list(row.chunk(2, 1))),    # ... along columns
        "whole": torch.stack([_part(whole, 2, 0), _part(whole, 2, 1)]),  # 5 rows: 3 + 2 and a padding row
        WEIGHTS_VERSION: torch.tensor([4, 4]),
    }
    got, version = assemble_weights(rows, {"col": (6, 4), "row": (4, 6), "whole": (5, 3)})
    assert version == 4
    for name, want in (("col", col), ("row", row), ("whole", whole)):
        assert torch.equal(got[name], want), name


@pytest.mark.parametrize("published", [1, 2, 4])
def test_a_tensor_rank_assembles_its_own_shard_from_the_rows_it_gets(published) -> None:
    """A rollout of t = 2 from an actor of ``published`` shard rows: rank j gets rows
    j*R/2 .. (j+1)*R/2 - 1 (R >= 2) or the single row (R = 1) and keeps its half."""
    gen = torch.Generator().manual_seed(0)
    col, row = torch.randn(8, 4, generator=gen), torch.randn(4, 8, generator=gen)
    for j in range(2):
        lo, hi = (j * published // 2, (j + 1) * published // 2) if published >= 2 else (0, 1)
        rows = {"col": torch.stack(list(col.chunk(published, 0)))[lo:hi],
                "row": torch.stack(list(row.chunk(published, 1)))[lo:hi],
                WEIGHTS_VERSION: torch.tensor([3] * (hi - lo))}
        got, version = assemble_shards(rows, {"col": ((4, 4), 0), "row": ((4, 4), 1)}, index=j, parts=2)
        assert version == 3
        assert torch.equal(got["col"], col.chunk(2, 0)[j]) and torch.equal(got["row"], row.chunk(2, 1)[j])


def test_shard_rows_that_do_not_make_the_shard_are_refused() -> None:
    rows = {"col": torch.zeros(1, 3, 4), WEIGHTS_VERSION: torch.tensor([1])}
    with pytest.raises(ConfigError, match=r"1 rows of 'col' shaped \(3, 4\) do not make its shard \(4, 4\)"):
        assemble_shards(rows, {"col": ((4, 4), 0)}, index=0, parts=2)
    with pytest.raises(ConfigError, match="are not split parameters"):
        assemble_shards({**rows, "norm": torch.zeros(1, 4)}, {"col": ((3, 4), 0)}, index=0, parts=2)


def test_one_rank_publishes_every_parameter_whole() -> None:
    model = small_lm()
    rows = weight_rows(model, local_ctx("actor"), version=2)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    got, version = assemble_weights(rows, shapes)
    assert version == 2 and all(torch.equal(got[n], p) for n, p in model.named_parameters())


@pytest.mark.parametrize(("rows", "message"), [
    ({"w": torch.zeros(1, 2)}, "needs the rows of actor.weights"),
    ({"w": torch.zeros(2, 2), WEIGHTS_VERSION: torch.tensor([1, 2])}, r"several weight versions \[1, 2\]"),
    ({WEIGHTS_VERSION: torch.tensor([1])}, "lack parameter 'w'"),
    ({"w": torch.zeros(2, 3, 3), WEIGHTS_VERSION: torch.tensor([1, 1])}, r"2 shards of 'w' shaped \(3, 3\)"),
])
def test_rows_that_do_not_make_the_model_are_refused(rows: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        assemble_weights(rows, {"w": (4, 4)})


def test_a_rollout_role_refuses_weights_older_than_its_own(tmp_path) -> None:
    from roles_testlib import TINY

    from channels import Batch
    from workers.models import load_model, save_tiny_model
    from workers.roles import RolloutWorker, RolloutWorkerConfig

    model_dir = str(save_tiny_model(tmp_path, TINY, seed=0))
    rollout = RolloutWorker(local_ctx("rollout"), RolloutWorkerConfig(model_dir=model_dir))
    model = load_model(model_dir)
    assert rollout.load_weights(Batch(weight_rows(model, local_ctx("actor"), version=2))) == 2
    with pytest.raises(ConfigError, match="version 1 is older than the loaded 2"):
        rollout.load_weights(Batch(weight_rows(model, local_ctx("actor"), version=1)))


def test_buckets_hold_each_parameter_once_within_the_bound() -> None:
    fields = [FieldSpec(name="a", dtype="float32", shape=(10,)),      # 80 bytes over 2 rows
              FieldSpec(name=WEIGHTS_VERSION, dtype="int64", shape=()),
              FieldSpec(name="b", dtype="float32", shape=(5,)),       # 40
              FieldSpec(name="big", dtype="float32", shape=(100,)),   # 800: a bucket of its own
              FieldSpec(name="c", dtype="float16", shape=(4,))]       # 16
    assert weight_buckets(fields, rows=2, bucket_bytes=128) == [("a", "b"), ("big",), ("c",)]
    assert weight_buckets(fields, rows=2, bucket_bytes=1 << 20) == [("a", "b", "big", "c")]
    with pytest.raises(ConfigError, match="bucket_bytes > 0"):
        weight_buckets(fields, rows=2, bucket_bytes=0)


def test_a_bucket_assembles_its_parameters_and_names_strangers() -> None:
    rows = {"w": torch.ones(1, 4, 4), WEIGHTS_VERSION: torch.tensor([3])}
    got, version = assemble_weights(rows, {"w": (4, 4), "v": (2,)}, partial=True)
    assert version == 3 and set(got) == {"w"}
    with pytest.raises(ConfigError, match=r"\['x'\] are not parameters of the rollout model"):
        assemble_weights(rows | {"x": torch.ones(1, 2)}, {"w": (4, 4)}, partial=True)


def test_a_rollout_role_loads_a_version_bucket_by_bucket(tmp_path) -> None:
    """A version counts as loaded once its last parameter is; another version may
    not start before that, and ``generate`` waits for it."""
    from roles_testlib import TINY

    from channels import Batch
    from workers.models import load_model, save_tiny_model
    from workers.roles import RolloutWorker, RolloutWorkerConfig

    model_dir = str(save_tiny_model(tmp_path, TINY, seed=0))
    rollout = RolloutWorker(local_ctx("rollout"), RolloutWorkerConfig(model_dir=model_dir))
    rows = weight_rows(load_model(model_dir), local_ctx("actor"), version=5)
    names = [n for n in rows if n != WEIGHTS_VERSION]
    first = {n: rows[n] for n in names[:2]} | {WEIGHTS_VERSION: rows[WEIGHTS_VERSION]}
    assert rollout.load_weights(Batch(first)) == 5
    assert rollout.weights_version is None  # not all of version 5 yet
    with pytest.raises(ConfigError, match=rf"weights of version 5 are loaded in part \(2 of {len(names)} parameters\)"):
        next(rollout.generate(Batch({"prompt_ids": torch.ones(1, 2, dtype=torch.long),
                                     "prompt_mask": torch.ones(1, 2, dtype=torch.long)})))
    newer = weight_rows(load_model(model_dir), local_ctx("actor"), version=6)
    with pytest.raises(ConfigError, match="version 6 arrived while version 5 is loaded in part"):
        rollout.load_weights(Batch(newer))
    rest = {n: rows[n] for n in names[2:]} | {WEIGHTS_VERSION: rows[WEIGHTS_VERSION]}
    assert rollout.load_weights(Batch(rest)) == 5 and rollout.weights_version == 5


def test_published_rows_keep_their_version_when_the_parameters_change() -> None:
    """The rows are a snapshot: a rollout that pulls them after the actor's next
    optimizer step (which changes the parameters in place) gets what was published."""
    model = small_lm()
    rows = weight_rows(model, local_ctx("actor"), version=1)
    before = {n: rows[n].clone() for n in rows}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    assert all(torch.equal(rows[n], before[n]) for n in rows)
