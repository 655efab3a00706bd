"""A ``@transform`` travels to the ranks that apply it as a function does: by
reference from a module's top level (the rank imports it), by value from
``__main__``, a function's body or a module Ray's pickler sends by value."""

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


def test_a_module_level_transform_travels_by_reference() -> None:
    for dumps in (pickle.dumps, cloudpickle.dumps):
        data = dumps(group_advantages)
        assert pickle.loads(data) is group_advantages
        assert len(data) < 200 and b"co_code" not in data, "its name, not its code"


def test_a_transform_made_in_a_function_travels_by_value() -> None:
    @transform(reads=("x",), writes=("y",))
    def double(batch: Batch) -> dict[str, torch.Tensor]:
        return {"y": batch["x"] * 2}

    assert not _by_reference(double)
    with pytest.raises((pickle.PicklingError, AttributeError)):
        pickle.dumps(double)  # the standard pickler cannot send a local function
    got = pickle.loads(cloudpickle.dumps(double))
    assert isinstance(got, Transform) and got is not double
    assert (got.reads, got.writes, got.__name__) == (("x",), ("y",), "double")
    assert got(Batch({"x": torch.tensor([1.0, 2.0])}))["y"].tolist() == [2.0, 4.0]


@pytest.fixture
def module() -> Iterator[types.ModuleType]:
    """A module (not on disk) with a top-level transform ``double``."""
    mod = types.ModuleType("af_test_transform_module")
    sys.modules[mod.__name__] = mod
    exec("from asyncflow import transform\n"
         "@transform(reads=('x',), writes=('y',))\n"
         "def double(batch):\n"
         "    return {'y': batch['x'] * 2}\n", mod.__dict__)
    yield mod
    del sys.modules[mod.__name__]


def test_a_module_pickled_by_value_sends_its_transforms_by_value(module: types.ModuleType) -> None:
    assert _by_reference(module.double)
    cloudpickle.register_pickle_by_value(module)
    try:
        assert not _by_reference(module.double)
        data = cloudpickle.dumps(module.double)
    finally:
        cloudpickle.unregister_pickle_by_value(module)
    del sys.modules[module.__name__]  # as on a worker that cannot import it
    got = pickle.loads(data)
    assert got(Batch({"x": torch.tensor([3.0])}))["y"].tolist() == [6.0]
    sys.modules[module.__name__] = module


def test_a_transform_in_main_travels_by_value(module: types.ModuleType) -> None:
    module.double.__module__ = "__main__"
    assert not _by_reference(module.double)
