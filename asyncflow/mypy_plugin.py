"""A mypy plugin that type-checks calls through role groups.

``RoleGroup.__getattr__`` finds a role's methods at run time, so to a plain type
checker ``roles.actor.generat(prompts, nn=2)`` is fine. With this plugin,
``RoleGroup[W].<name>`` is looked up on the role class ``W``:

- a method registered with ``@register`` (an ``Endpoint[P, R]``) becomes a callable
  with the method's parameters (``self`` left out), where a data argument (annotated
  ``Batch`` or ``Batch | None``) takes a ``DataFuture`` or ``DataStream`` instead;
  a generator (streaming) method gets the keyword ``stream: bool | StreamOptions |
  None = None``, and every method ``timeout_s: float | None = None`` (unless it
  has parameters of those names);
- the call returns ``DataFuture[BatchMeta]`` for a method returning rows (a mapping
  of tensors, a ``Batch``, or a streaming generator) and ``DataFuture[R]`` for
  others (``await roles.actor.update(batch)`` is then ``dict[str, float]``); a
  ``DataStream`` instead when the call streams (``stream=True`` or
  ``StreamOptions``, or a data argument is a stream), and either when that
  depends on a value's type (``stream: StreamOptions | None``);
- any other name is an error naming the role class and its registered methods.

``RoleGroup[Any]`` (what ``Roles`` gives, by name or attribute) is not checked, and
the group's own attributes (``name``, ``layout``, ``pool``, ``config``,
``rank_local``) keep their types. Enable it in the mypy configuration::

    [tool.mypy]
    plugins = ["asyncflow.mypy_plugin"]
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from mypy import errorcodes as codes
from mypy.maptype import map_instance_to_supertype
from mypy.nodes import ARG_NAMED_OPT, ARG_STAR2, CallExpr, Decorator, RefExpr, TypeInfo
from mypy.plugin import AttributeContext, MethodContext, Plugin
from mypy.types import (
    AnyType,
    CallableType,
    Instance,
    LiteralType,
    NoneType,
    Parameters,
    Type,
    TypeOfAny,
    UnionType,
    get_proper_type,
)

ROLE_GROUP = "asyncflow.runtime._proxy.RoleGroup"
ENDPOINT = "workers.host._register.Endpoint"
REGISTER = "workers.host._register.register"
BATCH = "channels._batch.Batch"
BATCH_META = "channels._schema.BatchMeta"
DATA_FUTURE = "asyncflow.runtime._future.DataFuture"
DATA_STREAM = "asyncflow.runtime._datastream.DataStream"
STREAM_OPTIONS = "asyncflow.runtime._datastream.StreamOptions"
TENSOR = "torch._tensor.Tensor"
MAPPING = "typing.Mapping"


@dataclass(frozen=True)
class _Method:
    """What the plugin knows of one registered method."""

    name: str
    params: Parameters | CallableType
    """The method's parameters without ``self`` (``P`` of ``Endpoint[P, R]``)."""
    ret: Type
    """What the method returns (``R``)."""
    streams: bool
    """A generator method: it reports rows as they finish and takes ``stream=``."""

    @property
    def adds_stream(self) -> bool:
        """Whether the driver adds the ``stream`` keyword (the method has none of its own)."""
        return self.streams and "stream" not in self.params.arg_names

    def data_args(self) -> set[str]:
        """The parameters annotated ``Batch`` or ``Batch | None``."""
        return {n for n, t in zip(self.params.arg_names, self.params.arg_types, strict=True)
                if n is not None and _is_batch(t)}


