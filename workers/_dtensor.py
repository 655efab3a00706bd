"""DTensor on first use.

``torch.distributed.tensor`` costs about 0.8 s to import (500 modules, sympy among
them), and only a rank that shards (tensor parallelism, FSDP2) makes a DTensor, by
importing it. :func:`is_dtensor` tells one apart without importing the module, so
that importing the roles, the engines and the rollout (``asyncflow train``'s
configuration check among others) does not import it.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, TypeGuard

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = ["is_dtensor"]


def is_dtensor(value: object) -> TypeGuard[DTensor]:
    """Whether ``value`` is a DTensor (none exists before ``torch.distributed.tensor``
    is imported, so it is not imported here)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)
