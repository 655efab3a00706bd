"""Rows sent worker to worker over the session's process group (gloo on the CPU).

A call's rank pulls the rows another worker holds in one transfer per producer
worker: the driver asks the producer to :meth:`Sender.send` them (its ``io``
group, which never waits for the receiver) and hands the consumer a :class:`Pull`
naming the producer and the transfer's first tag; the consumer :func:`receive` s
every transfer of a call at once, before its method runs. A transfer is a
fixed-size prelude (each buffer's dtype and length, the header's length), the
header (the column layout, ``channels.pack``'s, or why the producer could not
send) and one buffer per dtype. Up to :data:`INLINE_BYTES` in all (most calls'
slices) it is one message, which the receiver takes into a buffer of that size
(gloo receives a shorter message into a longer buffer): each gloo message costs
tenths of a millisecond of two processes' CPU on a busy machine. A longer one
is the prelude, then on the next tags at once the header and the buffers.

What this costs against Ray Direct Transport, which it replaces for a call's rows
on the CPU: one Ray call to each producer, beside the consumer's call, instead of
a producer call whose result the driver awaits before Ray sends and receives the
tensors in two more calls, one transfer at a time per receiver. A failed transfer
stays the two workers' business: a producer's death fails the consumer's receive
at once (gloo's connection closes), a consumer's death leaves the producer
serving (Ray's direct transport kills both ends).
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from channels import Packed, TransportError, dtype_name

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.bool,
          torch.complex64, torch.complex128, torch.float8_e4m3fn, torch.float8_e5m2)
"""The dtypes a transfer carries, by their code in the prelude (one buffer each)."""

MAX_BUFFERS = len(DTYPES)

PULL_TAGS = 2 + MAX_BUFFERS
"""Tags one transfer uses (prelude, header, buffers): the driver hands out first
tags in steps of this."""

logger = logging.getLogger(__name__)

INLINE_BYTES = 64 * 1024
"""The largest transfer sent as one message (its parts at 16-byte aligned offsets)."""

_CODES = {d: i for i, d in enumerate(DTYPES)}
_PRELUDE = 2 + 2 * MAX_BUFFERS
"""int64s of a prelude: the header's length (negative: an error message's), the
buffers' count, then per buffer its dtype's code and its length."""
_ALIGN = 16


def _offsets(nbytes: Sequence[int]) -> tuple[list[int], int]:
    """Where each part of a one-message transfer starts, and the message's length."""
    starts, end = [], 0
    for n in nbytes:
        start = -(-end // _ALIGN) * _ALIGN
        starts.append(start)
        end = start + n
    return starts, end


class Pull(msgspec.Struct, frozen=True, array_like=True):
    """An order to receive one transfer: from worker ``source`` (its session-wide
    index, its rank in the session's process group), on tags from ``tag``."""

    source: int
    tag: int


class RowsUnavailableError(TransportError):
    """The producer worker could not send the rows a call pulls from it (its
    message says why, e.g. a shard already freed)."""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Packed)


class Sender:
    """A worker's sends in flight. Sends are posted, never waited for by the
    ``io`` thread that posts them, so that it is free again at once whatever its
    receiver does; a thread of the sender's own waits for each in turn and drops
    its tensors once gloo has handed them over (or failed: a receiver that died)."""

    def __init__(self) -> None:
        self._posted: queue.SimpleQueue[list[Any] | None] = queue.SimpleQueue()
        self._count = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._drain, name="asyncflow-sends", daemon=True).start()

    def send(self, dst: int, tag: int, rows: Callable[[], tuple[Packed, Mapping[str, torch.Tensor]]]) -> None:
        """Post the rows ``rows()`` packs to worker ``dst`` on tags from ``tag``
        (if ``rows`` raises, its message goes instead: the receiver raises it)."""
        try:
            packed, buffers = rows()
            if unknown := [d for d, b in buffers.items() if b.dtype not in _CODES]:
                raise TypeError(f"columns of dtype {', '.join(unknown)} cannot be sent (known: "
                                f"{', '.join(dtype_name(d) for d in DTYPES)})")
            tensors = [b.contiguous().reshape(-1) for b in buffers.values()]
            sizes = [x for t in tensors for x in (_CODES[t.dtype], t.numel())]
            header, length = _encoder.encode(packed), 1
        except Exception as e:
            tensors, sizes = [], []
            header, length = f"{type(e).__name__}: {e}".encode(), -1
        prelude = torch.zeros(_PRELUDE, dtype=torch.int64)
        prelude[:2 + len(sizes)] = torch.tensor([length * len(header), len(tensors), *sizes], dtype=torch.int64)
        messages = [prelude, torch.frombuffer(bytearray(header), dtype=torch.uint8), *tensors]
        nbytes = [t.numel() * t.element_size() for t in messages]
        starts, end = _offsets(nbytes)
        if end <= INLINE_BYTES:
            blob = torch.zeros(end, dtype=torch.uint8)
            for start, n, t in zip(starts, nbytes, messages, strict=True):
                blob[start:start + n] = t.view(torch.uint8)
            messages = [blob]
        works = [dist.isend(t, dst, tag=tag + i) for i, t in enumerate(messages)]
        with self._lock:
            self._count += 1
        self._posted.put([w for w in works if w is not None])  # the works keep their tensors

    def pending(self) -> int:
        """Sends not handed over yet."""
        with self._lock:
            return self._count

    def close(self) -> None:
        """Stop the waiting thread once the sends before it are done (before the
        process group goes, their waits end then)."""
        self._posted.put(None)

    def _drain(self) -> None:
        while (works := self._posted.get()) is not None:
            for w in works:
                try:
                    w.wait()
                except RuntimeError as e:  # the receiver died: the driver hears of it from Ray
                    logger.debug("a send failed: %s", e)
            with self._lock:
                self._count -= 1


