"""Streams of data futures without Ray: in-process workers (``asyncflow.runtime._local``),
the real scheduler, data plane and streaming worker loop, a toy streaming role
(``support.Ticker``) and a rank-local consumer (``support.Scorer``).

``tests/asyncflow/test_streaming_on_cpu.py`` repeats the essentials on Ray with
the real actor and both rollout engines."""

from __future__ import annotations

import pytest
import torch

import asyncflow as af
from asyncflow import ResourcePool, RoleSpec, StreamOptions, collect, merge
from support import Consumer, Scorer, Ticker, run_local, x_of_value

T2 = ResourcePool(name="t2", devices=2)
C2 = ResourcePool(name="c2", devices=2)
SPECS = {
    "ticker": RoleSpec(cls=Ticker, pool=T2),
    "scorer": RoleSpec(cls=Scorer, pool=T2),
    "consumer": RoleSpec(cls=Consumer, pool=C2),
    "remote_scorer": RoleSpec(cls=Scorer, pool=C2),
}
STEPS = [3, 1, 2, 9, 1, 1, 2, 4, 1, 3, 2, 12]


def run(main, timeout: float = 60):
    return run_local(SPECS, {"idx": torch.arange(len(STEPS)), "steps": torch.tensor(STEPS)}, T2, main, timeout)


def _rows(batch) -> dict[str, list]:
    return {k: batch[k].tolist() for k in sorted(batch)}


def test_collected_stream_equals_the_batch_call_rows_order_and_values() -> None:
    async def main(session, roles, src):
        whole = await roles.ticker.tick(src).fetch()
        stream = roles.ticker.tick(src, stream=StreamOptions(micro_batch=2))
        sizes = [(await f).num_rows async for f in stream]
        return whole, await collect(stream).fetch(), sizes

    whole, streamed, sizes = run(main)
    assert _rows(streamed) == _rows(whole)
    assert whole["idx"].tolist() == list(range(len(STEPS)))
    assert len(sizes) > 2 and sum(sizes) == len(STEPS)


def test_micro_batches_arrive_in_completion_order() -> None:
    async def main(session, roles, src):
        stream = roles.ticker.tick(src, stream=StreamOptions(micro_batch=1))
        got = [await f.fetch() async for f in stream]
        return [(int(b["done_by"][0]), b["steps"].tolist()) for b in got]

    items = run(main)
    assert len(items) == len(STEPS)  # micro_batch=1: a micro-batch per row
    for rank in (0, 1):  # each rank reports its rows in the order they finish
        steps = [s for r, batch in items if r == rank for s in batch]
        assert steps == sorted(steps) and len(steps) == len(STEPS) // 2


def test_a_call_on_a_stream_streams_and_merge_matches_rows() -> None:
    async def main(session, roles, src):
        rollout = roles.ticker.tick(src, stream=StreamOptions(micro_batch=3))
        scored = roles.remote_scorer.score(rollout)  # another pool: one call per micro-batch
        assert isinstance(scored, af.DataStream)
        both = collect(merge(rollout, scored))
        whole = roles.ticker.tick(src)
        return await both.fetch(), await merge(whole, roles.remote_scorer.score(whole)).fetch()

    streamed, batch = run(main)
    for k in ("idx", "steps", "value", "score"):
        assert streamed[k].tolist() == batch[k].tolist()


def test_missing_field_on_a_stream_fails_at_call_time() -> None:
    async def main(session, roles, src):
        stream = roles.ticker.tick(src, stream=True)
        with pytest.raises(af.MissingFieldError, match="x"):
            roles.consumer.echo(stream)  # reads idx and x; the stream has no x
        await collect(stream)

    run(main)


def test_only_generator_methods_stream() -> None:
    async def main(session, roles, src):
        with pytest.raises(af.ConfigError, match="cannot stream"):
            roles.scorer.score(src, stream=True)

    run(main)


def test_migration_moves_the_tail_and_frees_ranks_for_rank_local_calls() -> None:
    async def main(session, roles, src):
        opts = StreamOptions(micro_batch=1, migrate=3, targets=1)
        stream = roles.ticker.tick(src, delay=0.05, stream=opts)
        scored = roles.scorer.score(stream)  # same pool, rank-local: runs on freed ranks
        merged = await collect(merge(stream, scored)).fetch()
        baseline = await roles.ticker.tick(src).fetch()
        return merged, baseline

    merged, baseline = run(main)
    for k in ("idx", "steps", "value"):
        assert merged[k].tolist() == baseline[k].tolist()
    # The two longest rows (9 and 12 steps, one per rank) finished on one rank.
    long = [i for i, s in enumerate(STEPS) if s >= 9]
    assert len({merged["done_by"][i].item() for i in long}) == 1
    # While that rank finished the tail, the other scored micro-batches.
    tail_rank = merged["done_by"][long[0]].item()
    last_done = merged["scored_at"][long].max()
    during = (merged["scored_by"] != tail_rank) & (merged["scored_at"] < last_done)
    assert bool(during.any())


def test_a_failing_streamed_method_ends_the_consumers_with_its_error() -> None:
    async def main(session, roles, src):
        stream = roles.ticker.tick(src, fail_after=2, stream=StreamOptions(micro_batch=1))
        scored = roles.remote_scorer.score(stream)
        with pytest.raises(af.RemoteStageError, match="ticker failed") as direct:
            async for _ in stream:
                pass
        with pytest.raises(af.RemoteStageError, match="ticker failed"):
            await collect(scored)
        return direct.value

    err = run(main)
    assert (err.role, err.method) == ("ticker", "tick")


def test_a_worker_dying_mid_stream_ends_every_consumer() -> None:
    async def main(session, roles, src):
        stream = roles.ticker.tick(src, delay=0.1, stream=StreamOptions(micro_batch=1))
        scored = roles.remote_scorer.score(stream)
        first = None
        async for fut in stream:
            first = fut
            break
        assert first is not None
        session.local.kill(SPECS_WORKER_OF_T2_RANK1)
        with pytest.raises(af.WorkerDiedError) as err:
            await collect(stream)
        with pytest.raises(af.WorkerDiedError):
            await collect(scored)
        return err.value

    err = run(main)
    assert (err.pool, err.rank) == ("t2", 1)


SPECS_WORKER_OF_T2_RANK1 = 1  # pool t2 is created first: workers 0 and 1


def test_a_later_call_needing_a_streams_calls_does_not_block_them() -> None:
    """``total(collect(echo(stream)))`` on one pool: ``total`` is made before any of
    the per-micro-batch ``echo`` calls exist, yet they run first (they take the
    place of ``echo(stream)`` in the queue) and nothing waits forever."""
    async def main(session, roles, src):
        stream = roles.ticker.tick(src, delay=0.01, stream=StreamOptions(micro_batch=2)).map(x_of_value)
        echoed = roles.consumer.echo(stream)
        total = roles.consumer.total(collect(echoed))
        return await total, await collect(echoed).fetch()

    total, rows = run(main)
    assert total["rows"] == len(STEPS) / 2  # a mean over the two ranks
    assert rows["idx"].tolist() == list(range(len(STEPS)))
