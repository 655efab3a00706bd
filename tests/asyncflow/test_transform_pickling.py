"""The framework's own ``@transform`` functions travel to the ranks that apply
them by reference (every worker imports their modules); any other travels with
its function, since the workers may not import the module it comes from."""

from __future__ import annotations

import pickle
import sys
import types
from collections.abc import Iterator

import pytest
import torch
from ray import cloudpickle

from asyncflow import transform
from asyncflow.algos._transforms import group_advantages
from asyncflow.runtime._transform import Transform, _by_reference
from channels import Batch


def test_a_framework_transform_travels_by_reference() -> None:
    for dumps in (pickle.dumps, cloudpickle.dumps):
        data = dumps(group_advantages)
        assert pickle.loads(data) is group_advantages
        assert len(data) < 200 and b"co_code" not in data, "its name, not its code"


def test_a_transform_made_in_a_function_travels_by_value() -> None:
    @transform(reads=("x",), writes=("y",))
    def double(batch: Batch) -> dict[str, torch.Tensor]:
        return {"y": batch["x"] * 2}

    assert not _by_reference(double)
    got = pickle.loads(cloudpickle.dumps(double))
    assert isinstance(got, Transform) and got is not double
    assert (got.reads, got.writes, got.__name__) == (("x",), ("y",), "double")
    assert got(Batch({"x": torch.tensor([1.0, 2.0])}))["y"].tolist() == [2.0, 4.0]


@pytest.fixture
def module() -> Iterator[types.ModuleType]:
    """A user's module (not on disk, so no other process can import it) with a
    top-level transform ``double``."""
    mod = types.ModuleType("af_test_user_transforms")
    sys.modules[mod.__name__] = mod
    exec("from asyncflow import transform\n"
         "@transform(reads=('x',), writes=('y',))\n"
         "def double(batch):\n"
         "    return {'y': batch['x'] * 2}\n", mod.__dict__)
    yield mod
    sys.modules.pop(mod.__name__, None)


def test_a_users_top_level_transform_travels_by_value(module: types.ModuleType) -> None:
    assert not _by_reference(module.double)
    data = cloudpickle.dumps(module.double)
    del sys.modules[module.__name__]  # as in a worker that cannot import it
    got = pickle.loads(data)
    assert got(Batch({"x": torch.tensor([3.0])}))["y"].tolist() == [6.0]
