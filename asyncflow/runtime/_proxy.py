"""Role-group proxies: ``roles.actor.generate(...)`` on the driver submits a call to
every rank of the role's pool and returns a :class:`DataFuture` at once.

``RoleGroup[W]`` is generic in the role class it runs, so an algorithm can declare
its roles and have them type-checked with the project's mypy plugin
(``asyncflow.mypy_plugin``)::

    class PPORoles:
        actor: RoleGroup[ActorWorker]
        critic: RoleGroup[CriticWorker]

    rollout = roles.actor.generate(prompts, n=2)   # DataFuture[BatchMeta]
    roles.actor.generat(prompts)                   # mypy: no registered method "generat"
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from asyncflow.runtime._calls import CallArgumentError
from asyncflow.runtime._pool import ResourcePool, RoleSpec
from channels import Layout
from workers import Endpoint, Role, endpoints

if TYPE_CHECKING:
    # Not used here: imported so that mypy loads the types the plugin builds a
    # method's signature from (asyncflow.mypy_plugin) whenever it loads this module.
    from asyncflow.runtime._datastream import DataStream, StreamOptions  # noqa: F401
    from asyncflow.runtime._future import DataFuture  # noqa: F401
    from channels import Batch, BatchMeta  # noqa: F401

W = TypeVar("W", bound=Role)
"""The role class a group runs."""

Submit = Callable[["RoleGroup[Any]", Endpoint[Any, Any], tuple[Any, ...], Mapping[str, Any]], Any]
"""Submits a call of a group's method (the session's)."""


class RoleGroup(Generic[W]):
    """The driver-side proxy of one role: ``group.method(...)`` submits the call to
    every rank of the role's pool and returns a :class:`DataFuture` at once (a
    ``DataStream`` when an argument is a stream or the call has ``stream=...``).
    ``timeout_s=...`` (seconds, unless the method takes its own ``timeout_s``) bounds
    how long the call may run once started: past it the call fails with
    :class:`~asyncflow.CallTimeoutError` and its pool is broken.

    ``W`` is the role class. With the mypy plugin on, ``RoleGroup[ActorWorker]``'s
    methods type-check against ``ActorWorker``'s registered methods (data arguments
    take futures or streams; the result is a future); ``RoleGroup[Any]`` (what
    ``Roles`` gives) is not checked.
    """

    def __init__(self, submit: Submit, name: str, spec: RoleSpec, layout: Layout,
                 rank_local: frozenset[str] = frozenset()) -> None:
        self._submit, self._name, self._spec, self._layout = submit, name, spec, layout
        self._endpoints = endpoints(spec.cls)
        self.rank_local = rank_local
        """Methods that use no other rank: they may run on some of the pool's ranks."""

    @property
    def name(self) -> str:
        """The role's name."""
        return self._name

    @property
    def layout(self) -> Layout:
        """The role's parallel layout."""
        return self._layout

    @property
    def pool(self) -> ResourcePool:
        """The pool hosting the role."""
        return self._spec.pool

    @property
    def worker_class(self) -> type[W]:
        """The Role class each rank runs (``RoleSpec.cls``)."""
        cls: type[W] = self._spec.cls
        return cls

    @property
    def config(self) -> Any:
        """The role's config object (``RoleSpec.config``)."""
        return self._spec.config

    def __getattr__(self, method: str) -> Any:
        if method.startswith("_"):
            raise AttributeError(method)
        endpoint = self._endpoints.get(method)
        if endpoint is None:
            raise AttributeError(
                f"{self._describe()} has no registered method {method!r}; it has {sorted(self._endpoints)} "
                "(register a method with @register on the role class to call it through the group)"
            )

        return Stage(self, method, endpoint)

    def _describe(self) -> str:
        return f"role {self._name!r} ({self._spec.cls.__qualname__})"

    def __repr__(self) -> str:
        return f"<RoleGroup {self._name} on {self._spec.pool.name} {self._layout}>"


class Stage:
    """``group.<method>``: one registered method of a role group, bound to the group.
    Calling it submits the call (``group.method(...)`` is ``Stage(...)(...)``);
    :attr:`group` and :attr:`method` say which stage it is, for helpers that take a
    stage and call it themselves (``asyncflow.algos.Feed``)."""

    def __init__(self, group: RoleGroup[Any], method: str, endpoint: Endpoint[Any, Any]) -> None:
        self.group, self.method, self._endpoint = group, method, endpoint
        self.__name__ = method
        self.__doc__ = endpoint.__doc__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        group = self.group
        try:
            return group._submit(group, self._endpoint, args, kwargs)
        except CallArgumentError as e:
            raise CallArgumentError(f"{e}; {group._describe()} has registered methods "
                                    f"{sorted(group._endpoints)}") from None

    def __repr__(self) -> str:
        return f"<Stage {self.group.name}.{self.method}>"


class Roles(Mapping[str, "RoleGroup[Any]"]):
    """The spawned roles, by name and as attributes (``roles.actor``). Their
    groups are ``RoleGroup[Any]``: declare a class of typed groups to have an
    algorithm's calls type-checked (see :class:`RoleGroup`)."""

    def __init__(self, groups: Mapping[str, RoleGroup[Any]]) -> None:
        self._groups = dict(groups)

    def __getattr__(self, name: str) -> RoleGroup[Any]:
        try:
            return self._groups[name]
        except KeyError:
            raise AttributeError(f"no role {name!r}; roles are {sorted(self._groups)}") from None

    def __getitem__(self, name: str) -> RoleGroup[Any]:
        return self._groups[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._groups)

    def __len__(self) -> int:
        return len(self._groups)
