"""The run configuration of ``asyncflow train``: :class:`RunConfig`, typed,
keyword-only msgspec Structs (the sections are in :mod:`asyncflow.train._sections`),
and what the trainer reads off it (the algorithm, the roles it needs, its
sampling, the reward, the episodes). Reading a file is :mod:`asyncflow.train._load`;
the checks across sections are :mod:`asyncflow.train._validate`.
"""


from __future__ import annotations

from typing import Any, Union

import msgspec
import torch

from asyncflow.algos import (
    Algorithm,
    SamplingConfig,
    algorithm_of,
    algorithms,
    config_section,
    get_algorithm,
)
from asyncflow.train._checks import ROLLOUT_ROLE
from asyncflow.train._sections import (
    _CFG,
    ActorSection,
    DataSection,
    EnvSection,
    GenSection,
    ModelSection,
    OptimSection,
    PlacementSection,
    PoolSection,
    ScoreSection,
    TrainSection,
    WeightedFunction,
)
from asyncflow.train._sft import SFTConfig
from workers.episodes import EpisodeConfig

__all__ = [
    "ActorSection",
    "DataSection",
    "EnvSection",
    "GenSection",
    "ModelSection",
    "OptimSection",
    "PlacementSection",
    "PoolSection",
    "RunConfig",
    "ScoreSection",
    "TrainSection",
    "WeightedFunction",
    "algorithm_in",
    "episode_config",
    "needed_roles",
    "response_width",
    "reward_of",
    "run_config_type",
    "sampling_of",
]

DEFAULT_ALGORITHM = "grpo"
"""The algorithm of a config that names none."""


def _default_algorithm() -> msgspec.Struct:
    return config_section(get_algorithm(DEFAULT_ALGORITHM))()


class RunConfig(msgspec.Struct, **_CFG):
    """Everything ``asyncflow train`` needs."""

    algorithm: msgspec.Struct = msgspec.field(default_factory=_default_algorithm)
    """The algorithm and its settings: ``[algorithm]`` with ``name = "grpo"`` (or
    any registered algorithm: ``asyncflow.algos.algorithms()``) and that
    algorithm's config keys beside it; ``algorithm = "ppo"`` takes its defaults."""
    output_dir: str = "runs/asyncflow"
    """Each run writes its metrics, checkpoints, plots and policy into a new
    ``version_<n>`` directory here (``latest`` links the newest); the SFT warm
    start's model is kept here for the runs with the same settings."""
    seed: int = 0
    """Seeds data order, sampling and the roles."""
    worker_nice: int = 0
    """Niceness of the worker processes (0..19; Ray's own default is 15, which
    lets any busy process on the machine starve them)."""
    data: DataSection = DataSection()
    """The prompts: the user's files (``data.train``, ``data.eval``) or the built-in
    arithmetic problems (``[data.arithmetic]``)."""
    sft: SFTConfig | None = None
    """SFT warm start on the arithmetic source's problems (``[data.arithmetic]``);
    None: start from ``[model]``."""
    model: ModelSection = ModelSection()
    """The policy's starting point when there is no SFT warm start."""
    train: TrainSection = TrainSection()
    """The RL loop."""
    actor: ActorSection = ActorSection()
    """The policy's optimizer and rollout engine."""
    critic: OptimSection = OptimSection()
    """The critic's (and cost critic's) optimizer."""
    reward: ScoreSection = ScoreSection()
    """The reward."""
    cost: ScoreSection = ScoreSection(function="")
    """The cost (Safe-RLHF)."""
    pools: dict[str, PoolSection] = msgspec.field(default_factory=lambda: {"main": PoolSection()})
    """Resource pools by name."""
    placement: dict[str, PlacementSection] = msgspec.field(default_factory=dict)
    """Role name -> pool and layout; a needed role left out goes to the first pool."""
    env: EnvSection | None = None
    """Multi-turn episodes with an environment; None: one response per sample."""




