"""A submitted group call: its arguments bound and checked, its field contract,
and which columns it pulls of each input.

Everything here runs on the driver from metadata: a call whose input lacks a
field it reads fails here, at submit, before anything runs.
"""

from __future__ import annotations

import asyncio
import difflib
import inspect
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from asyncflow.runtime._future import DataFuture
from asyncflow.runtime._resolved import Resolved
from channels import AsyncflowError, Layout, MissingFieldError
from workers import CallInfo, Endpoint, FieldContract

_call_ids = itertools.count(1)


class CallArgumentError(AsyncflowError, TypeError):
    """A group call's arguments do not fit the role method's signature (raised at
    submit, before anything runs; the message shows the signature and the fix). A
    ``TypeError``, as Python raises for a direct call."""


@dataclass(eq=False, kw_only=True)
class Call:
    """A submitted call waiting for (or running on) its pool."""

    call_id: int
    role: str
    endpoint: Endpoint[Any, Any]
    layout: Layout
    contract: FieldContract
    data_args: dict[str, DataFuture[Any]]
    kwargs: dict[str, Any]
    result: asyncio.Future[Any]
    rank_local: bool = False
    """The method uses no other rank (``Role.rank_local``): it may run on some of
    the pool's ranks only."""
    stream: Any = None
    """The call's ``StreamOptions`` when it streams its rows."""
    timeout_s: float | None = None
    """Seconds the call may run once started (its ``timeout_s=`` option); None: no limit."""
    stream_out: Any = None
    """The ``DataStream`` a streamed call feeds."""
    inputs: dict[str, Any] | None = None
    """The data arguments' resolved metadata, once they exist."""
    place: tuple[int, int] = (0, 0)
    """Where the call joined its pool's queue, in the session's queue order: its
    own place, or its stream's slot's place and its number in the stream."""

    @property
    def method(self) -> str:
        """The role method's name."""
        return self.endpoint.spec.name

    @property
    def label(self) -> str:
        """``role.method#id``, as errors and futures name the call."""
        return f"{self.role}.{self.method}#{self.call_id}"

    @property
    def out_key(self) -> str:
        """The shard key of the rows the call produces (names the call, so that a
        consumer's error can name the producer)."""
        return self.label

    def depends_on(self, futures: set[int], calls: set[int]) -> bool:
        """Whether an input is one of ``futures`` (by id) or derives from ``calls``."""
        return any(id(f) in futures or f._calls & calls for f in self.data_args.values())


def bind_call(*, role: str, config: Any, endpoint: Endpoint[Any, Any], layout: Layout,
              args: Sequence[Any], kwargs: Mapping[str, Any], loop: asyncio.AbstractEventLoop,
              rank_local: bool = False) -> Call:
    """Bind a proxy call's arguments and check its inputs' fields.

    Raises:
        CallArgumentError: the arguments do not fit the method's signature.
        MissingFieldError: an input lacks a field the method reads.
    """
    spec = endpoint.spec
    try:
        bound = spec.signature.bind(None, *args, **kwargs)
    except TypeError as e:
        raise CallArgumentError(_argument_error(role, endpoint, kwargs, e)) from None
    arguments = dict(bound.arguments)
    arguments.pop(next(iter(spec.signature.parameters)))  # self
    _check_data_arguments(role, endpoint, arguments)
    data = {k: v for k, v in arguments.items() if isinstance(v, DataFuture)}
    plain = {k: v for k, v in arguments.items() if k not in data}
    contract = spec.contract(CallInfo(config=config, arguments=arguments), data)
    call = Call(call_id=next(_call_ids), role=role, endpoint=endpoint, layout=layout, contract=contract,
                data_args=data, kwargs=plain, result=loop.create_future(), rank_local=rank_local)
    _check_known_fields(call)
    return call


