"""The training engine's AdamW: parameter groups and the kernels each group runs.

Groups are split by decay (matrices decay, norms and biases do not) and by layout
(plain tensors, or one DTensor mesh and placement), so that each group's tensors are
homogeneous. On CUDA a group of plain tensors runs the fused AdamW kernel (one launch
for the whole group); DTensor groups (TP, FSDP2 shards) run the multi-tensor
``foreach`` kernels. Elsewhere torch's defaults apply.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from workers.engines._config import TrainingConfig
from workers.engines._parallel import group_by_layout


def _kernel(params: Sequence[Tensor], device: torch.device) -> dict[str, bool]:
    """Which AdamW implementation a homogeneous group uses on ``device``."""
    if device.type != "cuda" or not params:
        return {}
    if isinstance(params[0], DTensor):
        return {"foreach": True}
    return {"fused": True}


def param_groups(
    model: nn.Module, weight_decay: float, device: torch.device
) -> list[dict[str, object]]:
    """AdamW parameter groups: one per (layout, decays), with its kernel choice.

    Args:
        model: the laid-out model (its trainable parameters are grouped).
        weight_decay: applied to parameters of 2 or more dimensions only.
        device: the engine's device (CUDA selects fused/foreach kernels).

    Returns:
        The groups, each a dict of ``params``, ``weight_decay`` and maybe ``fused`` or
        ``foreach``.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    groups: list[dict[str, object]] = []
    for decays in (True, False):
        chosen = [p for p in params if (p.ndim >= 2) == decays]
        for layout in group_by_layout(chosen):
            decay = weight_decay if decays else 0.0
            groups.append({"params": layout, "weight_decay": decay, **_kernel(layout, device)})
    return groups


def build_adamw(model: nn.Module, config: TrainingConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW over ``model``'s trainable parameters with ``config``'s settings.

    Args:
        model: the laid-out model.
        config: learning rate (at step 0), betas, eps and weight decay.
        device: the engine's device.

    Returns:
        The optimizer.
    """
    return torch.optim.AdamW(
        param_groups(model, config.weight_decay, device),  # type: ignore[arg-type]
        lr=config.lr_at(0),
        betas=config.betas,
        eps=config.eps,
    )
