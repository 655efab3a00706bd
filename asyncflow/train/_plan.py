"""``asyncflow plan CONFIG``: the planner (``asyncflow.plan``) on a run's roles and step.

The profile runs the configuration's own roles and algorithm step on a batch of
its prompts (``[data]``'s source). A configuration with an SFT warm start is profiled with a
fresh model of the SFT model's shape (costs depend on the shape, not on the
weights; responses of an untrained model run longer, so the plan is for the
longest responses).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import msgspec

from asyncflow.plan import Placement, Prediction, Profile, candidates, profile, rank_profiled
from asyncflow.runtime import Session
from asyncflow.train._config import (
    PlacementSection,
    PoolSection,
    RunConfig,
    algorithm_in,
    needed_roles,
    sampling_of,
)
from asyncflow.train._prompts import RunPrompts, run_prompts
from asyncflow.train._roles import role_specs
from asyncflow.train._trainer import Trainer
from workers.models import gguf_to_hf_dir, save_tiny_model


class _Steps:
    def __init__(self, trainer: Trainer, roles: Any, prompts: Any) -> None:
        self.trainer, self.roles, self.prompts = trainer, roles, prompts
        algo = algorithm_in(trainer.config)
        self.state = algo.initial_state(trainer.config.algorithm)
        self.count = 0

    async def step(self, *, stream: bool) -> object:
        self.count += 1
        train = msgspec.structs.replace(self.trainer.config.train, stream=stream)
        self.trainer.config = msgspec.structs.replace(self.trainer.config, train=train)
        return await self.trainer._step(self.roles, self.prompts, self.state, seed=self.count)


class TrainPlanJob:
    """A run configuration as the planner profiles it."""

    def __init__(self, config: RunConfig, model_dir: str) -> None:
        self.config, self.model_dir = config, model_dir
        self.roles = needed_roles(config)
        self._data: RunPrompts | None = None

    def placed(self, placement: Placement) -> RunConfig:
        """The configuration with ``placement``'s pools."""
        return msgspec.structs.replace(
            self.config, pools={n: PoolSection(devices=d) for n, d in placement.pools.items()},
            placement={r: PlacementSection(pool=p) for r, p in placement.roles.items()})

    async def start(self, placement: Placement, session: Session) -> _Steps:
        config = self.placed(placement)
        if self._data is None:  # read and tokenized once, for every placement profiled
            self._data = run_prompts(config, self.model_dir, sampling_of(config).max_new_tokens)
        data = self._data
        roles = await session.spawn(role_specs(config, self.model_dir, context=data.context))
        count = min(config.train.prompts_per_step, data.train_size)
        prompts = await session.put(data.train_batch(range(count), first_uid=0))
        return _Steps(Trainer(config, progress_bar=False), roles, prompts)


def current_placement(config: RunConfig) -> Placement:
    """The configuration's own ``[pools]``/``[placement]`` (unplaced roles on the first pool)."""
    first = next(iter(config.pools))
    return Placement(pools={n: p.devices for n, p in config.pools.items()},
                     roles={r: config.placement[r].pool if r in config.placement else first
                            for r in needed_roles(config)})


async def plan(config: RunConfig, *, devices: int, cores: int | None
               ) -> tuple[Profile, list[tuple[Placement, Prediction]]]:
    """Profile ``config`` and rank every placement of its roles on ``devices``."""
    stream = algorithm_in(config).streams
    with tempfile.TemporaryDirectory(prefix="asyncflow-plan-") as tmp:
        model_dir = config.model.path
        if config.model.gguf:
            model_dir = str(gguf_to_hf_dir(config.model.gguf, Path(tmp) / "model", key="model.gguf"))
        if config.sft is not None:
            model_dir = str(save_tiny_model(Path(tmp) / "model", config.sft.model, seed=config.seed))
        found = await profile(TrainPlanJob(config, model_dir), devices=devices, stream=stream, cores=cores)
    ranked = rank_profiled(found, candidates(list(needed_roles(config)), devices, cores=cores), cores=cores,
                           stream=stream and config.train.stream)
    return found, ranked
