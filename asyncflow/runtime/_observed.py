"""What the runtime observed of past calls, for ``StreamOptions(migrate="auto")``.

Per streamed method, the last call's per-row lengths and timings; per pool, the
seconds one rank spends per row in each rank-local method (a moving average).
:func:`auto_migration` feeds them to the simulator (``asyncflow.runtime._migration``) and
picks the migration threshold and targets that it predicts fastest: RLHFuse's
approach, refined as new samples come in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from asyncflow.runtime._migration import GenerationWorkload, StepCost, choose_migration


@dataclass(kw_only=True)
class StreamStats:
    """What one streamed call observed: the result of its call, ``DataStream.report()``,
    and what ``migrate="auto"`` learns from."""

    lengths: list[int] = field(default_factory=list)
    """Per finished row, its ``row_lengths`` value (response tokens for ``generate``)."""
    initial: list[int] = field(default_factory=list)
    """Samples each rank started with."""
    rank_done_s: list[float | None] = field(default_factory=list)
    """Seconds from the start until each rank returned."""
    step_s: list[tuple[int, float]] = field(default_factory=list)
    """``(samples in progress, mean seconds of a step)`` reported by the ranks."""
    total_s: float = 0.0
    threshold: int = 0
    """The migration threshold the call used (0: none)."""
    migrated: int = 0
    """Samples handed from one rank to another."""
    migrated_at_s: float | None = None
    targets: list[int] = field(default_factory=list)

    @classmethod
    def for_ranks(cls, ranks: int) -> StreamStats:
        """Empty stats of a call on ``ranks`` ranks."""
        return cls(initial=[0] * ranks, rank_done_s=[None] * ranks)

    def __repr__(self) -> str:
        return (f"StreamStats(rows={len(self.lengths)}, total_s={self.total_s:.3f}, threshold={self.threshold}, "
                f"migrated={self.migrated}, migrated_at_s={self.migrated_at_s}, targets={self.targets})")


@dataclass
class Observed:
    """The runtime's observations (see the module docstring)."""

    streams: dict[tuple[str, str], StreamStats] = field(default_factory=dict)
    row_s: dict[str, dict[tuple[str, str], float]] = field(default_factory=dict)
    """Per pool, per (role, method): seconds of one rank per row."""

    def record_call(self, pool: str, call: Any, lanes: int, seconds: float) -> None:
        """A rank-local call on ``lanes`` ranks took ``seconds``."""
        metas = [getattr(r, "meta", None) for r in (call.inputs or {}).values()]
        rows = max((m.num_rows for m in metas if m is not None), default=0)
        if rows <= 0:
            return
        per_row = seconds * lanes / rows
        costs = self.row_s.setdefault(pool, {})
        key = (call.role, call.method)
        costs[key] = per_row if key not in costs else 0.7 * costs[key] + 0.3 * per_row

    def record_stream(self, role: str, method: str, record: StreamStats) -> None:
        """A streamed call of ``role.method`` ended."""
        if record.lengths:
            self.streams[(role, method)] = record


def auto_migration(observed: Observed, *, pool: str, role: str, method: str, ranks: int,
                   micro_batch: int) -> tuple[int, int]:
    """``(threshold, targets)`` for the next streamed ``role.method`` on ``pool``
    (``(0, 1)``: no migration, e.g. before anything was observed)."""
    record = observed.streams.get((role, method))
    inference = sum(observed.row_s.get(pool, {}).values())
    if record is None or ranks < 2 or inference <= 0:
        return 0, 1
    done = [t for t in record.rank_done_s if t is not None]
    longest = max(record.lengths)
    if not done or longest <= 0:
        return 0, 1
    # The ranks timed their steps by how many samples were in progress; without
    # two sizes to fit, one step ~ the slowest rank's time / the longest sample.
    sizes = {b for b, _ in record.step_s}
    if len(sizes) >= 2:
        step = StepCost.fit(record.step_s)
    else:
        step = StepCost(base_s=max(done) / longest, per_sample_s=0.0)
    workload = GenerationWorkload(lengths=tuple(record.lengths), instances=ranks,
                        max_batch=max(1, max(record.initial)), step=step,
                        inference_s_per_sample=inference, micro_batch=micro_batch)
    choice = choose_migration(workload)
    return choice.threshold, choice.targets

