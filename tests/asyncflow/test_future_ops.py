"""Selections on data futures in an in-process session: ``select``, ``take``,
slices, ``filter`` (by row and by group), ``concat``; what consumers pull from
them, and when their shards are freed."""

from __future__ import annotations

import asyncio
import gc

import pytest
import torch

from asyncflow import (
    ConfigError,
    MissingFieldError,
    ResourcePool,
    RoleSpec,
    SchemaError,
    concat,
    merge,
)
from asyncflow import transform as af_transform
from support import Consumer, Producer, expected_x, run_local

P4 = ResourcePool(name="p4", devices=4)
C2 = ResourcePool(name="c2", devices=2)
SPECS = {"producer": RoleSpec(cls=Producer, pool=P4), "consumer": RoleSpec(cls=Consumer, pool=C2)}
N, W = 16, 3


def run(main, timeout: float = 60):
    return run_local(SPECS, {"idx": torch.arange(N)}, P4, main, timeout)


def _idx(batch) -> list[int]:
    return batch["idx"].tolist()


def _shards(stats, pool: str) -> int:
    return sum(s.shards for p, _, s in stats if p == pool)


def test_take_slices_and_select_fetch_the_chosen_rows_and_columns() -> None:
    async def main(session, roles, src):
        made = roles.producer.produce(src, width=W)
        whole = await made
        out = {
            "take": await made.take(5).fetch(),
            "mid": await made[3:11].fetch(),
            "tail": await made[-4:].fetch(),
            "clamped": await made[10:100].fetch(),
            "back": await made[::-3].fetch(),
            "x": await made.select(["x"]).fetch(),
            "two": await made[2:4],
        }
        return whole, out, made.take(1).fields, made.select("x").fields

    whole, out, taken_fields, selected_fields = run(main)
    assert _idx(out["take"]) == list(range(5))
    assert _idx(out["mid"]) == list(range(3, 11))
    assert _idx(out["tail"]) == list(range(12, 16))
    assert _idx(out["clamped"]) == list(range(10, 16))
    assert _idx(out["back"]) == [15, 12, 9, 6, 3, 0]
    assert torch.equal(out["mid"]["x"], expected_x(torch.arange(3, 11), W).float())
    assert list(out["x"]) == ["x"] and torch.equal(out["x"]["x"], expected_x(torch.arange(N), W).float())
    # Rows 2..3 live on the first producer rank only: the slice names that shard alone.
    assert out["two"].num_rows == 2 and out["two"].shard_keys() < whole.shard_keys()
    assert len(out["two"].shard_keys()) == 1
    assert taken_fields == frozenset({"idx", "x", "mask"}) and selected_fields == frozenset({"x"})


def test_a_consumer_pulls_exactly_the_selected_rows_in_order() -> None:
    async def main(session, roles, src):
        made = roles.producer.produce(src, width=W)
        before = sum(s.bytes_received for p, _, s in await session.store_stats() if p == "c2")
        back = await roles.consumer.echo(made[::-1]).fetch()
        after = sum(s.bytes_received for p, _, s in await session.store_stats() if p == "c2")
        odd = await roles.consumer.echo(made.filter("idx", lambda i: i % 2 == 1)).fetch()
        cat = await roles.consumer.echo(concat(made[12:], made[:4])).fetch()
        # tokens-balanced splits need per-row lengths: selections keep them
        balanced = await roles.consumer.echo_balanced(concat(made[8:], made.take(4))).fetch()
        return back, after - before, odd, cat, balanced

    back, pulled, odd, cat, balanced = run(main)
    assert _idx(back) == list(range(N - 1, -1, -1))
    assert torch.equal(back["x"], expected_x(back["idx"], W).float())
    assert back["rank"].tolist() == [0] * 8 + [1] * 8
    assert pulled == N * (8 + 4 * W)  # idx (int64) and x (W float32) of every row, once; no mask
    assert _idx(odd) == list(range(1, N, 2))
    assert _idx(cat) == [12, 13, 14, 15, 0, 1, 2, 3]
    assert _idx(balanced) == [*range(8, 16), *range(4)]


