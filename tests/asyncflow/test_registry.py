"""The algorithm registry: role sets, registration, the config's tagged union, and
RLOO's leave-one-out baseline. No Ray."""

from __future__ import annotations

import pytest

from asyncflow import RoleGroup
from asyncflow.algos import (
    Algorithm,
    GRPOConfig,
    GRPORoles,
    PolicyConfig,
    PPOConfig,
    RLOOConfig,
    RoleSet,
    SafeRLHFState,
    SamplingConfig,
    algorithm,
    algorithm_of,
    algorithms,
    config_section,
    get_algorithm,
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
    assert found["ppo"].streams and not found["remax"].streams and found["safe_rlhf"].state_type is SafeRLHFState
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

    with pytest.raises(ConfigError, match="needs a `sampling: SamplingConfig` field"):
        @algorithm("no_rollout", config=NoRollout, roles=TwoRoles)
        async def step(roles, prompts, config, *, seed=None):  # type: ignore[no-untyped-def]
            return {}


def test_sections_are_tagged_subclasses_that_name_their_algorithm() -> None:
    rloo = get_algorithm("rloo")
    section = config_section(rloo)
    made = section(sampling=SamplingConfig(n=3))
    assert isinstance(made, RLOOConfig) and algorithm_of(made) is rloo
    assert algorithm_of(RLOOConfig()) is rloo  # an untagged instance of a registered config
    assert rloo.needed_roles(RLOOConfig()) == ("actor", "reward")
    assert rloo.needed_roles(RLOOConfig(), also=("ref", "critic")) == ("actor", "reward", "ref")


def test_the_docs_example_is_the_plugin_package() -> None:
    from pathlib import Path

    root = Path(__file__).parents[2]
    page = (root / "docs" / "algorithms.md").read_text()
    section = page[page.index("## Write your own algorithm"):]
    block = section[section.index("```python\n") + len("```python\n"):]
    block = block[:block.index("```")]
    source = (root / "tests" / "plugin" / "af_plugin_demo" / "__init__.py").read_text()
    assert block == source[source.index("from __future__"):]


# ----- what a step takes, read from its signature -----

class Counter:
    def __init__(self, count: int) -> None:
        self.count = count

    @classmethod
    def from_config(cls, config: RLOOConfig) -> Counter:
        return cls(config.sampling.n)


async def _counting_step(roles: TwoRoles, prompts: object, config: RLOOConfig, *, seed: int | None = None,
                         more: object = None, state: Counter | None = None) -> dict[str, float]:
    return {}


def test_what_a_step_takes_is_read_from_its_signature() -> None:
    algo = Algorithm(name="counting", config=RLOOConfig, roles=TwoRoles, step=_counting_step)
    assert algo.takes == {"seed", "more", "state"}
    assert algo.draws and not algo.streams and not algo.samples_ahead
    assert algo.state_type is Counter and algo.initial_state(RLOOConfig(sampling=SamplingConfig(n=3))).count == 3
    ppo = get_algorithm("ppo")
    assert ppo.streams and ppo.samples_ahead and not ppo.draws and ppo.initial_state(ppo.config()) is None


def test_a_state_without_from_config_or_a_required_unknown_keyword_is_refused() -> None:
    async def plain_state(roles, prompts, config, *, seed=None, state: dict | None = None):  # type: ignore[no-untyped-def]
        return {}

    with pytest.raises(ConfigError, match=r"annotate .*plain_state's state parameter with a class that has a "
                                          r"from_config\(config\) classmethod"):
        Algorithm(name="x", config=RLOOConfig, roles=TwoRoles, step=plain_state)

    async def needs_ptx(roles, prompts, config, *, seed=None, ptx):  # type: ignore[no-untyped-def]
        return {}

    with pytest.raises(ConfigError, match="takes keyword 'ptx' without a default, which the trainer never passes"):
        Algorithm(name="x", config=RLOOConfig, roles=TwoRoles, step=needs_ptx)


def test_the_config_checks_itself() -> None:
    with pytest.raises(ConfigError, match=r"algorithm.sampling.n must be >= 2, got 1"):
        get_algorithm("rloo").check(RLOOConfig(sampling=SamplingConfig(n=1)))
    get_algorithm("rloo").check(RLOOConfig())


# ----- optional roles: annotated `| None`, needed by settings (RoleSet.needed) -----

def test_an_optional_role_the_settings_need_is_one_config_error() -> None:
    kl = GRPOConfig(policy=PolicyConfig(kl_coef=0.1))
    grpo = get_algorithm("grpo")
    assert grpo.needed_roles(GRPOConfig()) == ("actor", "reward")
    assert grpo.needed_roles(kl) == ("actor", "reward", "ref")
    placed = {"actor": "A", "reward": "R"}
    assert GRPORoles.of(placed, config=GRPOConfig()).ref is None  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"GRPO with these settings needs role 'ref' \(algorithm.policy.kl_coef > 0\) "
                                          "placed"):
        GRPORoles.of(placed, config=kl, algorithm="GRPO")  # type: ignore[arg-type]
    bound = GRPORoles.of(placed)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="needs role 'ref'"):
        GRPORoles.of(bound, config=kl)
    assert get_algorithm("ppo").needed_roles(PPOConfig(reward_kl_coef=0.0)) == ("actor", "critic", "reward")
