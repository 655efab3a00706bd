"""Role-group proxies: ``roles.actor.generate(...)`` on the driver submits a call to
every rank of the role's pool and returns a :class:`DataFuture` at once."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from asyncflow._pool import ResourcePool, RoleSpec
from channels import Layout
from workers import Endpoint, endpoints

Submit = Callable[["RoleGroup", Endpoint[Any, Any], tuple[Any, ...], Mapping[str, Any]], Any]
"""Submits a call of a group's method (the session's)."""


class RoleGroup:
    """The driver-side proxy of one role: ``group.method(...)`` submits the call to
    every rank of the role's pool and returns a :class:`DataFuture` at once (a
    ``DataStream`` when an argument is a stream or the call has ``stream=...``)."""

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
    def config(self) -> Any:
        """The role's config object (``RoleSpec.config``)."""
        return self._spec.config

    def __getattr__(self, method: str) -> Any:
        if method.startswith("_"):
            raise AttributeError(method)
        endpoint = self._endpoints.get(method)
        if endpoint is None:
            raise AttributeError(
                f"role {self._name!r} ({self._spec.cls.__qualname__}) has no registered method {method!r}; "
                f"it has {sorted(self._endpoints)}"
            )

        def submit(*args: Any, **kwargs: Any) -> Any:
            return self._submit(self, endpoint, args, kwargs)

        submit.__doc__ = endpoint.__doc__
        submit.__name__ = method
        return submit

    def __repr__(self) -> str:
        return f"<RoleGroup {self._name} on {self._spec.pool.name} {self._layout}>"


class Roles(Mapping[str, RoleGroup]):
    """The spawned roles, by name and as attributes (``roles.actor``)."""

    def __init__(self, groups: Mapping[str, RoleGroup]) -> None:
        self._groups = dict(groups)

    def __getattr__(self, name: str) -> RoleGroup:
        try:
            return self._groups[name]
        except KeyError:
            raise AttributeError(f"no role {name!r}; roles are {sorted(self._groups)}") from None

    def __getitem__(self, name: str) -> RoleGroup:
        return self._groups[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._groups)

    def __len__(self) -> int:
        return len(self._groups)
