"""Row transforms: functions that ``fut.map(fn)`` runs where the rows land.

One idea, three names: :func:`transform` declares the fields a function reads and
writes and makes a :class:`Transform` of it; ``fut.map(fn, **kwargs)`` binds a
function (a :class:`Transform` or a plain callable) to its keyword arguments as a
:class:`BoundTransform`, which travels with the future's rows until a consumer
rank applies it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from channels import Batch

RowFn = Callable[..., Mapping[str, torch.Tensor]]
"""Takes a :class:`~channels.Batch` and keyword arguments; returns new or replaced
columns with the same row count."""


class Transform:
    """A row function with declared fields (made by :func:`transform`); called as
    the function itself."""

    def __init__(self, fn: RowFn, reads: tuple[str, ...] | None, writes: tuple[str, ...] | None,
                 optional: tuple[str, ...] = ()) -> None:
        self.fn, self.reads, self.writes, self.optional = fn, reads, writes, optional
        self.__name__ = getattr(fn, "__name__", "transform")
        self.__qualname__ = getattr(fn, "__qualname__", self.__name__)
        self.__module__ = getattr(fn, "__module__", None)  # type: ignore[assignment]
        self.__doc__ = fn.__doc__

    def __call__(self, batch: Batch, **kwargs: Any) -> Mapping[str, torch.Tensor]:
        return self.fn(batch, **kwargs)

    def __reduce__(self) -> str | tuple[Any, ...]:
        """The framework's own transforms (``asyncflow.algos``' ``group_advantages``,
        say) pickle by reference: every worker imports their modules, so a rank that
        applies one imports it instead of receiving its code with every call. Any
        other travels with its function, as before: a user's module may not be
        importable where the rows land."""
        if _by_reference(self):
            return self.__qualname__
        return Transform, (self.fn, self.reads, self.writes, self.optional)


FRAMEWORK_PACKAGES = frozenset({"asyncflow", "workers", "channels", "hybrid_engine"})
"""Packages every worker imports: their transforms travel by reference."""


def _by_reference(t: Transform) -> bool:
    """Whether ``t`` is a framework module's top-level transform (what the module's
    attribute of its qualified name holds)."""
    name = t.__module__ or ""
    module = sys.modules.get(name)
    if module is None or name.partition(".")[0] not in FRAMEWORK_PACKAGES or "<locals>" in t.__qualname__:
        return False
    found: Any = module
    for part in t.__qualname__.split("."):
        found = getattr(found, part, None)
    return found is t


def transform(*, reads: Sequence[str] | None = None, writes: Sequence[str] | None = None,
              optional: Sequence[str] = ()) -> Callable[[RowFn], Transform]:
    """Declare the fields a row transform reads and writes, so that ``fut.map(fn)``
    knows its output fields at call time and pulls only what ``fn`` needs;
    ``optional``: fields it reads when the rows have them.

    The function takes a :class:`~channels.Batch` (the consumer rank's rows) and
    keyword arguments, and returns a mapping of new or replaced columns with the
    same row count.
    """
    def decorate(fn: RowFn) -> Transform:
        return Transform(fn, None if reads is None else tuple(reads), None if writes is None else tuple(writes),
                         tuple(optional))
    return decorate


@dataclass(frozen=True, kw_only=True, eq=False)
class BoundTransform:
    """A row function with the keyword arguments of one ``map`` call, applied where
    the rows land."""

    fn: RowFn
    kwargs: Mapping[str, Any]
    reads: tuple[str, ...] | None
    """The fields ``fn`` reads (None: undeclared, so every field)."""
    writes: tuple[str, ...] | None
    """The fields ``fn`` writes (None: undeclared, known once it ran)."""
    optional: tuple[str, ...] = ()
    """The fields ``fn`` reads when the rows have them."""

    @classmethod
    def of(cls, fn: RowFn, kwargs: Mapping[str, Any]) -> BoundTransform:
        """``fn`` bound to ``kwargs``, with the fields a :class:`Transform` declares."""
        declared = fn if isinstance(fn, Transform) else None
        return cls(fn=fn, kwargs=dict(kwargs), reads=declared.reads if declared else None,
                   writes=declared.writes if declared else None, optional=declared.optional if declared else ())

    def same_as(self, other: BoundTransform) -> bool:
        """The same function with equal arguments (two micro-batches mapped alike)."""
        return self is other or (self.fn is other.fn and dict(self.kwargs) == dict(other.kwargs))
