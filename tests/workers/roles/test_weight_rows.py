"""Weights as rows: the parts of a weights future make the whole tensors back, for
tensor-parallel shards along any dimension and whole parameters cut with padding;
anything else is refused by name."""

from __future__ import annotations

import pytest
import torch
from roles_testlib import local_ctx, small_lm

from channels import ConfigError
from workers.roles import WEIGHTS_VERSION
from workers.roles._weights import _part, assemble_weights, weight_rows


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
