"""``register``: declares how a role method's rows travel and which fields it
reads and writes, keeping the method's signature for type checkers.

    class Critic(Role):
        @register(protocol=DP(), reads=("input_ids", "attention_mask"), writes=("values",))
        def values(self, batch: Batch) -> Batch: ...

Inside a worker the method is an ordinary method. Through a group proxy on the
driver, ``group.values(fut)`` returns a ``DataFuture`` at once.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar, overload

from channels import DP, ConfigError, TransferProtocol

P = ParamSpec("P")
R = TypeVar("R")

Reads = Sequence[str] | Mapping[str, Sequence[str]] | None


@dataclass(frozen=True, kw_only=True)
class MethodSpec:
    """What ``register`` declares about a method."""

    name: str
    """The method's name."""
    protocol: TransferProtocol
    """How input rows are distributed and outputs collected."""
    reads: tuple[str, ...] | Mapping[str, tuple[str, ...]] | None
    """Fields read from every data argument, or per argument name; None: all."""
    writes: tuple[str, ...] | None
    """Fields the returned rows carry; None: not declared."""
    row_lengths: str | None
    """Output column whose per-row sum is published as the row's token count
    (used by ``DP(balance="tokens")``)."""
    signature: inspect.Signature
    """The method's signature, for argument checks at call time."""

    def reads_for(self, arg: str) -> tuple[str, ...] | None:
        """Fields read from data argument ``arg`` (None: all)."""
        if self.reads is None or isinstance(self.reads, tuple):
            return self.reads
        return self.reads.get(arg)


class Endpoint(Generic[P, R]):
    """A registered role method. Behaves as the plain method on role instances."""

    def __init__(self, fn: Callable[Concatenate[Any, P], R], spec: MethodSpec) -> None:
        self.fn = fn
        self.spec = spec
        self.__doc__ = fn.__doc__
        self.__name__ = fn.__name__
        self.__wrapped__ = fn

    @overload
    def __get__(self, obj: None, objtype: type | None = None) -> Endpoint[P, R]: ...
    @overload
    def __get__(self, obj: object, objtype: type | None = None) -> Callable[P, R]: ...
    def __get__(self, obj: object | None, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        return self.fn.__get__(obj, objtype)

    def __call__(self, role: Any, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return self.fn(role, *args, **kwargs)

    def __repr__(self) -> str:
        return f"<endpoint {self.spec.name} {self.spec.protocol!r}>"


def register(
    *,
    protocol: TransferProtocol | None = None,
    reads: Reads = None,
    writes: Sequence[str] | None = None,
    row_lengths: str | None = None,
) -> Callable[[Callable[Concatenate[Any, P], R]], Endpoint[P, R]]:
    """Declare a role method callable through group proxies.

    Args:
        protocol: distribute/collect protocol (default ``DP()``).
        reads: fields the method reads from its data arguments: a sequence (for
            every data argument) or a mapping from argument name to fields. Only
            these columns are pulled. None pulls every column.
        writes: fields of the rows the method returns; a caller reading other
            fields fails at call time.
        row_lengths: an output column (e.g. ``"attention_mask"``) whose per-row
            sum is published with the rows' metadata for token balancing.

    Returns:
        A decorator producing an :class:`Endpoint`.

    Raises:
        ConfigError: a declaration is malformed.
    """
    proto = protocol if protocol is not None else DP()
    if not isinstance(proto, TransferProtocol):
        raise ConfigError(f"protocol must be a TransferProtocol instance, got {proto!r}")
    norm_reads: tuple[str, ...] | Mapping[str, tuple[str, ...]] | None
    if reads is None:
        norm_reads = None
    elif isinstance(reads, Mapping):
        norm_reads = {k: tuple(v) for k, v in reads.items()}
    elif isinstance(reads, str):
        raise ConfigError(f"reads must be a sequence of field names, not the string {reads!r}")
    else:
        norm_reads = tuple(reads)
    if isinstance(writes, str):
        raise ConfigError(f"writes must be a sequence of field names, not the string {writes!r}")

    def decorate(fn: Callable[Concatenate[Any, P], R]) -> Endpoint[P, R]:
        sig = inspect.signature(fn)
        if isinstance(norm_reads, Mapping):
            unknown = set(norm_reads) - set(sig.parameters)
            if unknown:
                raise ConfigError(f"{fn.__qualname__}: reads names unknown arguments {sorted(unknown)}")
        spec = MethodSpec(
            name=fn.__name__,
            protocol=proto,
            reads=norm_reads,
            writes=None if writes is None else tuple(writes),
            row_lengths=row_lengths,
            signature=sig,
        )
        return Endpoint(fn, spec)

    return decorate


def endpoints(cls: type) -> dict[str, Endpoint[Any, Any]]:
    """Every registered method of role class ``cls`` (inherited ones included)."""
    found: dict[str, Endpoint[Any, Any]] = {}
    for klass in reversed(cls.__mro__):
        for name, value in vars(klass).items():
            if isinstance(value, Endpoint):
                found[name] = value
    return found
