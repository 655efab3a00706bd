"""The algorithm registry: role sets, registration, the config's tagged union, and
RLOO's leave-one-out baseline. No Ray."""

from __future__ import annotations

import pytest
import torch

from asyncflow import RoleGroup
from asyncflow.algos import (
    GRPOConfig,
    RLOOConfig,
    RoleSet,
    RolloutConfig,
    algorithm,
    algorithm_of,
    algorithms,
    config_section,
    get_algorithm,
    leave_one_out,
)
from channels import ConfigError
from workers.roles import ActorWorker, CriticWorker, RewardWorker


class TwoRoles(RoleSet):
    actor: RoleGroup[ActorWorker]
    ref: RoleGroup[CriticWorker] | None
    note: str = "not a role"


def test_role_set_reads_required_and_optional_roles_from_annotations() -> None:
    assert TwoRoles.required() == ("actor",) and TwoRoles.optional() == ("ref",)
    assert TwoRoles.slots()["actor"] == (ActorWorker, True)
    bound = TwoRoles.of({"actor": "A", "reward": "ignored"}, algorithm="Mine")  # type: ignore[dict-item]
    assert bound.actor == "A" and bound.ref is None
    with pytest.raises(ConfigError, match=r"TwoRoles needs roles \['actor'\]; missing \['actor'\] \(placed: \['ref'\]\)"):
        TwoRoles.of({"ref": "R"})  # type: ignore[dict-item]


def test_role_set_refuses_a_role_that_runs_another_worker_class() -> None:
    class Group:
        worker_class = RewardWorker

    with pytest.raises(ConfigError, match="role 'actor' must run a ActorWorker, but it runs RewardWorker"):
        TwoRoles.of({"actor": Group()})  # type: ignore[dict-item]


def test_built_ins_are_registered_and_a_name_is_taken_once() -> None:
    found = algorithms()
    assert {"grpo", "ppo", "remax", "safe_rlhf", "rloo"} <= set(found)
    assert found["ppo"].streams and not found["remax"].streams and found["safe_rlhf"].state is not None
    with pytest.raises(ConfigError, match="registered twice"):
        @algorithm("grpo", config=GRPOConfig, roles=TwoRoles)
        async def other(roles, prompts, config, *, seed=None):  # type: ignore[no-untyped-def]
            return {}
    with pytest.raises(ConfigError, match=r"'nope' is not a registered algorithm; registered: \[.*'grpo'"):
        get_algorithm("nope")


def test_a_config_without_rollout_is_refused_at_registration() -> None:
    import msgspec

    class NoRollout(msgspec.Struct):
        x: int = 0

    with pytest.raises(ConfigError, match="needs a `rollout: RolloutConfig` field"):
        @algorithm("no_rollout", config=NoRollout, roles=TwoRoles)
        async def step(roles, prompts, config, *, seed=None):  # type: ignore[no-untyped-def]
            return {}


def test_sections_are_tagged_subclasses_that_name_their_algorithm() -> None:
    rloo = get_algorithm("rloo")
    section = config_section(rloo)
    made = section(rollout=RolloutConfig(n=3))
    assert isinstance(made, RLOOConfig) and algorithm_of(made) is rloo
    assert algorithm_of(RLOOConfig()) is rloo  # an untagged instance of a registered config
    assert rloo.needed_roles(RLOOConfig()) == ("actor", "reward")
    assert rloo.needed_roles(RLOOConfig(), also=("ref", "critic")) == ("actor", "reward", "ref")


def test_leave_one_out_baseline() -> None:
    scores = torch.tensor([1.0, 0.0, 0.0, 2.0, 4.0, 7.0])
    groups = torch.tensor([5, 5, 5, 9, 9, 3])
    got = leave_one_out(scores, groups)
    # group 5: 1 - 0, 0 - 0.5, 0 - 0.5; group 9: 2 - 4, 4 - 2; a group of one: 0
    assert torch.allclose(got, torch.tensor([1.0, -0.5, -0.5, -2.0, 2.0, 0.0]))
    # k / (k - 1) times the deviation from the group mean
    assert torch.allclose(got[:3], 3 / 2 * (scores[:3] - scores[:3].mean()))


def test_the_docs_example_is_the_plugin_package() -> None:
    from pathlib import Path

    root = Path(__file__).parents[2]
    page = (root / "docs" / "algorithms.md").read_text()
    section = page[page.index("## Write your own algorithm"):]
    block = section[section.index("```python\n") + len("```python\n"):]
    block = block[:block.index("```")]
    source = (root / "tests" / "plugin" / "af_plugin_demo" / "__init__.py").read_text()
    assert block == source[source.index("from __future__"):]
