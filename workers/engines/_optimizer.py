"""The training engine's AdamW: parameter groups, the kernels each group runs, and
one step at the schedule's learning rate.

Groups are split by decay (matrices decay, norms and biases do not) and by layout
(plain tensors, or one DTensor mesh and placement), so that each group's tensors are
homogeneous. On CUDA and the CPU a group of plain tensors runs the fused AdamW
kernel (one call for the whole group: on the CPU a quarter of the per-tensor loop's
time for a small model); DTensor groups (TP, FSDP2 shards) run the multi-tensor
``foreach`` kernels on CUDA. Elsewhere torch's defaults apply.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from workers._dtensor import is_dtensor
from workers.engines._config import TrainingConfig
from workers.engines._grad_norm import group_by_layout


def _kernel(params: Sequence[Tensor], device: torch.device) -> dict[str, bool]:
    """Which AdamW implementation a homogeneous group uses on ``device``."""
    if device.type not in ("cuda", "cpu") or not params:
        return {}
    if is_dtensor(params[0]):
        return {"foreach": True} if device.type == "cuda" else {}
    return {"fused": True} if params[0].dtype in _FUSED_DTYPES else {}


_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
"""The parameter dtypes torch's fused AdamW takes."""


def param_groups(
    model: nn.Module, weight_decay: float, device: torch.device
) -> list[dict[str, object]]:
    """AdamW parameter groups: one per (layout, decays), with its kernel choice.

    Args:
        model: the laid-out model (its trainable parameters are grouped).
        weight_decay: applied to parameters of 2 or more dimensions only.
        device: the engine's device (CUDA and the CPU select fused/foreach kernels).

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


def take_step(optimizer: torch.optim.Optimizer, config: TrainingConfig, step: int, *,
              loss: float, grad_norm: float, empty: bool = False) -> dict[str, float]:
    """Step ``optimizer`` at the learning rate of ``step``, unless the loss or the
    gradient norm is not finite and ``config.skip_non_finite`` says to skip, or the
    step had no rows; the gradients are cleared either way.

    Args:
        optimizer: the engine's optimizer, gradients accumulated.
        config: the schedule (``lr_at``) and ``skip_non_finite``.
        step: optimizer steps taken so far.
        loss: the step's loss, equal on every rank.
        grad_norm: the total gradient norm, equal on every rank.
        empty: no data-parallel rank had a row. The step is skipped: on a zero
            gradient the optimizer would still move the weights (momentum, weight
            decay) and advance the schedule.

    Returns:
        ``grad_norm``, ``lr`` and ``step_skipped`` (1.0 or 0.0).
    """
    lr = config.lr_at(step)
    skip = empty or (config.skip_non_finite and not (math.isfinite(loss) and math.isfinite(grad_norm)))
    if not skip:
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"grad_norm": grad_norm, "lr": lr, "step_skipped": float(skip)}
