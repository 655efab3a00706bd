"""DTensor and FSDP2 on first use.

``torch.distributed.tensor`` costs about 0.8 s to import (500 modules, sympy among
them; ``torch.distributed.fsdp`` imports it), and only a rank that shards (tensor
parallelism, FSDP2) makes a DTensor or an FSDP2 module, by importing them.
:func:`is_dtensor` and :func:`is_fsdp_module` tell one apart without importing the
module, so that importing the roles, the engines and the rollout (``asyncflow
train``'s configuration check among others) does not import it.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, TypeGuard

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

__all__ = ["is_dtensor", "is_fsdp_module"]


def is_dtensor(value: object) -> TypeGuard[DTensor]:
    """Whether ``value`` is a DTensor (none exists before ``torch.distributed.tensor``
    is imported, so it is not imported here)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def is_fsdp_module(value: object) -> TypeGuard[FSDPModule]:
    """Whether ``value`` is a module FSDP2 shards (none exists before
    ``torch.distributed.fsdp`` is imported, so it is not imported here)."""
    module = sys.modules.get("torch.distributed.fsdp")
    return module is not None and isinstance(value, module.FSDPModule)
