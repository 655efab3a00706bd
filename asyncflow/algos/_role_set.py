"""An algorithm's roles as typed attributes: :class:`RoleSet`."""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

from asyncflow import RoleGroup
from channels import ConfigError

R = TypeVar("R", bound="RoleSet")


class RoleSet:
    """The roles an algorithm calls, as typed attributes.

    Subclass it with one annotation per role: ``actor: RoleGroup[ActorWorker]``
    is required; ``ref: RoleGroup[ReferenceWorker] | None`` is optional (None when
    not placed), and :meth:`needed` (overridden) says which optional roles given
    settings need. :meth:`of` binds the placed roles by name, so the algorithm
    reads ``roles.actor.generate(...)`` and mypy checks the call against the
    worker's method (with the ``asyncflow.mypy_plugin`` plugin).
    """

    def __init__(self, **groups: RoleGroup[Any] | None) -> None:
        slots = self.slots()
        unknown = set(groups) - set(slots)
        if unknown:
            raise ConfigError(f"{type(self).__name__} has no roles {sorted(unknown)}; its roles are {sorted(slots)}")
        for name in slots:
            setattr(self, name, groups.get(name))

    @classmethod
    def slots(cls) -> dict[str, tuple[type, bool]]:
        """Each role's worker class and whether it is required, in declaration order."""
        if cls not in _SLOTS:
            _SLOTS[cls] = _slots(cls)
        return dict(_SLOTS[cls])

    @classmethod
    def required(cls) -> tuple[str, ...]:
        """The roles the algorithm cannot run without."""
        return tuple(n for n, (_, req) in cls.slots().items() if req)

    @classmethod
    def optional(cls) -> tuple[str, ...]:
        """The roles the algorithm uses when they are placed."""
        return tuple(n for n, (_, req) in cls.slots().items() if not req)

    @classmethod
    def needed(cls, config: Any) -> Mapping[str, str]:
        """The optional roles ``config`` needs placed, each with the setting that
        needs it (e.g. ``{"ref": "algorithm.policy.kl_coef > 0"}``); none unless a
        subclass overrides it."""
        return {}

    @classmethod
    def of(cls: type[R], roles: R | Mapping[str, RoleGroup[Any]], *, config: Any = None, algorithm: str = "") -> R:
        """Bind placed roles by name (extra roles are ignored).

        Raises:
            ConfigError: a required role is missing, an optional one ``config``
                needs (:meth:`needed`) is missing, or a placed role runs a worker
                class other than the one declared.
        """
        who = algorithm or cls.__name__
        needed = cls.needed(config) if config is not None else {}
        if isinstance(roles, cls):
            unplaced = {n: why for n, why in needed.items() if getattr(roles, n) is None}
            if unplaced:
                raise ConfigError(_unplaced(who, unplaced))
            return roles
        assert isinstance(roles, Mapping)
        slots = cls.slots()
        missing = [n for n, (_, req) in slots.items() if req and n not in roles]
        if missing:
            raise ConfigError(f"{who} needs roles {list(cls.required())}; missing {missing} "
                              f"(placed: {sorted(roles)})")
        unplaced = {n: why for n, why in needed.items() if n not in roles}
        if unplaced:
            raise ConfigError(_unplaced(who, unplaced))
        for name, (worker, _) in slots.items():
            group = roles.get(name)
            runs = getattr(group, "worker_class", None)
            if isinstance(runs, type) and worker is not object and not issubclass(runs, worker):
                raise ConfigError(f"{who}: role {name!r} must run a {worker.__name__}, but it runs "
                                  f"{runs.__name__}")
        return cls(**{n: roles[n] for n in slots if n in roles})


def _unplaced(who: str, unplaced: Mapping[str, str]) -> str:
    needs = "; ".join(f"role {n!r} ({why})" for n, why in unplaced.items())
    return f"{who} with these settings needs {needs} placed; place it or change the setting"


_SLOTS: dict[type, dict[str, tuple[type, bool]]] = {}
"""Each role set's :meth:`RoleSet.slots`, read from its annotations once (every
step binds its roles)."""


def _slots(cls: type) -> dict[str, tuple[type, bool]]:
    """:meth:`RoleSet.slots` from ``cls``'s annotations."""
    out: dict[str, tuple[type, bool]] = {}
    for name, hint in typing.get_type_hints(cls).items():
        args = typing.get_args(hint)
        origin = typing.get_origin(hint)
        required = origin is RoleGroup
        if origin in (typing.Union, types.UnionType):
            inner = [a for a in args if a is not type(None)]
            if len(inner) != 1 or typing.get_origin(inner[0]) is not RoleGroup or len(args) != 2:
                raise ConfigError(f"{cls.__name__}.{name}: annotate a role as RoleGroup[Worker] or "
                                  f"RoleGroup[Worker] | None, not {hint}")
            args = typing.get_args(inner[0])
        elif not required:
            continue  # not a role (a helper attribute)
        worker = args[0] if args else object
        out[name] = (worker if isinstance(worker, type) else object, required)
    return out
