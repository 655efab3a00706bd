"""Test helpers: a background event loop for module-scoped sessions, and roles used
by the runtime tests (pickled by value so Ray workers need not import this file)."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

import ray
import torch

from asyncflow import DP, AllToAll, Batch, Metrics, OneToAll, Role, register

T = TypeVar("T")


class LoopThread:
    """An event loop in a thread, so one session can serve several tests."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-loop", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 300) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


def expected_x(idx: torch.Tensor, width: int) -> torch.Tensor:
    """The rows Producer.produce makes for row ids ``idx``."""
    return idx.double().unsqueeze(1) * 1000 + torch.arange(width, dtype=torch.float64)


class Producer(Role):
    """Makes ``x`` rows from row ids."""

    @register(protocol=AllToAll(), reads=("idx",), writes=("idx", "x", "mask"), row_lengths="mask")
    def produce(self, batch: Batch, *, width: int) -> dict[str, torch.Tensor]:
        idx = batch["idx"]
        mask = (torch.arange(width) < (idx.unsqueeze(1) % 7 + 1)).long()
        return {"idx": idx, "x": expected_x(idx, width).float(), "mask": mask}


class Consumer(Role):
    """Echoes what it pulled, and says which rows it got."""

    @register(protocol=DP(), reads=("idx", "x"), writes=("idx", "x", "rank"))
    def echo(self, batch: Batch) -> dict[str, torch.Tensor]:
        rank = torch.full((batch.num_rows,), self.ctx.rank)
        return {"idx": batch["idx"].clone(), "x": batch["x"].clone(), "rank": rank}

    @register(protocol=DP(balance="tokens", group_size=2), reads=("idx", "x"), writes=("idx", "x", "rank"))
    def echo_balanced(self, batch: Batch) -> dict[str, torch.Tensor]:
        return self.echo(batch)

    @register(protocol=Metrics(), reads=("x",))
    def total(self, batch: Batch) -> dict[str, float]:
        return {"sum": float(batch["x"].double().sum()), "rows": batch.num_rows}

    @register(protocol=DP(), reads=("adv",), writes=("adv",))
    def needs_adv(self, batch: Batch) -> dict[str, torch.Tensor]:
        return {"adv": batch["adv"]}


class Sleeper(Role):
    """Sleeps, and reports when (start, end) on every rank."""

    @register(protocol=OneToAll())
    def work(self, seconds: float) -> dict[str, Any]:
        start = time.time()
        time.sleep(seconds)
        return {"start": start, "end": time.time(), "pid": os.getpid()}

    @register(protocol=OneToAll())
    def pid(self) -> int:
        return os.getpid()

    @register(protocol=OneToAll())
    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()


class Faulty(Role):
    """Raises on one rank."""

    @register(protocol=DP(), reads=("x",), writes=("x",))
    def boom(self, batch: Batch, *, on_rank: int) -> dict[str, torch.Tensor]:
        if self.ctx.rank == on_rank:
            raise ValueError(f"bad row block on rank {self.ctx.rank}")
        return {"x": batch["x"]}


class Collective(Role):
    """Uses the role's mesh: all-reduce over its data-parallel group."""

    @register(protocol=OneToAll())
    def dp_sum(self) -> float:
        t = torch.tensor([float(self.ctx.rank + 1)])
        torch.distributed.all_reduce(t, group=self.ctx.mesh.get_group("dp"))
        return float(t.item())


def cost_of_long_answers(prompts: list[str], responses: list[str], answers: list[str]) -> list[float]:
    """A rule cost: longer responses cost more (a stand-in for a safety classifier)."""
    return [float(len(r)) / 10 for r in responses]


def raising_reward(prompts: list[str], responses: list[str], answers: list[str]) -> list[float]:
    """A reward function with a bug."""
    raise ZeroDivisionError("reward bug")