def test_fewer_rows_than_consumer_ranks_gives_the_empty_rank_an_empty_share() -> None:
    async def main(session, roles, src):
        made = roles.producer.produce(src, width=W)
        one = await roles.consumer.echo(made[5:6]).fetch()
        none = await roles.consumer.echo(made.filter("idx", lambda i: i < 0)).fetch()
        total = await roles.consumer.total(made.take(1))
        return one, none, total

    one, none, total = run(main)
    assert _idx(one) == [5] and one["rank"].tolist() == [0]
    assert torch.equal(one["x"], expected_x(torch.tensor([5]), W).float())
    assert none.num_rows == 0 and none["x"].shape == (0, W)
    assert total["rows"] == 1


def test_filter_by_row_rejects_wide_columns_bad_masks_and_unknown_fields() -> None:
    async def main(session, roles, src):
        made = roles.producer.produce(src, width=W)
        kept = await made.filter("idx", lambda i: i >= 10).fetch()
        nonzero = await made.filter("idx").fetch()  # no predicate: non-zero values pass
        errors = []
        for bad in (made.filter("mask"), made.filter("idx", lambda i: i), made.filter("idx", lambda i: i[:3] > 0)):
            with pytest.raises(SchemaError) as e:
                await bad
            errors.append(str(e.value))
        with pytest.raises(MissingFieldError, match="has no field 'reward' to filter on"):
            made.filter("reward")
        with pytest.raises(ConfigError, match="names the column"):
            made.filter(lambda b: b["idx"] > 0)  # type: ignore[arg-type]
        return kept, nonzero, errors

    kept, nonzero, errors = run(main)
    assert _idx(kept) == list(range(10, 16))
    assert _idx(nonzero) == list(range(1, 16))
    assert "one value per row, but 'mask' has per-row shape [3]" in errors[0]
    assert "one bool per row (16 in all), got a torch.int64 tensor of shape [16]" in errors[1]
    assert "got a torch.bool tensor of shape [3]" in errors[2]


REWARDS = [[1, 1, 1, 1], [0, 1, 0, 0], [2, 2, 2, 2], [3, 0, 1, 1]]
"""Per prompt group of 4 samples: groups 1 and 3 have rewards that differ."""


def varied(r: torch.Tensor) -> torch.Tensor:
    """DAPO's dynamic sampling: keep the groups whose rewards are not all equal."""
    return r.amax(dim=1) > r.amin(dim=1)


