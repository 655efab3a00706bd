"""Gradient norms and clipping over a model's tensors whatever their layout: plain
tensors, DTensor shards of tensor parallelism or FSDP2, and pipeline stages."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from workers._dtensor import is_dtensor


def _layout_key(tensor: Tensor) -> tuple[object, ...]:
    if is_dtensor(tensor):
        return (tensor.device_mesh, tuple(tensor.placements))
    return ()


def group_by_layout(tensors: Iterable[Tensor]) -> list[list[Tensor]]:
    """Split tensors into lists of one layout each (plain, or one DTensor mesh/placements).

    Foreach kernels and norm reductions need homogeneous lists: TP leaves plain
    replicated tensors beside DTensors, and 2-D FSDP+TP mixes two meshes.

    Args:
        tensors: parameters or gradients.

    Returns:
        The groups, in first-seen order.
    """
    groups: dict[tuple[object, ...], list[Tensor]] = {}
    for tensor in tensors:
        groups.setdefault(_layout_key(tensor), []).append(tensor)
    return list(groups.values())


def clip_grad_norm(parameters: Iterable[nn.Parameter], max_norm: float | None, *,
                   stages: dist.ProcessGroup | None = None, uncounted: Sequence[nn.Parameter] = ()) -> Tensor:
    """Total L2 norm of the gradients over all shards, and clip them to ``max_norm``.

    Sharded (DTensor) gradients are reduced over their mesh, replicated ones are not,
    so the norm equals the norm of the full unsharded gradient on every rank.

    Args:
        parameters: the model parameters (those without gradients are skipped).
        max_norm: clip threshold; None or <= 0 only measures.
        stages: the pipeline's group, whose stages hold the model's other
            parameters (their squared norms are summed over it).
        uncounted: parameters clipped but left out of the norm (a second copy of a
            tied weight, counted where the first is).

    Returns:
        The pre-clip total norm (a float32 scalar on the gradients' device).
    """
    skip = {id(p) for p in uncounted}
    pairs = [(p.grad, id(p) not in skip) for p in parameters if p.grad is not None]
    grads = [g for g, _ in pairs]
    counted = [g for g, count in pairs if count]
    if not grads and stages is None:
        return torch.zeros(())
    squares = [torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else None)]
    for group in group_by_layout(counted):
        norm = torch.nn.utils.get_total_norm(group, norm_type=2.0)
        if is_dtensor(norm):
            norm = norm.full_tensor()
        squares.append(norm.float().pow(2))
    total = torch.stack(squares).sum()
    if stages is not None:
        dist.all_reduce(total, group=stages)
    total = total.sqrt()
    if max_norm and max_norm > 0:
        coef = float((max_norm / (total + 1e-6)).clamp(max=1.0))
        if coef < 1.0:
            for group in group_by_layout(grads):
                torch._foreach_mul_(group, coef)
    return total
