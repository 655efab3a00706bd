"""Item types of ``test_remote_channel_on_cpu``.

They live apart from the test module because cloudpickle cannot rebuild a msgspec
Struct class by value (StructMeta reads the fields when the class is created, and
cloudpickle sets them afterwards): Ray workers import this module by name, from
the ``PYTHONPATH`` the test gives its Ray instance.
"""

from __future__ import annotations

import msgspec


class Item(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What the test channels carry."""

    n: int
    payload: bytes = b""


class Other(msgspec.Struct, frozen=True, kw_only=True):
    """Not an :class:`Item`."""

    n: int
