"""``register``: declares how a role method's rows travel and which fields it
reads and writes, keeping the method's signature for type checkers.

    class Critic(Role):
        @register(protocol=DP(), reads=("input_ids", "attention_mask"), writes=("values",))
        def values(self, batch: Batch) -> Batch: ...

Inside a worker the method is an ordinary method (a streaming one, called
directly, runs to the end and returns its rows). Through a group proxy on the
driver, ``group.values(fut)`` returns a ``DataFuture`` at once; the driver checks
the declared fields against the input futures before anything runs and pulls only
the columns the method reads.

A declaration may depend on the call: ``reads``, ``optional`` and ``writes`` accept
a function of :class:`CallInfo` (the role's config and the call's arguments), e.g.
an update whose loss reads ``ref_logprobs`` only when it has a KL term.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Concatenate, Generic, Optional, ParamSpec, TypeVar, overload

from channels import DP, Batch, ConfigError, TransferProtocol

P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True, kw_only=True)
class CallInfo:
    """What a computed field declaration sees of a call, on the driver."""

    config: Any
    """The role's config object (``RoleSpec.config``), or None."""
    arguments: Mapping[str, Any]
    """The call's bound arguments by name (data arguments are futures)."""


FieldNames = Sequence[str] | Mapping[str, Sequence[str]]
"""Fields read from every data argument, or per argument name."""
Reads = FieldNames | Callable[[CallInfo], FieldNames] | None
Writes = Sequence[str] | Callable[[CallInfo], Sequence[str]] | None


@dataclass(frozen=True, kw_only=True)
class FieldContract:
    """A method's fields for one call (see :meth:`MethodSpec.contract`)."""

    required: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Per data argument: fields it must carry (checked before anything runs)."""
    optional: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Per data argument: fields pulled when the input has them."""
    whole: frozenset[str] = frozenset()
    """Data arguments pulled with every column (undeclared reads, or carried)."""
    writes: tuple[str, ...] | None = None
    """Fields the output rows carry besides the carried ones (None: not declared)."""
    carries: str | None = None
    """The data argument whose every column the output carries along."""

    def pulls(self, arg: str, have: Iterable[str]) -> tuple[str, ...] | None:
        """Columns to pull of data argument ``arg`` whose input has ``have`` (None: all)."""
        if arg in self.whole:
            return None
        present = set(have)
        extra = [f for f in self.optional.get(arg, ()) if f in present]
        return tuple(dict.fromkeys((*self.required.get(arg, ()), *extra)))


@dataclass(frozen=True, kw_only=True)
class MethodSpec:
    """What ``register`` declares about a method."""

    name: str
    """The method's name."""
    protocol: TransferProtocol
    """How input rows are distributed and outputs collected."""
    reads: Reads
    """Fields required from the data arguments (or a function of the call); None:
    undeclared, every column is pulled."""
    optional: Reads
    """Fields pulled when present (or a function of the call)."""
    writes: Writes
    """Fields the returned rows carry (or a function of the call); None: undeclared."""
    carries: str | None
    """A data argument whose every column the returned rows carry along."""
    row_lengths: str | None
    """Output column whose per-row sum is published as the row's token count
    (used by ``DP(balance="tokens")``)."""
    signature: inspect.Signature
    """The method's signature, for argument checks at call time."""
    data_parameters: frozenset[str] = frozenset()
    """Its data arguments: the parameters annotated ``Batch`` or ``Batch | None`` (as
    the mypy plugin reads them); a call gives them futures, never rows."""
    streams: bool = False
    """Whether the method is a generator that reports rows as they finish (see
    ``workers.host._streaming``): it can then be called with ``stream=...``."""

    def contract(self, info: CallInfo, data_args: Iterable[str]) -> FieldContract:
        """The fields of one call, with computed declarations evaluated.

        Raises:
            ConfigError: a computed declaration returned something malformed.
        """
        names = list(data_args)
        required = _per_arg(self.name, "reads", _evaluate(self.reads, info), names)
        optional = _per_arg(self.name, "optional", _evaluate(self.optional, info), names)
        whole = {a for a in names if required.get(a) is None}
        if self.carries is not None:
            whole.add(self.carries)
        writes = _evaluate(self.writes, info)
        return FieldContract(
            required={a: f for a, f in required.items() if f is not None},
            optional={a: f for a, f in optional.items() if f is not None},
            whole=frozenset(whole),
            writes=None if writes is None else _names(self.name, "writes", writes),
            carries=self.carries,
        )


_BATCH_SOURCE = re.compile(r"(channels\.)?Batch(\s*\|\s*None)?|None\s*\|\s*(channels\.)?Batch|Optional\[(channels\.)?Batch\]")


def _is_batch(annotation: Any) -> bool:
    """Annotated ``Batch`` or ``Batch | None``, in source text or as the types."""
    if isinstance(annotation, str):
        return _BATCH_SOURCE.fullmatch(annotation.strip()) is not None
    return annotation is Batch or annotation == Batch | None or annotation == Optional[Batch]  # noqa: UP045


