"""A typed algorithm with three mistakes that asyncflow's mypy plugin must report
(``tests/asyncflow/test_typed_roles.py`` runs mypy on it and expects exactly the
errors marked ``# error``). Not type-checked by ``make test``'s mypy line."""

from __future__ import annotations

from typing import Any

from asyncflow import DataFuture, RoleGroup
from workers.roles import ActorWorker, CriticWorker


class Roles:
    """An algorithm's roles, declared with the role class each group runs."""

    actor: RoleGroup[ActorWorker]
    critic: RoleGroup[CriticWorker]


async def step(roles: Roles, prompts: DataFuture[Any]) -> None:
    """A misspelt method, an unknown keyword and a timeout that is not seconds."""
    rollout = roles.actor.generat(prompts, n=2)  # error: misspelt method
    roles.critic.values(rollout)
    roles.actor.generate(prompts, nn=2)  # error: unknown keyword
    roles.actor.generate(prompts, timeout_s="soon")  # error: timeout_s is seconds
