"""Roles the benchmarks host (an importable module, so workers can load them)."""

from __future__ import annotations

import time

import torch

from asyncflow import DP, AllToAll, Batch, Metrics, OneToAll, Role, register


class Payload(Role):
    """Produces ``x`` rows of ``width`` float32 from row ids."""

    @register(protocol=AllToAll(), reads=("idx",), writes=("x",))
    def produce(self, batch: Batch, *, width: int) -> dict[str, torch.Tensor]:
        n = batch.num_rows
        return {"x": torch.ones(n, width) * batch["idx"].unsqueeze(1)}


class Sink(Role):
    """Pulls its rows and reports how many it got (the pull is the work)."""

    @register(protocol=Metrics(over=DP(), reduce={"rows": "sum", "bytes": "sum"}), reads=("x",))
    def take(self, batch: Batch) -> dict[str, float]:
        return {"rows": batch.num_rows, "bytes": batch.nbytes}


class Burner(Role):
    """A fixed amount of CPU work (matrix products on one thread)."""

    @register(protocol=OneToAll())
    def compute(self, steps: int) -> dict[str, float]:
        start = time.time()
        a = torch.randn(256, 256)
        for _ in range(steps):
            a = torch.tanh(a @ a * 0.01)
        return {"start": start, "end": time.time()}

    @register(protocol=OneToAll())
    def noop(self) -> None:
        """Nothing: what a call costs the runtime alone."""
