"""The rendezvous store's server: a key-value store with ``TCPStore``'s semantics,
run as an async Ray actor (one per session at a time, kept for the next one after a
clean close; :mod:`workers.host._rendezvous` is its client and the module that
explains the rendezvous).

Its actor process imports nothing but this module: the class is pickled by value
(``ray.cloudpickle.register_pickle_by_value`` below) and uses only the standard
library, so the process starts in about half a second of CPU instead of the two
that importing ``workers`` (torch, Ray Direct Transport, ``channels``) would cost
it, once per session. That is also why it raises the built-in ``TimeoutError``
and ``ValueError``: the client turns them into the rendezvous errors, which
derive from torch's ``DistStoreError``.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence

import ray.cloudpickle

__all__ = ["StoreServer"]

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class StoreServer:
    """The key-value store of one session's rendezvous, run as an async Ray actor.

    Created by the driver with ``ray.remote(StoreServer).options(num_cpus=0, ...)``
    for a session, or taken over from the driver's last session once
    :meth:`reset`. Its methods are
    coroutines, so waiting callers (one per rank in a rendezvous) wait together on
    the actor's event loop; Ray runs up to ``max_concurrency`` (1000 by default
    for async actors) at a time, which bounds how many ranks can wait at once.

    Keys are ``str`` and values ``bytes``, as in torch's ``Store``. The semantics
    are those of ``TCPStore`` (the tests compare the two operation by operation).

    Concurrency contract: ``get``, ``multi_get`` and ``wait`` wait until their
    keys exist, unblocked by ``set``, ``multi_set``, ``add``, ``append`` or
    ``compare_set`` creating them, and raise ``TimeoutError`` after ``timeout_s``
    (:class:`~workers.host._rendezvous.RayStore` raises it as a
    ``RendezvousTimeoutError``). Every other method returns at once.
    """

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        # One event per key somebody waits for, set once the key exists. A deleted
        # key's event is dropped (it was set), so later waiters get a fresh one.
        self._arrived: dict[str, asyncio.Event] = {}
        self._waiting = 0

    # ----- writes -----

    async def set(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key``."""
        self._store(key, value)

    async def multi_set(self, keys: Sequence[str], values: Sequence[bytes]) -> None:
        """Store each value under its key.

        Raises:
            ValueError: ``keys`` and ``values`` differ in length.
        """
        if len(keys) != len(values):
            raise ValueError(f"multi_set got {len(keys)} keys but {len(values)} values")
        for key, value in zip(keys, values, strict=True):
            self._store(key, value)

    async def append(self, key: str, value: bytes) -> None:
        """Append ``value`` to the bytes under ``key`` (which it creates if missing)."""
        self._store(key, self._data.get(key, b"") + value)

    async def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the counter under ``key`` (0 if missing); return the sum.

        The counter is stored as its decimal ASCII bytes, as ``TCPStore`` does, so
        ``get`` returns e.g. ``b"3"``.

        Raises:
            ValueError: the value under ``key`` is not a decimal integer (the
                client raises it as a ``RendezvousError``).
        """
        current = self._data.get(key, b"0")
        try:
            total = int(current) + amount
        except ValueError:
            raise ValueError(
                f"add({key!r}): the value {current[:40]!r} is not a counter; use a key "
                "that only add() writes"
            ) from None
        self._store(key, str(total).encode())
        return total

    async def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """Replace the value under ``key`` by ``desired`` if it equals ``expected``.

        ``TCPStore`` semantics: a missing key is created when ``expected`` is empty.
        Returns ``desired`` when it was stored, otherwise the current value, or
        ``expected`` itself when the key is missing and ``expected`` is not empty.
        """
        current = self._data.get(key)
        if current is None:
            if expected:
                return expected
        elif current != expected:
            return current
        self._store(key, desired)
        return desired

    async def delete_key(self, key: str) -> bool:
        """Remove ``key``; return whether it existed."""
        if self._data.pop(key, None) is None:
            return False
        self._arrived.pop(key, None)
        return True

    # ----- reads -----

    async def get(self, key: str, timeout_s: float) -> bytes:
        """The value under ``key``, waiting up to ``timeout_s`` for it to be set.

        Raises:
            TimeoutError: ``key`` was not set within ``timeout_s``.
        """
        await self._wait_for([key], timeout_s, "get")
        return self._data[key]

    async def multi_get(self, keys: Sequence[str], timeout_s: float) -> list[bytes]:
        """The values under ``keys``, waiting up to ``timeout_s`` for all of them.

        Raises:
            TimeoutError: some key was not set within ``timeout_s``.
        """
        await self._wait_for(keys, timeout_s, "multi_get")
        return [self._data[k] for k in keys]

    async def wait(self, keys: Sequence[str], timeout_s: float) -> None:
        """Return once every key in ``keys`` exists.

        Raises:
            TimeoutError: some key was not set within ``timeout_s``.
        """
        await self._wait_for(keys, timeout_s, "wait")

    async def check(self, keys: Sequence[str]) -> bool:
        """Whether every key in ``keys`` exists (true for no keys)."""
        return all(k in self._data for k in keys)

    async def num_keys(self) -> int:
        """How many keys the store holds."""
        return len(self._data)

    async def reset(self) -> bool:
        """Forget every key, for the next session to use this server as new; False
        (and nothing forgotten) while a caller still waits for a key."""
        if self._waiting:
            return False
        self._data.clear()
        self._arrived.clear()
        return True

    # ----- internals -----

    def _store(self, key: str, value: bytes) -> None:
        self._data[key] = value
        event = self._arrived.get(key)
        if event is not None:
            event.set()

    async def _wait_for(self, keys: Sequence[str], timeout_s: float, op: str) -> None:
        self._waiting += 1
        try:
            async with asyncio.timeout(timeout_s):
                # A woken key can be deleted again before this coroutine runs:
                # look again rather than trust the event.
                while missing := [k for k in keys if k not in self._data]:
                    event = self._arrived.get(missing[0])
                    if event is None:
                        event = self._arrived[missing[0]] = asyncio.Event()
                    await event.wait()
        except TimeoutError:
            missing = [k for k in keys if k not in self._data]
            raise TimeoutError(
                f"{op}: keys {missing} were not set within {timeout_s:g} s (the rendezvous "
                "timeout); a rank that should have set them is late, gone, or in another session"
            ) from None
        finally:
            self._waiting -= 1
