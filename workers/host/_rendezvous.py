"""The session's torch.distributed rendezvous, carried over Ray instead of a TCPStore.

``dist.init_process_group(init_method="tcp://...")`` makes one worker host a
``TCPStore``: a listener that accepts any unauthenticated client on all interfaces
for as long as the session runs. Here the key-value store lives in a Ray actor
(:class:`~workers.host._store_server.StoreServer`) and every worker reaches it through :class:`RayStore`, a
``torch.distributed.Store`` whose operations are Ray actor calls, so the rendezvous
travels over Ray's own (authenticated) channels and opens no port of its own::

    server = ray.remote(StoreServer).options(num_cpus=0).remote()   # driver, one per session at a time
    # in each worker:
    bind_gloo_to_node(ray.util.get_node_ip_address())   # workers.host._binding
    dist.init_process_group("gloo", store=RayStore(server, timeout), rank=r, world_size=n)

A world of one process (a session of one worker) meets nobody: it keeps its
groups' keys in a ``dist.HashStore`` of its own, and no server starts for it.

What torch 2.13 asks of a store, and how it reaches a Python one: torch calls a
Python ``Store`` subclass through a C++ trampoline, which forwards ``set``, ``get``,
``add``, ``compare_set``, ``check``, ``wait`` (with and without a timeout),
``multi_get``, ``multi_set``, ``append``, ``has_extended_api`` and ``clone`` under
those names, and ``delete_key`` and ``num_keys`` under their C++ names
``deleteKey`` and ``getNumKeys``. ``PrefixStore`` (every process group wraps the
store in one per group and per device) goes through that trampoline; the queue
operations and ``list_keys`` are not forwarded (the C++ base raises
``NotImplementedError``) and nothing on the process-group path uses them. The users:

- the gloo backend's full-mesh rendezvous, once per process group: each rank
  calls ``set`` with its listener's address under its rank, then ``wait`` and
  ``get`` for every rank's (its own included): 1 + 2N calls per rank for N ranks.
  It does not use the extended API (``multi_get``, ``append``) in this version,
  whatever ``has_extended_api()`` says;
- ``_store_based_barrier`` (``init_process_group``/``new_group`` when
  ``TORCH_DIST_INIT_BARRIER=1``): ``add`` then ``wait`` with a 10 s logging interval,
  catching ``RuntimeError`` to log and wait again, so timeouts here raise a
  ``DistStoreError`` (a ``RuntimeError``);
- ``new_group`` and ``DeviceMesh``: the same, under per-group key prefixes (a
  1-D mesh over the whole world reuses the default group and calls nothing);
  ``split_group``/``shrink`` call ``clone()``.

Gloo's own data connections are a separate matter: see :mod:`workers.host._binding`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import ray
import torch.distributed as dist

from channels import TransportError

logger = logging.getLogger(__name__)

__all__ = ["RayStore", "RendezvousError", "RendezvousTimeoutError"]

_RPC_GRACE_S = 30.0
"""Added to a waiting call's own timeout for the Ray round trip: the server's
deadline is the one that reports a missing key; this one only catches a server
that stopped answering."""


class RendezvousError(TransportError, dist.DistStoreError):
    """The rendezvous store failed (its actor died, or a value is not a counter).

    A ``DistStoreError`` (hence a ``RuntimeError``) so torch's own handling of store
    failures applies to it.
    """


class RendezvousTimeoutError(RendezvousError):
    """Keys were not set before the timeout; the message names them and the timeout."""


class RayStore(dist.Store):
    """A ``torch.distributed.Store`` whose operations run on a :class:`StoreServer` actor.

    Use it wherever torch takes a store: ``init_process_group(store=...)``, then
    ``new_group`` and ``DeviceMesh`` reuse it through the default group. Each
    operation is one ``ray.get`` of one actor call, so it works from any process
    connected to the Ray cluster. It pickles as its actor handle and timeout, and
    constructing one is cheap, so each worker can build its own from the handle.

    Args:
        server: handle of the session's :class:`StoreServer` actor.
        timeout: how long ``get``, ``multi_get`` and ``wait`` (without a timeout
            of its own) wait for keys, and how long any call may take.

    Raises (from its operations):
        RendezvousTimeoutError: keys were not set in time (a ``DistStoreError``).
        RendezvousError: the store actor died or cannot be reached.

    Every instance stays alive until the process exits. Torch's C++ side (the
    process groups' prefix stores) keeps using a store after Python dropped
    its last reference, but pybind11 finds a Python subclass's methods through the
    Python object: once that is collected, every call fails with "INTERNAL ASSERT
    FAILED ... Not implemented". So ``init_process_group(store=RayStore(...))``
    is safe without the caller keeping a reference.
    """

    def __init__(self, server: Any, timeout: timedelta) -> None:
        super().__init__()
        self._server = server
        self._timeout = timeout
        super().set_timeout(timeout)
        _LIVE_STORES.append(self)

    def __reduce__(self) -> tuple[Any, ...]:
        return (RayStore, (self._server, self._timeout))

    def set_timeout(self, timeout: timedelta) -> None:
        """Change how long operations wait (see the class docstring)."""
        super().set_timeout(timeout)
        self._timeout = timeout

    # ----- the operations the C++ trampoline forwards -----

    def set(self, key: str, value: str | bytes) -> None:
        """Store ``value`` under ``key``."""
        self._call("set", key, _as_bytes(value))

    def get(self, key: str) -> bytes:
        """The value under ``key``, waiting up to the store's timeout for it."""
        return self._call("get", key, self._timeout_s(), waits=True)

    def add(self, key: str, value: int) -> int:
        """Add ``value`` to the counter under ``key``; return the new count."""
        return self._call("add", key, value)

    def compare_set(self, key: str, expected_value: str | bytes,
                    desired_value: str | bytes) -> bytes:
        """``TCPStore``'s compare-and-set (see :meth:`StoreServer.compare_set`)."""
        return self._call("compare_set", key, _as_bytes(expected_value), _as_bytes(desired_value))

    def check(self, keys: list[str]) -> bool:
        """Whether every key in ``keys`` exists."""
        return self._call("check", list(keys))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Return once every key exists; wait at most ``timeout`` (default: the store's)."""
        timeout_s = self._timeout_s() if timeout is None else timeout.total_seconds()
        self._call("wait", list(keys), timeout_s, waits=True)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """The values under ``keys``, waiting up to the store's timeout for all of them."""
        return self._call("multi_get", list(keys), self._timeout_s(), waits=True)

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        """Store each value under its key."""
        self._call("multi_set", list(keys), [_as_bytes(v) for v in values])

    def append(self, key: str, value: str | bytes) -> None:
        """Append ``value`` to the bytes under ``key``."""
        self._call("append", key, _as_bytes(value))

    def deleteKey(self, key: str) -> bool:
        """Remove ``key``; return whether it existed (the C++ name, which torch's
        trampoline calls; ``delete_key`` is the Python one)."""
        return self._call("delete_key", key)

    def getNumKeys(self) -> int:
        """How many keys the store holds (the C++ name, which torch's trampoline
        calls; ``num_keys`` is the Python one)."""
        return self._call("num_keys")

    def delete_key(self, key: str) -> bool:
        """Remove ``key``; return whether it existed."""
        return self.deleteKey(key)

    def num_keys(self) -> int:
        """How many keys the store holds."""
        return self.getNumKeys()

    def has_extended_api(self) -> bool:
        """True: ``multi_get``, ``multi_set``, ``append`` and ``add`` are supported
        (torch code that checks this may use them; gloo's rendezvous in torch 2.13
        does not)."""
        return True

    def clone(self) -> RayStore:
        """Another client of the same store (``split_group`` and ``shrink`` use it)."""
        return RayStore(self._server, self._timeout)

    # ----- internals -----

    def _timeout_s(self) -> float:
        return self._timeout.total_seconds()

    def _call(self, method: str, *args: Any, waits: bool = False) -> Any:
        deadline = self._timeout_s() + (_RPC_GRACE_S if waits else 0.0)
        ref = getattr(self._server, method).remote(*args)
        try:
            return ray.get(ref, timeout=deadline)
        except ray.exceptions.RayTaskError as e:
            # The server raises built-in errors (see workers.host._store_server).
            if isinstance(e.cause, TimeoutError):
                raise RendezvousTimeoutError(str(e.cause)) from None
            if isinstance(e.cause, ValueError):
                raise RendezvousError(str(e.cause)) from None
            raise
        except ray.exceptions.GetTimeoutError:
            ray.cancel(ref)
            raise RendezvousTimeoutError(
                f"{method}: the rendezvous store did not answer within {deadline:g} s "
                f"(arguments {_describe(args)})"
            ) from None
        except ray.exceptions.RayActorError as e:
            raise RendezvousError(
                f"{method}: the session's rendezvous store actor is gone ({e}); the session "
                "cannot form or re-form process groups and must be restarted"
            ) from None


_LIVE_STORES: list[RayStore] = []
"""Every :class:`RayStore` made in this process (see its docstring for why)."""


def _as_bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _describe(args: Sequence[Any]) -> str:
    text = ", ".join(repr(a) for a in args)
    return text if len(text) <= 200 else text[:200] + "..."
