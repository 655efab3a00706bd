"""Process groups whose communication backend can be dropped and rebuilt in place.

When one rank of a group call raises while its peers are blocked in a collective
with it, plain gloo leaves the peers waiting for the whole timeout, and the group is
unusable afterwards. A :class:`ReconnectableGroup` is a Python ``ProcessGroup``
(the custom c10d backend ``"asyncflow"``) whose collectives delegate to *inner*
backends it owns: gloo for CPU tensors and, made on first use, NCCL for CUDA
tensors. FSDP2, DTensor, DeviceMesh and DCP hold the outer object (functional
collectives find it by name), so the inner backends can be replaced under them:

* :meth:`~ReconnectableGroup.poison` drops the inner backends and the inner
  ``Work`` objects of the group's pending collectives (a live gloo ``Work`` keeps
  the sockets open). Gloo closes the sockets, so a peer blocked in a collective
  with this rank fails at once ("Connection closed by peer") instead of waiting
  for the timeout. A rank whose call failed calls :func:`workers.host._meshes.poison_all`, so
  the failure cascades through every group.
* :meth:`~ReconnectableGroup.heal` builds fresh inner backends over a new key
  prefix of the world's store; the same objects then work again.

Inner backends meet under ``asyncflow/<ranks>/<generation>/heal/<epoch>/<device>``
of the default group's store, not under the c10d group name: with
``use_local_synchronization`` c10d hashes the number of groups *this process* has
made into the name, which differs between members whose histories differ.

What waits for what: making a group (:func:`workers.host._meshes.new_reconnectable_group`,
:func:`workers.host._meshes.mesh_from_groups`) and healing it are collective over its members and wait,
up to its timeout, for all of them. Poisoning is local; it waits only for this
rank's own in-flight gloo work on the group (gloo's destructor joins its worker
threads). Poison from the thread that issues the collectives. Not supported:
``dist._coalescing_manager`` on these groups, and ``DeviceMesh._flatten`` (its new
group would be plain gloo).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions, GroupName

from channels import AsyncflowError, ConfigError

BACKEND = "asyncflow"
"""The c10d backend name that makes a :class:`ReconnectableGroup`."""

PEER_FAILURE_MESSAGES = (
    "Connection closed by peer",  # gloo: the peer closed its sockets (poisoned, or died)
    "Connection reset by peer",  # gloo: the peer's process died mid-transfer
    "Broken pipe",  # gloo: wrote to a socket the peer had closed
    "Application timeout caused pair closure",  # gloo: a pair closed by an earlier timeout
    "Timed out waiting",  # gloo: "Timed out waiting <ms>ms for recv operation to complete"
    "NCCL communicator was aborted",  # NCCL: a communicator of the collective was aborted
    "ncclRemoteError",  # NCCL: a remote rank failed
    "Watchdog caught collective operation timeout",  # NCCL: a peer never joined
)
"""Message fragments of the errors a rank gets when a *peer* broke a collective."""


class GroupPoisonedError(AsyncflowError, RuntimeError):
    """A collective was issued on a group poisoned on this rank and not healed yet."""


def _opts(opts: Any, factory: Any) -> Any:
    return factory() if opts is None else opts


def _device_type(tensors: object) -> str:
    """Device type of the first tensor of a (nested) list; ``"cpu"`` when there is none."""
    while isinstance(tensors, list | tuple):
        if not tensors:
            return "cpu"
        tensors = tensors[0]
    return tensors.device.type if isinstance(tensors, torch.Tensor) else "cpu"


class _TrackedWork(dist.Work):
    """An inner backend's ``Work`` that :meth:`ReconnectableGroup.poison` can let go of.

    A gloo ``Work`` keeps its backend's sockets open while it lives, and FSDP2 state
    or the functional-collective registry may hold one indefinitely. C++ callers
    reach only ``wait`` and ``get_future``.
    """

    def __init__(self, inner: Any, ranks: tuple[int, ...]) -> None:
        super().__init__()
        self._work: Any = inner
        self._ranks = ranks

    def release(self) -> None:
        self._work = None

    def _inner(self) -> Any:
        if self._work is None:
            raise GroupPoisonedError(f"process group {self._ranks} was poisoned while this "
                                     "collective was pending; its result is lost")
        return self._work

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        return self._inner().wait(timeout)

    def get_future(self) -> Any:
        return self._inner().get_future()

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()

    def _source_rank(self) -> int:  # recv from any source
        return self._inner()._source_rank()


class _CompletedWork(dist.Work):
    """The ``Work`` of a collective its backend already completed when it returned.

    Since torch 2.8, NCCL returns no ``Work`` (Python ``None``) for a synchronous
    collective (``opts.asyncOp`` false: what ``dist.all_reduce`` and friends pass
    without ``async_op=True``): it has already made the caller's current CUDA stream
    wait for the result. Torch's Python wrappers accept ``None``, but a Python
    process group must return a ``Work`` (C++ callers cast ``None`` to an empty
    pointer), so the group returns this one: nothing to wait for, and nothing a
    poison could take away.
    """

    def __init__(self, result: object) -> None:
        super().__init__()
        self._result = result

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def get_future(self) -> Any:
        future: torch.futures.Future[object] = torch.futures.Future()
        future.set_result(self._result)
        return future


class ReconnectableGroup(dist.ProcessGroup):
    """A process group whose inner backends can be dropped (:meth:`poison`) and rebuilt (:meth:`heal`).

    Made by c10d through :func:`register_backend`'s creator; call
    :func:`new_reconnectable_group` rather than the constructor. Collectives on CPU
    tensors, object collectives and barriers go to gloo; collectives on CUDA tensors
    go to NCCL. Attribute ``ranks``: the members' default-group ranks.
    """

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta,
                 *, ranks: Sequence[int]) -> None:
        """Connect the gloo backend (waits for every member, up to ``timeout``).

        Args:
            store: where the inner backends meet; the same on every member.
            rank: this process's rank in the group.
            size: the number of members.
            timeout: the collectives' and the rendezvous' timeout.
            ranks: the members' default-group ranks, in group-rank order.
        """
        super().__init__(rank, size)  # type: ignore[call-arg]  # the overload a subclass can use
        self._store, self._group_rank, self._size = store, rank, size
        self._timeout, self.ranks = timeout, tuple(ranks)
        self._lock = threading.Lock()
        self._name, self._epoch = "", 0
        self._works: weakref.WeakSet[_TrackedWork] = weakref.WeakSet()
        self._backends: dict[str, Any] | None = {"cpu": self._connect("cpu")}

    def __repr__(self) -> str:
        return f"ReconnectableGroup(ranks={self.ranks}, epoch={self._epoch})"

    @property
    def poisoned(self) -> bool:
        """True between :meth:`poison` and the next :meth:`heal`."""
        return self._backends is None

    @property
    def timeout(self) -> timedelta:
        """The collectives' timeout."""
        return self._timeout

    @property
    def epoch(self) -> int:
        """The epoch of the current inner backends (0 until the first heal)."""
        return self._epoch

    @property
    def group_name(self) -> str:  # type: ignore[override]
        """The c10d name (the base class does not read back a name set on a Python group)."""
        return self._name

    def _set_group_name(self, name: GroupName) -> None:
        self._name = name
        super()._set_group_name(name)

    def getBackendName(self) -> str:
        """The c10d backend name, ``"asyncflow"``."""
        return BACKEND

    def set_timeout(self, timeout: timedelta) -> None:
        """Set the timeout of later collectives and of the backends later heals build."""
        self._timeout = timeout
        for backend in (self._backends or {}).values():
            backend.set_timeout(timeout)

    def _connect(self, device_type: str) -> Any:
        store = dist.PrefixStore(f"heal/{self._epoch}/{device_type}", self._store)
        if device_type == "cpu":
            return dist.ProcessGroupGloo(store, self._group_rank, self._size, self._timeout)
        if device_type == "cuda" and dist.is_nccl_available():
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self._timeout
            options.is_high_priority_stream = False
            return dist.ProcessGroupNCCL(store, self._group_rank, self._size, options)
        raise ConfigError(f"process group {self.ranks} has no backend for {device_type!r} "
                          "tensors; pass CPU tensors (gloo) or CUDA tensors (NCCL)")

    def _inner(self, tensors: object = None, device_type: str | None = None) -> Any:
        device_type = device_type or _device_type(tensors)
        with self._lock:
            if self._backends is None:
                raise GroupPoisonedError(
                    f"process group {self.ranks} ({self._name}) was poisoned after a failed "
                    "call; every member must call heal_all(epoch) before it is used again")
            if device_type not in self._backends:  # NCCL: no rendezvous until its first use
                self._backends[device_type] = self._connect(device_type)
            return self._backends[device_type]

    def _track(self, work: Any, result: object = None) -> dist.Work:
        """``work`` as a Work that :meth:`poison` can release; a backend's ``None``
        (a synchronous collective it completed already) as a completed Work whose
        future holds ``result``."""
        if work is None:
            return _CompletedWork(result)
        tracked = _TrackedWork(work, self.ranks)
        with self._lock:
            self._works.add(tracked)
        return tracked

    def _drop(self) -> None:
        with self._lock:
            backends, self._backends = self._backends, None
            works, self._works = list(self._works), weakref.WeakSet()
        for work in works:
            work.release()
        for backend in (backends or {}).values():
            if dist.is_nccl_available() and isinstance(backend, dist.ProcessGroupNCCL):
                backend.abort()  # frees the communicator now, without waiting for peers

    def poison(self) -> None:
        """Drop the inner backends; collectives raise :class:`GroupPoisonedError` until healed.

        Local. Peers blocked in a gloo collective with this rank fail at once;
        peers inside an NCCL kernel notice only through NCCL's own error detection or
        their timeout. The group's pending ``Work`` objects let go of their result
        (``wait`` raises). Waits for this rank's in-flight gloo work on the group to
        end, which a peer's poison or the timeout ends.
        """
        self._drop()

    def heal(self, epoch: int) -> None:
        """Replace the inner backends (poisoned or not) with fresh ones over a new store prefix.

        Collective over the members: each calls it with the same ``epoch``; waits for
        all of them, up to the timeout.

        Args:
            epoch: larger than every earlier epoch of this group.

        Raises:
            ConfigError: if ``epoch`` is not larger than the current epoch.
            DistStoreError: if a member did not come within the timeout; the group
                stays poisoned (heal again with a larger epoch).
        """
        if epoch <= self._epoch:
            raise ConfigError(f"heal epoch must exceed the group's epoch {self._epoch}, got "
                              f"{epoch}; pass a new epoch, the same on every member")
        self._drop()
        self._epoch = epoch
        gloo = self._connect("cpu")
        with self._lock:
            self._backends = {"cpu": gloo}

    def shutdown(self) -> None:
        """Drop the backends and forget the group (``destroy_process_group`` calls it)."""
        self._drop()
        with _LOCK:
            _GROUPS[:] = [group for group in _GROUPS if group is not self]

    abort = shutdown

    # ----- collectives: the names torch.distributed and functional collectives call -----
    # Each runs on the inner backend of its tensors' device (default options when None)
    # and returns a tracked Work.

    def allreduce(self, tensors: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else tensors
        if opts is None or isinstance(opts, dist.ReduceOp):  # pg.allreduce(tensors, op)
            op, opts = opts, dist.AllreduceOptions()
            if op is not None:
                opts.reduceOp = op
        return self._track(self._inner(tensors).allreduce(tensors, opts), tensors)

    def allreduce_coalesced(self, tensors: Any, opts: Any = None) -> dist.Work:
        opts = _opts(opts, dist.AllreduceCoalescedOptions)
        return self._track(self._inner(tensors).allreduce_coalesced(tensors, opts), tensors)

    def broadcast(self, tensors: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        opts = _opts(opts, dist.BroadcastOptions)
        return self._track(self._inner(tensors).broadcast(tensors, opts), tensors)

    def reduce(self, tensors: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        return self._track(self._inner(tensors).reduce(tensors, _opts(opts, dist.ReduceOptions)), tensors)

    def allgather(self, outs: Any, ins: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        return self._track(self._inner(ins).allgather(outs, ins, _opts(opts, AllgatherOptions)), outs)

    def allgather_coalesced(self, outs: Any, ins: Any, opts: Any = None) -> dist.Work:
        opts = _opts(opts, AllgatherOptions)
        return self._track(self._inner(ins).allgather_coalesced(outs, ins, opts), outs)

    def all_gather_single(self, out: Any, inp: Any, opts: Any = None) -> dist.Work:
        opts = _opts(opts, AllgatherOptions)
        return self._track(self._inner(inp)._allgather_base(out, inp, opts), [out])

    def all_gather_single_coalesced(self, outs: Any, ins: Any, opts: Any = None) -> dist.Work:
        inner, opts = self._inner(ins), _opts(opts, AllgatherOptions)
        if hasattr(inner, "allgather_into_tensor_coalesced"):
            return self._track(inner.allgather_into_tensor_coalesced(outs, ins, opts), outs)
        return self._track(_one_by_one(inner._allgather_base, outs, ins, opts), outs)

    def gather(self, outs: Any, ins: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        return self._track(self._inner(ins).gather(outs, ins, _opts(opts, dist.GatherOptions)), outs)

    def scatter(self, outs: Any, ins: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        return self._track(self._inner(outs).scatter(outs, ins, _opts(opts, dist.ScatterOptions)), outs)

    def reduce_scatter(self, outs: Any, ins: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        opts = _opts(opts, dist.ReduceScatterOptions)
        return self._track(self._inner(outs).reduce_scatter(outs, ins, opts), outs)

    def reduce_scatter_single(self, out: Any, inp: Any, opts: Any = None) -> dist.Work:
        opts = _opts(opts, dist.ReduceScatterOptions)
        return self._track(self._inner(inp)._reduce_scatter_base(out, inp, opts), [out])

    def reduce_scatter_single_coalesced(self, outs: Any, ins: Any, opts: Any = None) -> dist.Work:
        inner, opts = self._inner(ins), _opts(opts, dist.ReduceScatterOptions)
        if hasattr(inner, "reduce_scatter_tensor_coalesced"):
            return self._track(inner.reduce_scatter_tensor_coalesced(outs, ins, opts), outs)
        return self._track(_one_by_one(inner._reduce_scatter_base, outs, ins, opts), outs)

    def alltoall(self, outs: Any, ins: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        return self._track(self._inner(ins).alltoall(outs, ins, _opts(opts, dist.AllToAllOptions)), outs)

    def all_to_all_single(self, out: Any, inp: Any, out_splits: Any,  # type: ignore[override]
                          in_splits: Any, opts: Any = None) -> dist.Work:
        opts = _opts(opts, dist.AllToAllOptions)
        return self._track(self._inner(inp).alltoall_base(out, inp, out_splits, in_splits, opts), [out])

    def barrier(self, opts: Any = None) -> dist.Work:  # type: ignore[override]
        opts = _opts(opts, dist.BarrierOptions)
        device = opts.device  # dist.barrier sets it: "cpu" for a group without c10d backends
        return self._track(self._inner(device_type=device.type if device else "cpu").barrier(opts))

    def send(self, tensors: Any, dst: int, tag: int) -> dist.Work:
        return self._track(self._inner(tensors).send(tensors, dst, tag))

    def recv(self, tensors: Any, src: int, tag: int) -> dist.Work:
        return self._track(self._inner(tensors).recv(tensors, src, tag), tensors)

    def recv_anysource(self, tensors: Any, tag: int) -> dist.Work:
        return self._track(self._inner(tensors).recv_anysource(tensors, tag), tensors)

    # The older names of the same collectives, still called by parts of torch.
    _allgather_base = all_gather_single  # type: ignore[assignment]
    allgather_into_tensor_coalesced = all_gather_single_coalesced  # type: ignore[assignment]
    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # type: ignore[assignment]
    alltoall_base = all_to_all_single  # type: ignore[assignment]


def _one_by_one(single: Any, outs: Sequence[torch.Tensor], ins: Sequence[torch.Tensor],
                opts: Any) -> dist.Work | None:
    """A coalesced op as single ops (gloo binds none): waits for all but the last
    (a backend's None: it completed already)."""
    works = [single(out, inp, opts) for out, inp in zip(outs, ins, strict=True)]
    assert works, "a coalesced collective of no tensors"
    for work in works[:-1]:
        if work is not None:
            work.wait()
    return works[-1]


_LOCK = threading.Lock()
_GROUPS: list[ReconnectableGroup] = []  # this process's live groups
def remember(group: ReconnectableGroup) -> None:
    """Count ``group`` among this process's live groups."""
    with _LOCK:
        _GROUPS.append(group)


def find(ranks: tuple[int, ...]) -> ReconnectableGroup | None:
    """This process's live group of ``ranks``, if it made one."""
    with _LOCK:
        return next((group for group in _GROUPS if group.ranks == ranks), None)


def local_groups() -> list[ReconnectableGroup]:
    """Every live reconnectable group of this process, sorted by ranks."""
    with _LOCK:
        return sorted(_GROUPS, key=lambda group: group.ranks)


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc``, or an error it was raised from, says a *peer* broke a collective.

    Args:
        exc: what a rank's call raised.

    Returns:
        True for :class:`GroupPoisonedError`, ``DistNetworkError``, ``DistStoreError``
        (a peer never came to a rendezvous) and a ``RuntimeError`` whose message holds
        one of :data:`PEER_FAILURE_MESSAGES` (gloo's and NCCL's words for a closed,
        reset or timed-out connection or an aborted communicator), here or along the
        ``__cause__`` chain; False otherwise: an error of the rank's own code.
    """
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, GroupPoisonedError | dist.DistNetworkError | dist.DistStoreError):
            return True
        if isinstance(seen, RuntimeError) and any(m in str(seen) for m in PEER_FAILURE_MESSAGES):
            return True
        seen = seen.__cause__
    return False
