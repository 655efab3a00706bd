"""Algorithms as plug-ins: one :class:`Algorithm` record each, registered the same
way for built-ins and third-party packages.

An algorithm is its config type (a msgspec Struct with a ``sampling:
SamplingConfig``), its roles (a :class:`RoleSet` subclass: required and optional
roles, each typed by the worker class it runs) and ``async def step(roles,
prompts, config, *, seed)``. Register it with the :func:`algorithm` decorator::

    class MyRoles(RoleSet):
        actor: RoleGroup[ActorWorker]
        reward: RoleGroup[RewardWorker]

    @algorithm("mine", config=MyConfig, roles=MyRoles)
    async def my_step(roles: MyRoles, prompts: DataFuture[Any], config: MyConfig, *,
                      seed: int | None = None) -> dict[str, float]:
        ...

What the step takes says what the trainer gives it (:class:`Algorithm` reads its
signature): ``stream`` (it streams, ``train.stream``), ``rollout`` (it trains on
samples generated ahead), ``more`` (it draws further prompt batches) and ``state``
(it carries state between steps, of the class its annotation names). Settings no
field checks alone are checked by the config's ``check(self)`` method; optional
roles are annotated ``RoleGroup[W] | None`` and the role set's :meth:`RoleSet.needed`
says which of them given settings need.

An installed package adds algorithms without touching asyncflow through the
``asyncflow.algorithms`` entry-point group (``[project.entry-points."asyncflow.algorithms"]
mine = "my_package.algo"``): :func:`algorithms` imports each entry point once,
which runs its decorators. ``asyncflow train`` then accepts ``[algorithm] name =
"mine"`` with ``MyConfig``'s keys beside it.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import types
import typing
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import msgspec

from asyncflow import RoleGroup
from asyncflow.algos._role_set import RoleSet
from channels import ConfigError

ENTRY_POINT_GROUP = "asyncflow.algorithms"
"""The entry-point group through which installed packages add algorithms."""

PromptSource = Callable[[], Awaitable[Any]]
"""Draws the next batch of training prompts (a ``DataFuture``), for algorithms that
sample more than one batch a step (a step that takes ``more``)."""

C = TypeVar("C", bound=msgspec.Struct)
F = TypeVar("F", bound=Callable[..., Awaitable[dict[str, float]]])


class StepState(Protocol):
    """What a step's ``state`` parameter is annotated with: a class whose
    :meth:`from_config` makes the state a run starts with. Checkpoints save it, so
    it must convert with ``msgspec.to_builtins`` (a dataclass or a Struct)."""

    @classmethod
    def from_config(cls, config: Any) -> Any:
        """The state before the first step."""
        ...


STEP_KEYWORDS = ("seed", "stream", "rollout", "more", "state")
"""The keywords the trainer passes a step that takes them."""


@dataclass(frozen=True, kw_only=True, eq=False)
class Algorithm(Generic[C]):
    """One registered algorithm (see the module docstring): what the trainer gives
    its step is read from the step's signature."""

    name: str
    """What ``[algorithm] name`` says."""
    config: type[C]
    """Its settings: a msgspec Struct with a ``sampling: SamplingConfig`` field, and
    optionally a ``check(self)`` method for the checks no field can make alone
    (raising ConfigError naming ``algorithm.<key>``)."""
    roles: type[RoleSet]
    """Its roles."""
    step: Callable[..., Awaitable[dict[str, float]]]
    """``async def step(roles, prompts, config, *, seed, [stream], [rollout],
    [more], [state])``: one step; returns its metrics."""
    takes: frozenset[str] = field(init=False)
    """The step's keyword parameters among :data:`STEP_KEYWORDS`."""
    state_type: type[StepState] | None = field(init=False)
    """The class of the state the step carries (its ``state`` annotation), if any."""

    def __post_init__(self) -> None:
        params = inspect.signature(self.step).parameters
        where = _where(self.step)
        if len([p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]) != 3:
            raise ConfigError(f"algorithm {self.name!r}: {where} must take (roles, prompts, config) positionally")
        for p in params.values():
            if p.kind is p.KEYWORD_ONLY and p.name not in STEP_KEYWORDS and p.default is p.empty:
                raise ConfigError(f"algorithm {self.name!r}: {where} takes keyword {p.name!r} without a default, "
                                  f"which the trainer never passes (it passes {', '.join(STEP_KEYWORDS)}); "
                                  "give it a default")
        object.__setattr__(self, "takes", frozenset(n for n in STEP_KEYWORDS if n in params))
        object.__setattr__(self, "state_type", _state_type(self.name, self.step) if "state" in params else None)

    @property
    def streams(self) -> bool:
        """``step`` takes ``stream=StreamOptions(...)`` (``train.stream``)."""
        return "stream" in self.takes

    @property
    def samples_ahead(self) -> bool:
        """``step`` takes ``rollout=``: the step's samples, generated ahead by a
        rollout role (``train.max_staleness``: possibly by an older policy), which
        the step uses instead of calling ``actor.generate``."""
        return "rollout" in self.takes

    @property
    def draws(self) -> bool:
        """``step`` takes ``more=``, a :data:`PromptSource` to draw further prompt
        batches (e.g. dynamic sampling); the trainer counts them in the data position."""
        return "more" in self.takes

    def initial_state(self, config: C) -> Any:
        """The state the step starts with (None when it carries none)."""
        return self.state_type.from_config(config) if self.state_type is not None else None

    def check(self, config: C) -> None:
        """The config's own ``check()`` (the settings no field can check alone), when
        its type has one.

        Raises:
            ConfigError: naming ``algorithm.<key>``.
        """
        check = getattr(config, "check", None)
        if callable(check):
            check()

    def needed_roles(self, config: C, *, also: Iterable[str] = ()) -> tuple[str, ...]:
        """The roles to place for ``config``: the required ones, the optional ones
        it needs (:meth:`RoleSet.needed`), and those of ``also`` that are optional
        roles of the algorithm."""
        optional = self.roles.optional()
        wanted = set(self.roles.needed(config)) | {r for r in also if r in optional}
        unknown = wanted - set(optional)
        if unknown:
            raise ConfigError(f"algorithm {self.name!r} needs roles {sorted(unknown)} it does not declare "
                              f"optional in {self.roles.__name__}")
        return (*self.roles.required(), *(r for r in optional if r in wanted))

    async def run_step(self, roles: Mapping[str, RoleGroup[Any]], prompts: Any, config: C, *,
                       seed: int | None, stream: Any = None, state: Any = None,
                       more: PromptSource | None = None, rollout: Any = None) -> dict[str, float]:
        """One step with the placed ``roles`` (passing ``stream``, ``state``,
        ``more`` and ``rollout`` when the step takes them).

        Raises:
            ConfigError: ``rollout`` or ``stream`` given to a step that does not
                take it, or a role the settings need is not placed.
        """
        kwargs: dict[str, Any] = {"seed": seed}
        if rollout is not None:
            if not self.samples_ahead:
                raise ConfigError(f"algorithm {self.name!r} samples in its step; it cannot train on samples "
                                  "generated ahead (train.max_staleness, a rollout role)")
            kwargs["rollout"] = rollout
        if stream is not None:
            if not self.streams:
                raise ConfigError(f"algorithm {self.name!r} does not stream")
            kwargs["stream"] = stream
        if "state" in self.takes:
            kwargs["state"] = state
        if self.draws:
            kwargs["more"] = more
        return await self.step(self.roles.of(roles, config=config, algorithm=self.name), prompts, config, **kwargs)