def _check_data_arguments(role: str, endpoint: Endpoint[Any, Any], arguments: Mapping[str, Any]) -> None:
    """Refuse rows, tensors or anything else but a future (or None) for a data
    argument: its rows reach the ranks from where they were made, never through the
    driver.

    Raises:
        CallArgumentError: naming the argument, what was passed and how to make a future.
    """
    for name in endpoint.spec.data_parameters:
        value = arguments.get(name)
        if value is None or isinstance(value, DataFuture):
            continue
        raise CallArgumentError(
            f"{role}.{endpoint.spec.name}: {name} is a data argument (annotated Batch), so it takes a DataFuture "
            f"(a call's result, or `await session.put(rows, pool=...)` for rows the driver has) or a DataStream, "
            f"not a {type(value).__name__}"
        )


def _argument_error(role: str, endpoint: Endpoint[Any, Any], kwargs: Mapping[str, Any], e: TypeError) -> str:
    """``role.method(signature): what is wrong; the fix``."""
    params = list(endpoint.spec.signature.parameters.values())[1:]  # without self
    shown = inspect.Signature([p.replace(annotation=_Source(p.annotation)) if isinstance(p.annotation, str)
                               else p for p in params])
    reason, hint = str(e), "pass the arguments that signature names (data arguments as futures or streams)"
    names = [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    unknown = [] if any(p.kind is p.VAR_KEYWORD for p in params) else [k for k in kwargs if k not in names]
    if unknown:  # named first: Python's own message may be about another argument
        reason = f"unexpected keyword argument{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}"
        close = difflib.get_close_matches(unknown[0], names, n=1)
        hint = f"did you mean {close[0]}=?" if close else f"its arguments are {names}"
    return f"{role}.{endpoint.spec.name}{shown}: {reason}; {hint}"


class _Source:
    """An annotation's source text, shown as written (not as a quoted string)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _check_known_fields(call: Call) -> None:
    for name, fut in call.data_args.items():
        if fut.fields is None:
            continue
        missing = [f for f in call.contract.required.get(name, ()) if f not in fut.fields]
        if missing:
            raise MissingFieldError(
                f"{call.label} reads field {missing[0]!r} but its argument {name!r} ({fut.label}) "
                f"carries only {sorted(fut.fields)}"
            )


def output_fields(call: Call) -> frozenset[str] | None:
    """The fields the call's rows will carry, when known at submit."""
    writes = call.contract.writes
    if writes is None:
        return None
    carried: frozenset[str] = frozenset()
    if call.contract.carries is not None:
        source = call.data_args.get(call.contract.carries)
        if source is not None:
            if source.fields is None:
                return None
            carried = source.fields
    return carried | frozenset(writes)


def pull_fields(call: Call, name: str, r: Resolved) -> tuple[str, ...] | None:
    """Columns of data argument ``name`` to pull (None: all), accounting for the
    transforms that run on the rows first.

    Raises:
        MissingFieldError: the rows lack a field the method or a transform reads.
    """
    have = set(r.meta.field_names)
    made: set[str] = set()
    transform_reads: list[str] = []
    for t in r.transforms:
        if t.writes is None or t.reads is None:
            return None  # an undeclared transform may read anything
        transform_reads.extend(f for f in t.reads if f not in made)
        transform_reads.extend(f for f in t.optional if f not in made and f in have)
        made |= set(t.writes)
    for f in call.contract.required.get(name, ()):
        if f not in have | made:
            raise MissingFieldError(
                f"{call.label} reads field {f!r} but its argument {name!r} "
                f"({call.data_args[name].label}) has only {sorted(have | made)}"
            )
    wanted = call.contract.pulls(name, have | made)
    if wanted is None:
        return None
    needed = [f for f in (*wanted, *transform_reads) if f not in made]
    for f in needed:
        if f not in have:
            raise MissingFieldError(
                f"{call.label}: a transform on argument {name!r} ({call.data_args[name].label}) reads "
                f"field {f!r}, which the rows lack (they have {sorted(have)})"
            )
    return tuple(dict.fromkeys(needed))
