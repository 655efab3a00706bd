"""Rows sent worker to worker over a real gloo process group (workers.host._pulls),
one process per rank; assertions inside a rank fail the test with that rank's
traceback."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from ranks import start_ranks

from channels import Packed, pack, unpack
from workers import PULL_TAGS, Pull, RowsUnavailableError
from workers.host._groups import is_peer_failure
from workers.host._pulls import INLINE_BYTES, Sender, receive


def _rank_main(rank: int, world: int, port: int, fn: Callable[[int], None]) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    fn(rank)
    dist.barrier()
    dist.destroy_process_group()


def _run(world: int, fn: Callable[[int], None]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    start_ranks(_rank_main, (world, port, fn), world)


def _rows(rank: int, n: int) -> dict[str, torch.Tensor]:
    ids = torch.arange(n) + 100 * rank
    return {"ids": ids, "x": ids.float().unsqueeze(1).repeat(1, 3), "mask": ids % 2 == 0,
            "h": ids.to(torch.bfloat16)}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


# ----- two producers, one consumer: every dtype, both transfers at once -----

def _two_producers_ranks(rank: int) -> None:
    if rank < 2:
        sender = Sender()
        # Two sets (pieces) per transfer, and a second transfer to the same consumer.
        sender.send(2, rank * PULL_TAGS, lambda: pack([_rows(rank, 3), _rows(rank, 2)]))
        sender.send(2, (2 + rank) * PULL_TAGS, lambda: pack([_rows(rank, 0)]))
        deadline = time.monotonic() + 30
        while sender.pending():
            assert time.monotonic() < deadline, "sends were never handed over"
            time.sleep(0.01)
        sender.close()
        return
    # The later transfers first, a plain (already fetched) item between.
    fetched = [Pull(0, 2 * PULL_TAGS), "kept", Pull(1, 3 * PULL_TAGS), Pull(1, PULL_TAGS), Pull(0, 0)]
    got = receive(fetched)
    assert got[1] == "kept"
    for i, (source, sizes) in {0: (0, [0]), 2: (1, [0]), 3: (1, [3, 2]), 4: (0, [3, 2])}.items():
        layout, buffers = got[i]
        sets = unpack(layout, buffers)
        assert len(sets) == len(sizes)
        for columns, n in zip(sets, sizes, strict=True):
            assert _equal(columns, _rows(source, n)), (i, columns)


def test_two_producers_send_every_dtype_to_one_consumer_in_any_order() -> None:
    _run(3, _two_producers_ranks)


# ----- one message or several: transfers on both sides of INLINE_BYTES -----

SIZES = (1, 1_000, 2_500, 40_000)
"""Rows per transfer: 1_000 rows of ``_rows`` (23 bytes each) take 23 KB (one
message), 2_500 58 KB (one message, near the limit), 40_000 920 KB (the prelude, then
the header and the buffers)."""


def _sizes_ranks(rank: int) -> None:
    if rank == 0:
        sender = Sender()
        for k, n in enumerate(SIZES):
            sender.send(1, k * PULL_TAGS, lambda n=n: pack([_rows(0, n)]))
        while sender.pending():
            time.sleep(0.01)
        return
    got = receive([Pull(0, k * PULL_TAGS) for k in reversed(range(len(SIZES)))])
    for (layout, buffers), n in zip(got, reversed(SIZES), strict=True):
        assert _equal(unpack(layout, buffers)[0], _rows(0, n)), n
    big = sum(b.numel() * b.element_size() for b in pack([_rows(0, SIZES[-1])])[1].values())
    near = sum(b.numel() * b.element_size() for b in pack([_rows(0, SIZES[-2])])[1].values())
    assert near < INLINE_BYTES < big, "the cases lie on both sides of the limit"


def test_transfers_of_one_message_and_of_several_arrive_whole_side_by_side() -> None:
    _run(2, _sizes_ranks)


# ----- a producer that cannot pack its rows: the consumer raises its message -----

def _unsendable_ranks(rank: int) -> None:
    if rank == 0:
        sender = Sender()

        def missing() -> tuple[Packed, dict[str, torch.Tensor]]:
            raise KeyError("no shard 'gen#4'")

        sender.send(1, 0, missing)
        sender.send(1, PULL_TAGS, lambda: pack([{"z": torch.zeros(2, dtype=torch.complex32)}]))
        sender.send(1, 2 * PULL_TAGS, lambda: pack([_rows(0, 2)]))
        while sender.pending():
            time.sleep(0.01)
        return
    with pytest.raises(RowsUnavailableError, match="worker 0 could not send the rows: KeyError: \"no shard 'gen#4'\""):
        receive([Pull(0, 0)])
    with pytest.raises(RowsUnavailableError, match="complex32 cannot be sent"):
        receive([Pull(0, PULL_TAGS)])
    # The failed transfers left nothing behind: the next one arrives whole.
    (layout, buffers), = receive([Pull(0, 2 * PULL_TAGS)])
    assert _equal(unpack(layout, buffers)[0], _rows(0, 2))


def test_a_producer_that_cannot_send_sends_why_and_the_next_transfer_arrives_whole() -> None:
    _run(2, _unsendable_ranks)


# ----- a producer that dies: the consumer's receive fails at once, as a peer failure -----

def _death_ranks(rank: int) -> None:
    if rank == 1:
        time.sleep(1.0)
        os._exit(0)  # dies with the consumer waiting for its rows
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        receive([Pull(1, 0)])
    assert is_peer_failure(info.value), info.value
    assert time.monotonic() - start < 30  # not the group's 60 s timeout
    os._exit(0)


def test_a_producer_that_dies_fails_the_receive_at_once_as_a_peer_failure() -> None:
    _run(2, _death_ranks)