def _evaluate(decl: Any, info: CallInfo) -> Any:
    return decl(info) if callable(decl) else decl


def _names(method: str, what: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, Sequence | frozenset | set):
        raise ConfigError(f"{method}: {what} must be a sequence of field names, got {value!r}")
    return tuple(value)


def _per_arg(method: str, what: str, value: Any, args: list[str]) -> dict[str, tuple[str, ...] | None]:
    if value is None:
        return dict.fromkeys(args)
    if isinstance(value, Mapping):
        return {a: (_names(method, what, value[a]) if a in value else ()) for a in args}
    fields = _names(method, what, value)
    return dict.fromkeys(args, fields)


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
        if self.spec.streams:  # called in-process, a streaming method returns its rows
            return functools.partial(self.__call__, obj)
        return self.fn.__get__(obj, objtype)

    def __call__(self, role: Any, /, *args: P.args, **kwargs: P.kwargs) -> R:
        if self.spec.streams:
            from workers.host._streaming import drain

            return drain(self.fn(role, *args, **kwargs))  # type: ignore[arg-type,return-value]
        return self.fn(role, *args, **kwargs)

    def __repr__(self) -> str:
        return f"<endpoint {self.spec.name} {self.spec.protocol!r}>"


def register(
    *,
    protocol: TransferProtocol | None = None,
    reads: Reads = None,
    optional: Reads = None,
    writes: Writes = None,
    carries: str | None = None,
    row_lengths: str | None = None,
) -> Callable[[Callable[Concatenate[Any, P], R]], Endpoint[P, R]]:
    """Declare a role method callable through group proxies.

    Args:
        protocol: distribute/collect protocol (default ``DP()``).
        reads: fields the method needs from its data arguments: a sequence (for
            every data argument), a mapping from argument name to fields, or a
            function of :class:`CallInfo` returning either. A call whose input
            lacks one fails before anything runs. None pulls every column.
        optional: fields pulled too when the input has them (same forms).
        writes: fields of the rows the method returns (or a function of the call);
            a caller reading other fields fails at call time.
        carries: a data argument whose every column the method returns along with
            its own (e.g. ``generate`` keeps the prompts' ids and user columns); it is
            pulled whole and its fields join the output's.
        row_lengths: an output column (e.g. ``"attention_mask"``) whose per-row
            sum is published with the rows' metadata for token balancing.

    A generator method streams: it yields ``Chunk`` s of finished rows and
    ``Step`` s (see ``workers.Chunk``); callers may pass ``stream=True`` to get
    the rows micro-batch by micro-batch as they finish.

    Returns:
        A decorator producing an :class:`Endpoint`.

    Raises:
        ConfigError: a declaration is malformed.
    """
    proto = protocol if protocol is not None else DP()
    if not isinstance(proto, TransferProtocol):
        raise ConfigError(f"protocol must be a TransferProtocol instance, got {proto!r}")
    for what, value in (("reads", reads), ("optional", optional), ("writes", writes)):
        if isinstance(value, str):
            raise ConfigError(f"{what} must be a sequence of field names, not the string {value!r}")

    def decorate(fn: Callable[Concatenate[Any, P], R]) -> Endpoint[P, R]:
        sig = inspect.signature(fn)
        params = set(list(sig.parameters)[1:])
        for what, value in (("reads", reads), ("optional", optional)):
            if isinstance(value, Mapping) and set(value) - params:
                raise ConfigError(f"{fn.__qualname__}: {what} names unknown arguments {sorted(set(value) - params)}")
        if carries is not None and carries not in params:
            raise ConfigError(f"{fn.__qualname__}: carries={carries!r} is not an argument of the method")
        spec = MethodSpec(
            name=fn.__name__, protocol=proto, reads=_frozen(reads), optional=_frozen(optional),
            writes=writes if writes is None or callable(writes) else tuple(writes),
            carries=carries, row_lengths=row_lengths, signature=sig,
            data_parameters=frozenset(n for n, p in sig.parameters.items() if _is_batch(p.annotation)),
            streams=inspect.isgeneratorfunction(fn),
        )
        return Endpoint(fn, spec)

    return decorate


def _frozen(value: Reads) -> Reads:
    if value is None or callable(value):
        return value
    if isinstance(value, Mapping):
        return {k: tuple(v) for k, v in value.items()}
    return tuple(value)


def endpoints(cls: type) -> dict[str, Endpoint[Any, Any]]:
    """Every registered method of role class ``cls`` (inherited ones included)."""
    found: dict[str, Endpoint[Any, Any]] = {}
    for klass in reversed(cls.__mro__):
        for name, value in vars(klass).items():
            if isinstance(value, Endpoint):
                found[name] = value
    return found


def check_role_class(cls: type) -> None:
    """Raise :class:`ConfigError` unless ``cls`` can be hosted as a role."""
    if not isinstance(cls, type):
        raise ConfigError(f"a role must be a class, got {cls!r}")
    if not endpoints(cls):
        raise ConfigError(f"role class {cls.__qualname__} has no @register methods")
