"""Memory of a training engine's state: measured on a live engine, or estimated from a
parameter count before anything is built (for a config-time check).

Both count the persistent state only: parameters, gradients and optimizer state.
Activations, FSDP2's per-block all-gather buffers, autocast's bf16 copies of the
weights during a forward, and the allocator's cache come on top.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from workers.engines._errors import EngineConfigError
from workers.engines._offload import optimizer_tensors, unique_storages
from workers.engines._precision import PrecisionName

_GIB = 2**30


@dataclass(frozen=True, kw_only=True)
class MemoryFootprint:
    """Bytes of a training engine's state on one device, by kind."""

    params: int
    """Parameters (this rank's shards)."""
    grads: int
    """Gradients (0 between steps: they are freed after each optimizer step)."""
    optimizer_state: int
    """Optimizer state (AdamW's two moments, step counters)."""

    @property
    def total(self) -> int:
        """The sum of the three kinds."""
        return self.params + self.grads + self.optimizer_state

    def as_gib(self) -> dict[str, float]:
        """The kinds and the total in GiB, for logs and metrics.

        Returns:
            ``{"params_gib", "grads_gib", "optimizer_state_gib", "total_gib"}``.
        """
        return {
            "params_gib": self.params / _GIB,
            "grads_gib": self.grads / _GIB,
            "optimizer_state_gib": self.optimizer_state / _GIB,
            "total_gib": self.total / _GIB,
        }


def _storage_bytes(tensors: Iterable[torch.Tensor], device: torch.device) -> int:
    return sum(storage.nbytes() for storage in unique_storages(tensors, device))


def measure_memory(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, device: torch.device
) -> MemoryFootprint:
    """The bytes a model's state occupies on ``device`` now (offloaded state counts 0).

    Args:
        model: the (laid out) model.
        optimizer: its optimizer, or None.
        device: the device to count.

    Returns:
        The footprint; shared storages (tied weights, views) are counted once.
    """
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    state = list(optimizer_tensors(optimizer)) if optimizer is not None else []
    return MemoryFootprint(
        params=_storage_bytes(params, device),
        grads=_storage_bytes(grads, device),
        optimizer_state=_storage_bytes(state, device),
    )


_ADAMW_STATE_BYTES = 8
"""AdamW keeps two float32 moments per parameter."""


def estimate_memory(
    parameters: int,
    *,
    precision: PrecisionName,
    trainable: bool = True,
    shards: int = 1,
    tp: int = 1,
) -> MemoryFootprint:
    """Bytes per device of a model's state during an optimizer step, before building it.

    Mixed bf16 training keeps float32 master weights, gradients and AdamW moments,
    so a trainable model costs 16 bytes per parameter in either precision (bf16
    saves activation memory and time, not state); an inference-only bf16 model
    stores its parameters in bf16 (2 bytes) and nothing else.

    Args:
        parameters: the model's parameter count.
        precision: the resolved precision (see ``TrainingConfig.precision``).
        trainable: False for an inference-only engine (no gradients, no optimizer).
        shards: data-parallel ranks FSDP2 shards the state over (1 when replicated,
            see ``TrainingConfig.replicates``).
        tp: tensor-parallel ranks; assumes every parameter is split, whereas the
            default plan keeps embeddings and norms whole, so the real figure is higher.

    Returns:
        The estimated footprint per device.

    Raises:
        EngineConfigError: for a negative count, sizes below 1, or an unknown precision.
    """
    if parameters < 0 or shards < 1 or tp < 1:
        raise EngineConfigError(
            f"estimate_memory needs parameters >= 0, shards >= 1 and tp >= 1, got "
            f"parameters={parameters}, shards={shards}, tp={tp}"
        )
    if precision not in ("fp32", "bf16"):
        raise EngineConfigError(
            f"estimate_memory precision must be 'fp32' or 'bf16' (resolve 'auto' with "
            f"resolve_precision), got {precision!r}"
        )
    local = -(-parameters // (shards * tp))  # ceil: FSDP2 pads the last shard
    if not trainable:
        per_param = 2 if precision == "bf16" else 4
        return MemoryFootprint(params=per_param * local, grads=0, optimizer_state=0)
    return MemoryFootprint(
        params=4 * local, grads=4 * local, optimizer_state=_ADAMW_STATE_BYTES * local
    )
