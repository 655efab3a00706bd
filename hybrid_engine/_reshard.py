"""Moving real weights between the training and generation layouts over
torch.distributed (gloo on CPU, NCCL on GPU), with every byte accounted for.

:class:`Resharder` runs a :class:`~hybrid_engine._plan.Plan` on one rank: it
gathers bucket by bucket inside the plan's groups, builds this rank's generation
tensors and, with the ``hybridflow`` method, rebinds each training shard to its
place inside the generation shard (``Tensor.set_``), so that no byte is kept
twice. :meth:`Resharder.to_training` gives every training shard its own storage
back, bit for bit, and lets the generation tensors go.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from channels import ConfigError
from hybrid_engine._plan import Bucket, ParamSpec, Plan, Slab

GroupFactory = Callable[[tuple[int, ...]], dist.ProcessGroup]
"""Makes the process group of some layout ranks; only members call it, every
member with the same groups in the same order."""


@dataclass(frozen=True, kw_only=True)
class TransitionStats:
    """What one rank's transition cost, counted from the tensors it moved and held."""

    seconds: float
    """Wall time of :meth:`Resharder.to_generation` on this rank."""
    sent_bytes: int
    """Bytes this rank's contributions were sent to other ranks (a gather of ``n``
    members sends each contribution ``n - 1`` times)."""
    received_bytes: int
    """Bytes of other ranks' contributions this rank received."""
    peak_bytes: int
    """The most parameter and staging bytes alive at once during the transition
    (distinct storages of the training tensors, generation tensors and buckets): at
    most the resident bytes plus one bucket's staging, plus, with ``hybridflow``, one
    training shard of one parameter while it moves into its generation tensor."""
    resident_bytes: int
    """Parameter bytes alive after it (training and generation tensors)."""
    staging_bytes: int
    """The largest bucket staging (send and gather buffers) this rank allocated."""