class RoleGroupPlugin(Plugin):
    """Types ``RoleGroup[W].<method>`` from role class ``W``'s registered methods."""

    def get_attribute_hook(self, fullname: str) -> Callable[[AttributeContext], Type] | None:
        """The type of ``group.<name>`` (mypy asks for every attribute of a class with
        ``__getattr__``)."""
        owner, _, name = fullname.rpartition(".")
        if owner != ROLE_GROUP or name.startswith("_"):
            return None
        return partial(self._attribute, name)

    def get_method_hook(self, fullname: str) -> Callable[[MethodContext], Type] | None:
        """The result of ``group.<name>(...)``: a stream when the call streams."""
        owner, _, name = fullname.rpartition(".")
        if owner != ROLE_GROUP or name.startswith("_"):
            return None
        return partial(self._call_result, name)

    # ----- group.<name> -----

    def _attribute(self, name: str, ctx: AttributeContext) -> Type:
        role = _role_class(ctx.type, name)
        if role is None:
            return ctx.default_attr_type
        methods = _registered(role)
        if methods is None:  # a method's type is not inferred yet: nothing to check against
            return ctx.default_attr_type
        method = methods.get(name)
        if method is None:
            ctx.api.fail(_unknown_method(role, name, methods), ctx.context, code=codes.ATTR_DEFINED)
            return AnyType(TypeOfAny.from_error)
        signature = self._signature(role, method, ctx)
        return signature if signature is not None else ctx.default_attr_type

    def _signature(self, role: TypeInfo, method: _Method, ctx: AttributeContext) -> CallableType | None:
        future, stream, options = (self._info(n) for n in (DATA_FUTURE, DATA_STREAM, STREAM_OPTIONS))
        meta = self._info(BATCH_META)
        if future is None or stream is None or options is None or meta is None:
            return None  # asyncflow's types are not loaded: leave the call unchecked
        any_ = AnyType(TypeOfAny.special_form)
        data = UnionType.make_union([Instance(future, [any_]), Instance(stream, [any_])])
        params = method.params
        kinds, names = list(params.arg_kinds), list(params.arg_names)
        types = [_replace_batch(t, data) for t in params.arg_types]
        if method.adds_stream:
            at = next((i for i, k in enumerate(kinds) if k == ARG_STAR2), len(kinds))
            kinds.insert(at, ARG_NAMED_OPT)
            names.insert(at, "stream")
            types.insert(at, UnionType.make_union([
                ctx.api.named_generic_type("builtins.bool", []), Instance(options, []), NoneType()]))
        if "timeout_s" not in names:  # the driver's per-call timeout
            at = next((i for i, k in enumerate(kinds) if k == ARG_STAR2), len(kinds))
            kinds.insert(at, ARG_NAMED_OPT)
            names.insert(at, "timeout_s")
            types.insert(at, UnionType.make_union([ctx.api.named_generic_type("builtins.float", []), NoneType()]))
        result = Instance(meta, []) if method.streams or _returns_rows(method.ret) else method.ret
        return CallableType(types, kinds, names, Instance(future, [result]),
                            fallback=ctx.api.named_generic_type("builtins.function", []),
                            name=f"{method.name} of {role.name}")

    # ----- group.<name>(...) -----

    def _call_result(self, name: str, ctx: MethodContext) -> Type:
        default = get_proper_type(ctx.default_return_type)
        role = _role_class(ctx.type, name)
        stream = self._info(DATA_STREAM)
        if role is None or stream is None or not isinstance(default, Instance) or default.type.fullname != DATA_FUTURE:
            return ctx.default_return_type
        method = (_registered(role) or {}).get(name)
        if method is None:
            return ctx.default_return_type
        data = method.data_args()
        modes: list[bool | str | None] = []
        for formal, actuals in zip(ctx.callee_arg_names, ctx.arg_types, strict=True):
            if formal in data:
                modes.extend(_streams(t, stream) for t in actuals)
            elif formal == "stream" and method.adds_stream:
                modes.extend(_stream_option(t) for t in actuals)
        as_stream = Instance(stream, list(default.args))
        if True in modes:
            return as_stream
        if "any" in modes:  # an argument of type Any: no telling which
            return AnyType(TypeOfAny.special_form)
        if None in modes:
            return UnionType.make_union([default, as_stream])
        return default

    def _info(self, fullname: str) -> TypeInfo | None:
        sym = self.lookup_fully_qualified(fullname)
        return sym.node if sym is not None and isinstance(sym.node, TypeInfo) else None


def _role_class(group: Type, name: str) -> TypeInfo | None:
    """``W`` of ``RoleGroup[W]`` when it is a class and ``name`` is not one of the
    group's own attributes; None otherwise (then nothing is checked)."""
    group = get_proper_type(group)
    if not isinstance(group, Instance) or group.type.get(name) is not None:
        return None
    base = next((b for b in group.type.mro if b.fullname == ROLE_GROUP), None)
    if base is None:
        return None
    args = map_instance_to_supertype(group, base).args
    role = get_proper_type(args[0]) if args else None
    return role.type if isinstance(role, Instance) else None


