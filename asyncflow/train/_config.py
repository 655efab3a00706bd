"""The run configuration of ``asyncflow train``: TOML or YAML decoded by msgspec
into typed, keyword-only Structs. Unknown keys and wrong types are errors that name
the key (``$.actor.lr``); cross-field rules are checked in :func:`validate`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import msgspec

from asyncflow.algos import GRPOConfig, PPOConfig, ReMaxConfig, SafeRLHFConfig
from channels import ConfigError
from workers.tasks import ArithmeticTaskConfig, SFTConfig

_CFG = {"frozen": True, "kw_only": True, "forbid_unknown_fields": True}

Algorithm = Literal["grpo", "ppo", "remax", "safe_rlhf"]

ROLES_OF: dict[str, tuple[str, ...]] = {
    "grpo": ("actor", "reward"),
    "ppo": ("actor", "critic", "reward"),
    "remax": ("actor", "reward"),
    "safe_rlhf": ("actor", "critic", "cost_critic", "reward", "cost"),
}
"""Roles each algorithm needs (``ref`` joins when a KL term is on)."""


class ModelSection(msgspec.Struct, **_CFG):
    """Where the policy starts."""

    dir: str = ""
    """A Hugging Face model directory; empty: the SFT warm start's output."""


class TrainSection(msgspec.Struct, **_CFG):
    """The RL loop."""

    steps: int = 20
    """RL steps."""
    prompts_per_step: int = 16
    """Prompts sampled per step."""
    checkpoint_every: int = 10
    """Save a checkpoint every this many steps (0: only at the end)."""
    keep_checkpoints: int = 2
    """Complete checkpoints kept."""
    eval_every: int = 0
    """Held-out evaluation every this many steps (0: before and after only)."""
    eval_size: int = 500
    """Held-out problems evaluated (the first ones of the eval split)."""
    max_seconds: float = 0.0
    """Stop RL after this long (0: no limit); the run still evaluates and saves."""
    kl_metric: bool = True
    """Place a reference policy to report the actor's KL to its starting point
    (``actor/kl_to_ref``) even when no KL term is in the loss."""

    def __post_init__(self) -> None:
        for name in ("steps", "prompts_per_step", "eval_size", "keep_checkpoints"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("checkpoint_every", "eval_every"):
            if getattr(self, name) < 0:
                raise ConfigError(f"train.{name} must be >= 0, got {getattr(self, name)}")


class OptimSection(msgspec.Struct, **_CFG):
    """A trained role's optimizer and update schedule."""

    lr: float = 1e-5
    """Peak AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Gradient-norm clip."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up (optimizer steps)."""
    micro_batch_size: int = 64
    """Rows per forward/backward pass (gradients accumulate over micro-batches)."""
    epochs: int = 1
    """Passes over each step's batch."""
    mini_batches: int = 1
    """Optimizer steps per pass."""


class ActorSection(OptimSection, **_CFG):
    """The policy."""

    rollout_engine: Literal["native", "vllm"] = "native"
    """Which engine generates: the native one or vLLM."""
    rollout_batch_size: int = 256
    """Most sequences the native engine decodes at once."""


class ScoreSection(msgspec.Struct, **_CFG):
    """A reward (or cost) source: a rule function or a model."""

    function: str = "workers.tasks:exact_match_reward"
    """``module:function`` with ``fn(prompts, responses, answers) -> list[float]``."""
    model_dir: str = ""
    """A reward/value model directory; when set, it scores instead of ``function``."""


class PoolSection(msgspec.Struct, **_CFG):
    """A resource pool."""

    devices: int = 1
    """Devices (worker processes)."""


class PlacementSection(msgspec.Struct, **_CFG):
    """Where a role runs and its parallel layout."""

    pool: str
    """The pool's name (a key of ``[pools]``)."""
    p: int = 1
    """Pipeline-parallel size."""
    t: int = 1
    """Tensor-parallel size."""


class RunConfig(msgspec.Struct, **_CFG):
    """Everything ``asyncflow train`` needs."""

    algorithm: Algorithm = "grpo"
    """``grpo``, ``ppo``, ``remax`` or ``safe_rlhf``."""
    output_dir: str = "runs/asyncflow"
    """Metrics, checkpoints, plots and the SFT model go here."""
    seed: int = 0
    """Seeds data order, sampling and the roles."""
    task: ArithmeticTaskConfig = ArithmeticTaskConfig()
    """The synthetic task (train and held-out splits)."""
    sft: SFTConfig | None = None
    """SFT warm start (its ``task`` is replaced by ``[task]``); None: start from ``model.dir``."""
    model: ModelSection = ModelSection()
    """The policy's starting point when there is no SFT warm start."""
    train: TrainSection = TrainSection()
    """The RL loop."""
    grpo: GRPOConfig = GRPOConfig()
    """GRPO settings."""
    ppo: PPOConfig = PPOConfig()
    """PPO settings."""
    remax: ReMaxConfig = ReMaxConfig()
    """ReMax settings."""
    safe_rlhf: SafeRLHFConfig = SafeRLHFConfig()
    """Safe-RLHF settings."""
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


def load_config(path: str | Path, overrides: dict[str, object] | None = None) -> RunConfig:
    """Read and validate a ``.toml``, ``.yaml`` or ``.yml`` run configuration.

    Raises:
        ConfigError: unreadable file, unknown key, wrong type or inconsistent values,
            naming the key.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    raw = path.read_bytes()
    try:
        if path.suffix == ".toml":
            data = msgspec.toml.decode(raw)
        elif path.suffix in (".yaml", ".yml"):
            data = msgspec.yaml.decode(raw)
        else:
            raise ConfigError(f"config {path} must end in .toml, .yaml or .yml")
        for key, value in (overrides or {}).items():
            _set(data, key, value)
        config = msgspec.convert(data, RunConfig)
    except msgspec.ValidationError as e:
        raise ConfigError(f"{path}: {e}") from None
    except msgspec.DecodeError as e:
        raise ConfigError(f"{path}: not valid {path.suffix[1:].upper()}: {e}") from None
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    validate(config)
    return config


def _set(data: dict[str, object], dotted: str, value: object) -> None:
    node = data
    *parents, leaf = dotted.split(".")
    for p in parents:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted}: {p} is not a table")
        node = child
    node[leaf] = value


def needed_roles(config: RunConfig) -> tuple[str, ...]:
    """The roles ``config``'s algorithm places (with ``ref`` when a KL term is on)."""
    roles = ROLES_OF[config.algorithm]
    algo = getattr(config, config.algorithm)
    uses_kl = algo.policy.kl_coef > 0 or getattr(algo, "reward_kl_coef", 0.0) > 0
    with_ref = uses_kl or (config.train.kl_metric and config.algorithm in ("grpo", "remax"))
    return (*roles, "ref") if with_ref else roles


def validate(config: RunConfig) -> None:
    """Cross-field checks.

    Raises:
        ConfigError: naming the offending key and the fix.
    """
    if config.sft is None and not config.model.dir:
        raise ConfigError("set [sft] for a warm start or model.dir for a model directory to start from")
    if not config.pools:
        raise ConfigError("[pools] must name at least one pool")
    for name, pool in config.pools.items():
        if pool.devices < 1:
            raise ConfigError(f"pools.{name}.devices must be >= 1, got {pool.devices}")
    for role, place in config.placement.items():
        if place.pool not in config.pools:
            raise ConfigError(f"placement.{role}.pool names {place.pool!r}, which is not in [pools] "
                              f"({sorted(config.pools)})")
        devices = config.pools[place.pool].devices
        if devices % (place.p * place.t):
            raise ConfigError(f"placement.{role}: p*t = {place.p * place.t} must divide pool "
                              f"{place.pool!r}'s {devices} devices")
    unknown = set(config.placement) - {"actor", "ref", "critic", "cost_critic", "reward", "cost"}
    if unknown:
        raise ConfigError(f"placement names unknown roles {sorted(unknown)}")
    if config.algorithm == "safe_rlhf" and not (config.cost.function or config.cost.model_dir):
        raise ConfigError("algorithm safe_rlhf needs [cost] function or model_dir")
    if config.algorithm == "grpo" and config.grpo.rollout.n < 2:
        raise ConfigError("grpo.rollout.n must be >= 2: GRPO compares samples of one prompt")