def _live_bytes(tensors: Iterable[Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


class Resharder:
    """One rank's side of a plan.

    Args:
        plan: the transition (the same on every rank).
        rank: this rank in ``plan.layout``.
        training: this rank's training tensors by parameter name: the chunk it
            trains with (for example a DTensor's ``to_local()``) of every parameter
            of its stage. With ``hybridflow`` they are rebound in place (their
            storage changes, the tensor objects stay).
        groups: makes the process group of a bucket's members.

    Raises:
        ConfigError: a training tensor is missing or has the wrong shape or dtype.
    """

    def __init__(self, plan: Plan, rank: int, training: Mapping[str, Tensor], groups: GroupFactory) -> None:
        self.plan = plan
        self.rank = rank
        self._groups = groups
        self._made: dict[tuple[int, ...], dist.ProcessGroup] = {}
        self.training: dict[str, Tensor] = {}
        for spec in plan.specs:
            chunk = plan.training_chunk(rank, spec)
            if chunk is None:
                continue
            t = training.get(spec.name)
            want = spec.chunk_shape(plan.layout.t)
            if t is None or tuple(t.shape) != want or t.dtype != spec.dtype:
                got = "missing" if t is None else f"{tuple(t.shape)} {t.dtype}"
                raise ConfigError(f"rank {rank}: training tensor {spec.name!r} must be {want} {spec.dtype}, "
                                  f"got {got}")
            self.training[spec.name] = t
        self._mine = [b for b in plan.buckets if rank in b.group]
        self.generation: dict[str, Tensor] = {}
        self._aliased: set[str] = set()
        self.stats: TransitionStats | None = None
        """The last :meth:`to_generation`'s figures."""

    def connect(self) -> None:
        """Make every process group this rank's buckets use now (collective over
        each group's members) rather than on the first transition."""
        for bucket in self._mine:
            if len(bucket.group) > 1:
                self._group(bucket.group)

    # ------------------------------------------------------------------ forward

    def to_generation(self) -> dict[str, Tensor]:
        """Gather this rank's generation tensors (collective over the plan's groups).

        Returns:
            Generation tensors by parameter name: every parameter of this rank's
            generation stages, sharded as its generation TP rank needs it (whole
            with ``allgather``). Valid until :meth:`to_training`.
        """
        if self.generation:
            raise ConfigError("to_generation called twice without to_training in between")
        start = time.perf_counter()
        device = next(iter(self.training.values())).device if self.training else torch.device("cpu")
        sent = received = staging = 0
        peak = self._measure(())
        for spec in self.plan.specs:  # the generation tensor is the training tensor itself
            if self._aliases_whole(spec):
                self.generation[spec.name] = self.training[spec.name]
        for bucket in self._mine:
            for name in dict.fromkeys(s.param for slabs in bucket.slabs.values() for s in slabs):
                peak = max(peak, self._rebind(name, device))
            s, r, out, held = self._gather(bucket, device)
            sent, received = sent + s, received + r
            staging, peak = max(staging, held), max(peak, self._measure((out,)) + held - out.nbytes)
            self._place(bucket, out, device)
            peak = max(peak, self._measure((out,)))
            del out
        peak = max(peak, self._measure(()))
        self.stats = TransitionStats(seconds=time.perf_counter() - start, sent_bytes=sent,
                                     received_bytes=received, peak_bytes=peak,
                                     resident_bytes=self._measure(()), staging_bytes=staging)
        return dict(self.generation)

    def _aliases_whole(self, spec: ParamSpec) -> bool:
        """Whether this rank's generation tensor of ``spec`` is exactly its training
        tensor: a parameter every rank holds whole, or (``hybridflow`` only: the
        baselines keep separate generation buffers) a generation shard that is the
        training shard."""
        own = self.plan.training_chunk(self.rank, spec)
        if own is None or list(self.plan.generation_chunks(self.rank, spec)) != [own]:
            return False
        return spec.dim is None or self.plan.method == "hybridflow"

    def _group(self, ranks: tuple[int, ...]) -> dist.ProcessGroup:
        if ranks not in self._made:
            self._made[ranks] = self._groups(ranks)
        return self._made[ranks]

    def _slab_bytes(self, slab: Slab) -> int:
        spec = self.plan.spec(slab.param)
        row = spec.chunk_shape(self.plan.layout.t)[1:]
        n = slab.hi - slab.lo
        for s in row:
            n *= s
        return n * spec.dtype.itemsize

    def _gather(self, bucket: Bucket, device: torch.device) -> tuple[int, int, Tensor, int]:
        """Every contribution of ``bucket`` in one uint8 buffer, in member order;
        with the bytes sent and received and the staging held (send + gather buffers)."""
        sizes = [sum(self._slab_bytes(s) for s in bucket.slabs.get(m, ())) for m in bucket.group]
        mine = sizes[bucket.group.index(self.rank)]
        send = torch.empty(mine, dtype=torch.uint8, device=device)
        offset = 0
        for slab in bucket.slabs.get(self.rank, ()):
            piece = self.training[slab.param].narrow(0, slab.lo, slab.hi - slab.lo)
            n = self._slab_bytes(slab)
            send[offset:offset + n].view(piece.dtype).view(piece.shape).copy_(piece)
            offset += n
        if len(bucket.group) == 1:  # nothing to exchange: the rank's own slabs are the bucket
            return 0, 0, send, send.nbytes
        out = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
        group = self._group(bucket.group)
        members = len(bucket.group)
        held = send.nbytes + out.nbytes
        if len(set(sizes)) == 1:
            dist.all_gather_single(out, send, group=group)
            return (members - 1) * mine, sum(sizes) - mine, out, held
        sent = received = 0
        offset = 0
        for index, (member, size) in enumerate(zip(bucket.group, sizes, strict=True)):
            if size:
                buf = out[offset:offset + size]
                if member == self.rank:
                    buf.copy_(send)
                    sent += (members - 1) * size
                else:
                    received += size
                dist.broadcast(buf, group=group, group_src=index)
            offset += size
        return sent, received, out, held

    def _place(self, bucket: Bucket, out: Tensor, device: torch.device) -> None:
        """Copy the gathered slabs this rank's generation tensors need into them."""
        offset = 0
        t = self.plan.layout.t
        for member in bucket.group:
            for slab in bucket.slabs.get(member, ()):
                spec = self.plan.spec(slab.param)
                n = self._slab_bytes(slab)
                chunks = self.plan.generation_chunks(self.rank, spec)
                rebound = spec.name in self._aliased and slab.chunk == self.plan.training_chunk(self.rank, spec)
                if slab.chunk in chunks and not rebound and not self._aliases_whole(spec):
                    target = self._generation_tensor(spec, device)
                    if spec.dim is not None:
                        width = spec.shape[spec.dim] // t
                        target = target.narrow(spec.dim, (slab.chunk - chunks.start) * width, width)
                    dest = target.narrow(0, slab.lo, slab.hi - slab.lo)
                    dest.copy_(out[offset:offset + n].view(spec.dtype).view(dest.shape))
                offset += n

    def _generation_tensor(self, spec: ParamSpec, device: torch.device) -> Tensor:
        g = self.generation.get(spec.name)
        if g is None:
            shape = self.plan.generation_shape(self.rank, spec)
            assert shape is not None
            g = self.generation[spec.name] = torch.empty(shape, dtype=spec.dtype, device=device)
        return g

    def _rebind(self, name: str, device: torch.device) -> int:
        """With ``hybridflow``, before ``name``'s first bucket: allocate its generation
        tensor, copy the training shard into its place there and rebind the training
        tensor to that place, freeing its own storage (the gathers fill the rest).
        Returns the live bytes at the moment both copies exist (0: nothing done)."""
        if self.plan.method != "hybridflow" or name in self._aliased or name not in self.training:
            return 0
        spec = self.plan.spec(name)
        own = self.plan.training_chunk(self.rank, spec)
        chunks = self.plan.generation_chunks(self.rank, spec)
        if own is None or own not in chunks or spec.dim is None or self._aliases_whole(spec):
            return 0
        width = spec.shape[spec.dim] // self.plan.layout.t
        view = self._generation_tensor(spec, device).narrow(spec.dim, (own - chunks.start) * width, width)
        local = self.training[name]
        with torch.no_grad():
            view.copy_(local)
            both = self._measure(())
            local.set_(view.untyped_storage(), view.storage_offset(), view.size(), view.stride())
        self._aliased.add(name)
        return both

    def _measure(self, extra: Iterable[Tensor]) -> int:
        return _live_bytes([*self.training.values(), *self.generation.values(), *extra])

    # ------------------------------------------------------------------ reverse

    def to_training(self) -> None:
        """Give every rebound training shard its own storage back (bit for bit) and
        drop the generation tensors. Local: no communication.

        The caller must drop its own references to the generation tensors (the
        rollout engine's) for their memory to be freed.
        """
        with torch.no_grad():
            for name in sorted(self._aliased):
                local = self.training[name]
                own = torch.empty(local.shape, dtype=local.dtype, device=local.device)
                own.copy_(local)
                local.set_(own.untyped_storage(), 0, own.size(), own.stride())
        self._aliased.clear()
        self.generation = {}
