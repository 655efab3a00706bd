"""Names of a package's face that load on first use (PEP 562).

``channels``, ``asyncflow``, ``asyncflow.runtime`` and ``asyncflow.train`` re-export
names from modules that import torch or Ray; importing a package itself stays light
(the command line reads its configuration file and sets Ray's environment before
either is imported; ``start_ray`` starts Ray before torch imports; ``from channels
import ConfigError`` imports the errors only). It lives in the lowest package so
that every package can use it. Only the standard library is imported here.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, Sequence[str]]
                 ) -> tuple[list[str], Callable[[str], Any], Callable[[], list[str]]]:
    """``__all__``, ``__getattr__`` and ``__dir__`` for ``package``, whose names
    ``exports`` gives by the module each comes from; a name is imported from its
    module when first read, then kept in the package.

    Usage, in the package's ``__init__``:
    ``__all__, __getattr__, __dir__ = lazy_exports(__name__, {"pkg._mod": ("Name",)})``,
    with the same names imported under ``TYPE_CHECKING`` for type checkers.
    """
    where = {name: module for module, names in exports.items() for name in names}

    def getattr_(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def dir_() -> list[str]:
        return sorted({*vars(sys.modules[package]), *where})

    return sorted(where), getattr_, dir_