_posted: collections.deque[tuple[int, int]] = collections.deque(maxlen=4096)
"""The latest pulls this process started to receive, as (source, tag)."""
_posted_lock = threading.Lock()


def receive(fetched: Sequence[Any], *, unless_begun: bool = False) -> list[tuple[Packed, dict[str, torch.Tensor]]]:
    """Each :class:`Pull` of ``fetched`` received (all at once), other items as
    they are: per item, a layout and its buffers (see :func:`channels.unpack`).
    ``unless_begun``: skip the pulls this process began to receive already (a
    pull is received once; its sender sends once).

    Raises:
        RowsUnavailableError: a producer could not send its rows.
        RuntimeError: a producer died mid-transfer (gloo's "Connection closed by
            peer" or the like: ``workers.host._groups.PEER_FAILURE_MESSAGES``).
    """
    with _posted_lock:
        pulls = [(i, f) for i, f in enumerate(fetched)
                 if isinstance(f, Pull) and not (unless_begun and (f.source, f.tag) in _posted)]
        _posted.extend((f.source, f.tag) for _, f in pulls)
    if not pulls:
        return list(fetched)
    firsts = [torch.empty(INLINE_BYTES, dtype=torch.uint8) for _ in pulls]
    _wait([dist.irecv(m, f.source, tag=f.tag) for m, (_, f) in zip(firsts, pulls, strict=True)])
    bodies, works = [], []
    for first, (_, f) in zip(firsts, pulls, strict=True):
        length, count, *sizes = first[:8 * _PRELUDE].view(torch.int64).tolist()
        dtypes = [DTYPES[sizes[2 * k]] for k in range(count)]
        nbytes = [8 * _PRELUDE, abs(length), *(sizes[2 * k + 1] * d.itemsize for k, d in enumerate(dtypes))]
        starts, end = _offsets(nbytes)
        if end <= INLINE_BYTES:  # all in the first message: copied out (the message buffer is freed)
            body, *buffers = (first[s:s + n].clone().view(d) for s, n, d in
                              zip(starts[1:], nbytes[1:], [torch.uint8, *dtypes], strict=True))
        else:
            body = torch.empty(abs(length), dtype=torch.uint8)
            buffers = [torch.empty(sizes[2 * k + 1], dtype=d) for k, d in enumerate(dtypes)]
            works += [dist.irecv(t, f.source, tag=f.tag + 1 + k) for k, t in enumerate([body, *buffers])]
        bodies.append((length, body, buffers))
    _wait(works)
    out = list(fetched)
    for (i, f), (length, body, buffers) in zip(pulls, bodies, strict=True):
        if length < 0:
            raise RowsUnavailableError(f"worker {f.source} could not send the rows: {body.numpy().tobytes().decode()}")
        packed = _decoder.decode(body.numpy().tobytes())
        out[i] = (packed, {dtype_name(t.dtype): t for t in buffers})
    return out


def _wait(works: Sequence[Any]) -> None:
    for w in works:
        if w is not None:
            w.wait()