def _state_type(name: str, step: Callable[..., Any]) -> type[StepState]:
    """The class a step's ``state`` parameter is annotated with (``X`` or ``X | None``)."""
    try:
        hint = typing.get_type_hints(step)["state"]
    except Exception as e:
        raise ConfigError(f"algorithm {name!r}: the annotation of {_where(step)}'s state parameter does not "
                          f"resolve ({type(e).__name__}: {e}); import its class at module level") from e
    args = [a for a in typing.get_args(hint) if a is not type(None)] if typing.get_origin(hint) in (
        typing.Union, types.UnionType) else [hint]
    cls = args[0] if len(args) == 1 else None
    if not isinstance(cls, type) or not callable(getattr(cls, "from_config", None)):
        raise ConfigError(f"algorithm {name!r}: annotate {_where(step)}'s state parameter with a class that has a "
                          f"from_config(config) classmethod (the state a run starts with), not {hint}")
    return cls


_REGISTRY: dict[str, Algorithm[Any]] = {}
_loaded_entry_points = False


def register_algorithm(algo: Algorithm[Any]) -> Algorithm[Any]:
    """Add ``algo`` to the registry.

    Raises:
        ConfigError: another algorithm has its name, or its config has no
            ``sampling`` field.
    """
    held = _REGISTRY.get(algo.name)
    if held is not None and held.step is not algo.step:
        raise ConfigError(f"algorithm {algo.name!r} is registered twice: by {_where(held.step)} and "
                          f"{_where(algo.step)}; give one another name")
    if "sampling" not in algo.config.__struct_fields__:
        raise ConfigError(f"algorithm {algo.name!r}: its config {algo.config.__name__} needs a "
                          "`sampling: SamplingConfig` field (the trainer evaluates with its sampling)")
    _REGISTRY[algo.name] = algo
    _SECTIONS.pop(algo.name, None)
    return algo