def run_config_type() -> type[RunConfig]:
    """:class:`RunConfig` with ``algorithm`` typed as the tagged union of every
    registered algorithm's config (``name`` picks one): what
    :func:`~asyncflow.train._load.load_config` decodes into."""
    registered = algorithms()
    key = tuple(sorted(registered))
    found = _RUN_CONFIG_TYPES.get(key)
    if found is None:
        sections = tuple(config_section(registered[name]) for name in key)
        union: Any = Union[sections]  # noqa: UP007  (built at run time from a tuple)
        found = msgspec.defstruct("RunConfig", [("algorithm", union, msgspec.field(default_factory=_default_algorithm))],
                                  bases=(RunConfig,), module=__name__)
        _RUN_CONFIG_TYPES[key] = found
    return found  # type: ignore[return-value]


_RUN_CONFIG_TYPES: dict[tuple[str, ...], Any] = {}


def algorithm_in(config: RunConfig) -> Algorithm[Any]:
    """The registered algorithm of ``config.algorithm``."""
    return algorithm_of(config.algorithm)


def hybrid_actor(config: RunConfig) -> bool:
    """Whether the actor has a generation layout (``placement.actor.gen``: the hybrid
    engine reshards its training weights for generation; its data-parallel ranks
    keep whole replicas)."""
    place = config.placement.get("actor")
    return place is not None and place.gen is not None


def sampling_of(config: RunConfig) -> SamplingConfig:
    """The algorithm's sampling settings (every algorithm has them)."""
    sampling: SamplingConfig = getattr(config.algorithm, "sampling")  # noqa: B009  (a registered config's field)
    return sampling


ENV_REWARD = "workers.episodes:episode_reward"
"""The reward of a run with an environment, unless ``[reward]`` names another."""


def reward_of(config: RunConfig) -> ScoreSection:
    """The run's ``[reward]``: with an ``[env]`` and the default function, the
    episodes' own reward (:data:`ENV_REWARD`)."""
    r = config.reward
    if (config.env is not None and not r.model_dir and not r.functions
            and r.function == ScoreSection.DEFAULT_FUNCTION):
        return msgspec.structs.replace(r, function=ENV_REWARD)
    return r


def episode_config(config: RunConfig) -> EpisodeConfig | None:
    """The episodes' settings of a run with ``[env]`` (None without)."""
    e = config.env
    if e is None:
        return None
    return EpisodeConfig(env=e.cls, settings=e.settings, max_turns=e.max_turns, max_tokens=e.max_tokens,
                         timeout_s=e.timeout_s, on_error=e.on_error, format=e.format,
                         observation_role=e.observation_role, text_template=e.text_template, stop=tuple(e.stop))


def pools_on_cuda(config: RunConfig) -> bool:
    """Whether the run's pools get GPUs, as the driver sees it before Ray starts: a
    device kind a pool names holds for all (a session uses one kind); with none
    named (``"auto"``), GPUs when the driver's torch sees one."""
    kinds = {p.device for p in config.pools.values()} - {"auto"}
    return "cuda" in kinds or (not kinds and torch.cuda.is_available())


def response_width(config: RunConfig) -> int:
    """The most tokens a sample holds after its prompt: one response
    (``max_new_tokens``), or an episode's turns and observations (``[env] max_tokens``)."""
    return config.env.max_tokens if config.env is not None else sampling_of(config).max_new_tokens


def needed_roles(config: RunConfig) -> tuple[str, ...]:
    """The roles ``config``'s algorithm places: its required roles, the optional
    ones its settings want, and ``ref`` for the KL metric (``train.kl_metric``)
    when the algorithm can use one."""
    also = ("ref",) if config.train.kl_metric else ()
    roles = algorithm_in(config).needed_roles(config.algorithm, also=also)
    return (*roles, ROLLOUT_ROLE) if ROLLOUT_ROLE in config.placement else roles
