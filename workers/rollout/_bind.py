"""Pointing a model's parameters at tensors that live elsewhere, without a copy, and
letting them go: how the hybrid engine's generation shards become the rollout
model's weights for one generation and are freed after it.

A tensor-parallel (DTensor) parameter is rebound through its local shard; a plain
one directly. ``Tensor.set_`` keeps the parameter objects (and every module's
reference to them) and changes only the memory they view.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

from channels import ConfigError
from workers._dtensor import is_dtensor


def _local(param: Tensor) -> Tensor:
    # DTensor.to_local() returns a fresh view for parameters; rebinding must reach
    # the shard the DTensor itself computes with.
    return param._local_tensor if is_dtensor(param) else param  # type: ignore[attr-defined]


def bind_parameters(model: nn.Module, named_tensors: Iterable[tuple[str, Tensor]],
                    shapes: dict[str, tuple[int, ...]]) -> int:
    """Make each named parameter view the given tensor's memory (no copy).

    Args:
        model: the model; its parameters stop requiring gradients.
        named_tensors: ``(name, tensor)`` by ``model.named_parameters()`` names; a
            tensor-parallel parameter takes this rank's shard.
        shapes: each parameter's (local) shape, as :func:`release_parameters`
            recorded it.

    Returns:
        How many parameters were bound.

    Raises:
        ConfigError: a name is not a parameter, or a shape or dtype differs.
    """
    params = dict(model.named_parameters())
    bound = 0
    with torch.no_grad():
        for name, tensor in named_tensors:
            param = params.get(name)
            if param is None:
                raise ConfigError(f"bind_weights got {name!r}, which is not a parameter of the model; "
                                  f"use the names of model.named_parameters(), e.g. {next(iter(params), '')!r}")
            local = _local(param)
            want = shapes.get(name, tuple(local.shape))
            if tuple(tensor.shape) != want or tensor.dtype != local.dtype:
                raise ConfigError(f"bind_weights got {name!r} as {tuple(tensor.shape)} {tensor.dtype}, but this "
                                  f"rank's parameter is {want} {local.dtype}")
            param.requires_grad_(False)
            # Its storage, offset, size and stride (torch's stubs lack this documented overload).
            local.set_(tensor)  # type: ignore[call-overload]
            bound += 1
    return bound


def release_parameters(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Drop the memory of every parameter (each becomes an empty tensor) and return
    their (local) shapes, for :func:`bind_parameters`."""
    shapes: dict[str, tuple[int, ...]] = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            local = _local(param)
            shapes[name] = tuple(local.shape)
            param.requires_grad_(False)
            empty = torch.empty(0, dtype=local.dtype, device=local.device)
            local.set_(empty.untyped_storage(), 0, empty.size(), empty.stride())
    return shapes