async def _scored(session, roles, src, *, first: int = 0, rewards=REWARDS):
    """Rows of 4 prompt groups (uid per group) with a per-row reward, plus produced x."""
    n = 4 * len(rewards)
    idx = torch.arange(first, first + n)
    scores = await session.put({"uid": idx // 4, "reward": torch.tensor(rewards).flatten().float()},
                               pool=P4, group_size=4)
    made = roles.producer.produce(await session.put({"idx": idx}, pool=P4, group_size=4), width=W)
    return merge(made, scores)


def test_filter_by_group_keeps_or_drops_whole_groups() -> None:
    async def main(session, roles, src):
        rows = await _scored(session, roles, src)
        kept = rows.filter("reward", varied, by_group=True)
        meta = await kept
        fetched = await kept.fetch()
        every = await rows.filter("reward", by_group=True).fetch()  # no predicate: all non-zero
        with pytest.raises(SchemaError, match=r"one bool per group of 4 rows \(4 in all\) \(reduce over dim 1"):
            await rows.filter("reward", lambda r: r > 0, by_group=True)
        echoed = await roles.consumer.echo(kept).fetch()
        return meta, fetched, every, echoed

    meta, fetched, every, echoed = run(main)
    assert meta.group_size == 4 and meta.num_rows == 8
    assert _idx(fetched) == [*range(4, 8), *range(12, 16)]
    assert fetched["uid"].tolist() == [1] * 4 + [3] * 4
    assert _idx(every) == [*range(0, 4), *range(8, 12)]
    # groups stay whole on the consumer's ranks
    assert _idx(echoed) == [*range(4, 8), *range(12, 16)] and echoed["rank"].tolist() == [0] * 4 + [1] * 4


def test_dapo_oversample_filter_concat_take_exact_groups() -> None:
    batch_groups = 3
    draws = [REWARDS, [[5, 5, 5, 5], [1, 2, 3, 4], [0, 0, 0, 0], [1, 0, 1, 1]], [[0, 1, 1, 1]] * 4]

    async def main(session, roles, src):
        kept, have, used = [], 0, 0
        while have < batch_groups:
            rows = await _scored(session, roles, src, first=100 * used, rewards=draws[used])
            used += 1
            ok = rows.filter("reward", varied, by_group=True)
            have += (await ok).num_rows // 4
            kept.append(ok)
        batch = concat(*kept).take(batch_groups, groups=True)
        meta = await batch
        echoed = await roles.consumer.echo(batch).fetch()
        return used, meta, echoed

    used, meta, echoed = run(main)
    assert used == 2  # 2 + 2 varied groups: the second draw fills the batch, one group is left out
    assert meta.num_rows == 12 and meta.group_size == 4
    assert _idx(echoed) == [*range(4, 8), *range(12, 16), *range(104, 108)]
    assert echoed["rank"].tolist() == [0] * 8 + [1] * 4  # whole groups per rank


def test_concat_checks_fields_group_sizes_and_transforms() -> None:
    async def main(session, roles, src):
        made = roles.producer.produce(src, width=W)
        with pytest.raises(SchemaError, match=r"concat needs the same fields: .* has \['idx', 'mask', 'x'\] but"):
            concat(made, src)
        floats = await session.put({"idx": torch.arange(4).float()}, pool=P4)
        grouped = await session.put({"idx": torch.arange(4)}, pool=P4, group_size=2)
        with pytest.raises(SchemaError, match=r"field 'idx' is int64\[\] in put#1 but float32\[\] in put#2"):
            await concat(src, floats)
        with pytest.raises(SchemaError, match="one group size"):
            await concat(src, grouped)
        with pytest.raises(SchemaError, match="mapped differently"):
            await concat(made.map(_double), made)
        with pytest.raises(ConfigError, match="at least one future"):
            concat()
        with pytest.raises(ConfigError, match="takes DataFutures, got Tensor"):
            concat(made, torch.zeros(2))  # type: ignore[arg-type]
        mapped = await concat(made.map(_double), made.map(_double)).fetch()
        return mapped

    mapped = run(main)
    assert torch.equal(mapped["y"], mapped["x"] * 2) and mapped.num_rows == 2 * N


def _double(batch):
    return {"y": batch["x"] * 2}


def test_bad_arguments_fail_at_call_time() -> None:
    async def main(session, roles, src):
        made = roles.producer.produce(src, width=W)
        with pytest.raises(TypeError, match="not iterable"):
            iter(made)
        with pytest.raises(ConfigError, match=r"fut\[i:i \+ 1\]"):
            made[3]  # type: ignore[index]
        with pytest.raises(ConfigError, match="step cannot be zero"):
            made[::0]
        with pytest.raises(ConfigError, match="int >= 0"):
            made.take(-1)
        with pytest.raises(MissingFieldError, match="no field 'y' to select"):
            made.select(["x", "y"])
        with pytest.raises(SchemaError, match=r"has only 16 rows; concat more rows"):
            await made.take(17)
        with pytest.raises(SchemaError, match=r"has only 4 groups of 4 rows"):
            await (await session.put({"idx": torch.arange(16)}, pool=P4, group_size=4)).take(5, groups=True)
        with pytest.raises(ConfigError, match="select before map"):
            await made.map(_double).select(["x"])
        with pytest.raises(MissingFieldError, match="a map\\(\\) transform makes it"):
            await made.map(af_transform(reads=("x",), writes=("y",))(_double)).filter("y")

    run(main)


def test_a_filter_is_decided_once_for_every_consumer() -> None:
    calls = []

    def pred(i: torch.Tensor) -> torch.Tensor:
        calls.append(len(i))
        return i < 6

    async def main(session, roles, src):
        made = roles.producer.produce(src, width=W)
        kept = made.filter("idx", pred)
        meta, rows, echoed = await asyncio.gather(kept, kept.fetch(), roles.consumer.echo(kept).fetch())
        return meta, rows, echoed

    meta, rows, echoed = run(main)
    assert calls == [N]
    assert meta.num_rows == 6 and _idx(rows) == _idx(echoed) == list(range(6))


def test_cancelling_a_selection_cancels_its_consumers() -> None:
    async def main(session, roles, src):
        made = roles.producer.produce(src, width=W)
        kept = made.take(4)
        echoed = roles.consumer.echo(kept)
        assert kept.cancel()
        with pytest.raises(asyncio.CancelledError):
            await echoed
        return await made

    assert run(main).num_rows == N


def test_shards_are_freed_when_no_future_names_them() -> None:
    async def main(session, roles, src):
        made = roles.producer.produce(src, width=W)
        await made
        base = _shards(await session.store_stats(), "p4")  # 4 put + 4 produced
        head, tail = made.take(2), made.filter("idx", lambda i: i >= 12)
        both = concat(head, tail).select(["x"])
        names = (await both).shard_keys()
        del head, tail
        gc.disable()  # no reference cycle may hold a selection's shards until a collection
        try:
            del made
            kept = _shards(await session.store_stats(), "p4")
            rows = await roles.consumer.echo(both.map(_as_echo)).fetch()
            del both
            left = _shards(await session.store_stats(), "p4")
        finally:
            gc.enable()
        return base, names, kept, rows, left, await session.store_stats()

    base, names, kept, rows, left, end = run(main)
    assert base == 8 and len(names) == 2  # rows 0-1 on rank 0, rows 12-15 on rank 3
    assert kept == 4 + 2  # the put's shards, and the 2 produced shards the selection names
    assert torch.equal(rows["x"], expected_x(torch.tensor([0, 1, 12, 13, 14, 15]), W).float())
    assert left == 4  # the put's (``src`` is still named by the test helper)
    assert _shards(end, "c2") == 0  # the echo's rows went with its future


def _as_echo(batch):
    return {"idx": torch.zeros(batch.num_rows, dtype=torch.int64)}


def test_a_dropped_futures_shards_are_freed_with_the_next_call_to_their_workers(monkeypatch) -> None:
    """A free rides along with the next call to the shard's worker rather than costing
    a round trip of its own; what no call takes goes on its own shortly after."""
    from asyncflow.runtime import _ledger
    from asyncflow.runtime._local import LocalTransport

    standalone: list[list[str]] = []
    real = LocalTransport.free

    async def free(self, worker, keys):
        standalone.append(list(keys))
        return await real(self, worker, keys)

    monkeypatch.setattr(LocalTransport, "free", free)

    async def main(session, roles, src):
        monkeypatch.setattr(_ledger, "FREE_DELAY_S", 3600.0)  # only a call (or a drain) frees
        made = roles.producer.produce(src, width=W)
        await made
        del made
        gc.collect()
        again = roles.producer.produce(src, width=W)  # to the same four workers
        await again
        with_again = _shards(await session.store_stats(), "p4")  # drains what is left
        rode_along = list(standalone)
        monkeypatch.setattr(_ledger, "FREE_DELAY_S", 0.02)
        del again
        gc.collect()
        await asyncio.sleep(0.5)  # no call to take them
        alone = list(standalone)
        return rode_along, with_again, alone, _shards(await session.store_stats(), "p4")

    rode_along, with_again, alone, at_end = run(main)
    assert rode_along == [], "the first call's shards went with the second call, none was left to drain"
    assert with_again == 4 + 4  # the source's and the second call's, not the first's
    assert sorted(len(keys) for keys in alone) == [1, 1, 1, 1], "one free per worker, sent by the timer"
    assert at_end == 4