def algorithm(name: str, *, config: type[C], roles: type[RoleSet]) -> Callable[[F], F]:
    """Register the decorated ``async def step`` as algorithm ``name`` with settings
    ``config`` and roles ``roles`` (see :class:`Algorithm`: what the step takes is
    read from its signature); returns the function unchanged.

    Raises:
        ConfigError: the step's signature is not one the trainer can call, or the
            algorithm is refused by :func:`register_algorithm`.
    """

    def decorate(step: F) -> F:
        register_algorithm(Algorithm(name=name, config=config, roles=roles, step=step))
        return step

    return decorate


def algorithms() -> dict[str, Algorithm[Any]]:
    """Every registered algorithm by name: the built-ins and, loaded once, those
    of installed packages' ``asyncflow.algorithms`` entry points.

    Raises:
        ConfigError: an entry point fails to load (naming it and its package).
    """
    global _loaded_entry_points
    import asyncflow.algos  # noqa: F401  (the built-ins register on import)

    if not _loaded_entry_points:
        _loaded_entry_points = True
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            try:
                loaded = ep.load()
            except Exception as e:
                dist = f" (package {ep.dist.name})" if ep.dist is not None else ""
                raise ConfigError(f"entry point {ep.name} = {ep.value!r}{dist} in group {ENTRY_POINT_GROUP} "
                                  f"failed to load: {type(e).__name__}: {e}") from e
            if isinstance(loaded, Algorithm):
                register_algorithm(loaded)
    return dict(_REGISTRY)


def get_algorithm(name: str) -> Algorithm[Any]:
    """The registered algorithm ``name``.

    Raises:
        ConfigError: no such algorithm (listing the registered ones).
    """
    found = algorithms().get(name)
    if found is None:
        raise ConfigError(f"algorithm.name = {name!r} is not a registered algorithm; registered: "
                          f"{sorted(algorithms())} (a package adds one through the {ENTRY_POINT_GROUP!r} "
                          "entry-point group)")
    return found


_SECTIONS: dict[str, type[msgspec.Struct]] = {}


def config_section(algo: Algorithm[Any]) -> type[msgspec.Struct]:
    """``algo.config`` tagged with its name (``name = "grpo"`` in ``[algorithm]``):
    a subclass, so its instances are ``algo.config`` instances."""
    section = _SECTIONS.get(algo.name)
    if section is None:
        section = msgspec.defstruct(algo.config.__name__, [], bases=(algo.config,), tag_field="name",
                                    tag=algo.name, module=algo.config.__module__)
        _SECTIONS[algo.name] = section
    return section


def algorithm_of(config: msgspec.Struct) -> Algorithm[Any]:
    """The algorithm whose settings ``config`` is (a tagged section, or an
    instance of a registered config type).

    Raises:
        ConfigError: ``config`` belongs to no registered algorithm.
    """
    registered = algorithms()
    tag = getattr(type(config).__struct_config__, "tag", None)
    if isinstance(tag, str) and tag in registered:
        return registered[tag]
    for algo in registered.values():
        if type(config) is algo.config:
            return algo
    raise ConfigError(f"{type(config).__name__} is the config of no registered algorithm "
                      f"(registered: {sorted(registered)})")


def _where(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}"