def _registered(role: TypeInfo) -> dict[str, _Method] | None:
    """The registered methods of ``role``, inherited ones included (as
    ``workers.endpoints`` finds them at run time); None when a decorated method's
    type is not inferred yet."""
    found: dict[str, _Method] = {}
    for klass in reversed(role.mro):
        for name, sym in klass.names.items():
            node = sym.node
            if not isinstance(node, Decorator):
                continue
            if node.var.type is None:
                if _is_registration(node):
                    return None
                continue
            endpoint = get_proper_type(node.var.type)
            if not isinstance(endpoint, Instance) or endpoint.type.fullname != ENDPOINT or len(endpoint.args) != 2:
                continue
            params = get_proper_type(endpoint.args[0])
            if isinstance(params, Parameters | CallableType):
                found[name] = _Method(name=name, params=params, ret=endpoint.args[1],
                                      streams=node.func.is_generator)
    return found


def _is_registration(node: Decorator) -> bool:
    """Whether ``node`` is decorated ``@register(...)`` (as written in the source)."""
    return any(isinstance(d, CallExpr) and isinstance(d.callee, RefExpr) and d.callee.fullname == REGISTER
               for d in node.original_decorators)


def _unknown_method(role: TypeInfo, name: str, methods: dict[str, _Method]) -> str:
    listed = ", ".join(sorted(methods)) or "none"
    close = difflib.get_close_matches(name, list(methods), n=1)
    hint = f' (did you mean "{close[0]}"?)' if close else ""
    what = ("is not registered (decorate it with @register to call it through a group)"
            if role.get(name) is not None else "is not a registered method")
    return f'"{name}" of role class "{role.name}" {what}{hint}; its registered methods are: {listed}'


def _is_batch(t: Type) -> bool:
    t = get_proper_type(t)
    if isinstance(t, UnionType):
        items = [get_proper_type(i) for i in t.items]
        return any(_is_batch(i) for i in items) and all(_is_batch(i) or isinstance(i, NoneType) for i in items)
    return isinstance(t, Instance) and t.type.fullname == BATCH


def _replace_batch(t: Type, data: Type) -> Type:
    """A data argument's type for the driver: ``Batch`` becomes ``data``."""
    if not _is_batch(t):
        return t
    proper = get_proper_type(t)
    if isinstance(proper, UnionType):
        return UnionType.make_union([_replace_batch(i, data) for i in proper.items])
    return data


def _returns_rows(ret: Type) -> bool:
    """Whether a method returning ``ret`` returns rows (a mapping of tensors)."""
    ret = get_proper_type(ret)
    if not isinstance(ret, Instance) or not ret.type.has_base(MAPPING):
        return False
    mapping = next(b for b in ret.type.mro if b.fullname == MAPPING)
    value = get_proper_type(map_instance_to_supertype(ret, mapping).args[1])
    return isinstance(value, Instance) and value.type.has_base(TENSOR)


def _streams(t: Type, stream: TypeInfo) -> bool | str | None:
    """Whether a data argument of type ``t`` is a stream: True, False, None (it may
    be) or "any" (type Any)."""
    t = get_proper_type(t)
    if isinstance(t, AnyType):
        return "any"
    if isinstance(t, UnionType):
        return _one({_streams(i, stream) for i in t.items})
    return isinstance(t, Instance) and t.type.has_base(stream.fullname)


def _stream_option(t: Type) -> bool | str | None:
    """Whether ``stream=`` of type ``t`` makes the call stream (as :func:`_streams`)."""
    t = get_proper_type(t)
    if isinstance(t, AnyType):
        return "any"
    if isinstance(t, UnionType):
        return _one({_stream_option(i) for i in t.items})
    if isinstance(t, Instance) and t.last_known_value is not None:
        t = t.last_known_value
    if isinstance(t, LiteralType):
        return bool(t.value)
    if isinstance(t, NoneType):
        return False
    if isinstance(t, Instance) and t.type.fullname == STREAM_OPTIONS:
        return True
    return None  # bool


def _one(modes: set[bool | str | None]) -> bool | str | None:
    if "any" in modes:
        return "any"
    return modes.pop() if len(modes) == 1 else None


def plugin(version: str) -> type[Plugin]:
    """mypy's entry point: the plugin class (any mypy 1.x/2.x version)."""
    return RoleGroupPlugin
