"""The wire form of one group call as one rank sees it."""

from __future__ import annotations

import msgspec

from channels import PullPlan

_WIRE = {"frozen": True, "kw_only": True, "forbid_unknown_fields": True}


class DataArg(msgspec.Struct, **_WIRE):
    """A data argument: which rows to pull (None: this rank gets none)."""

    name: str
    plan: PullPlan | None


class CallSpec(msgspec.Struct, **_WIRE):
    """One rank's part of a group call.

    The pieces of every data argument's plan arrive, in order, as the positional
    tensor arguments of ``execute``: a fetched piece, or None for a piece in this
    worker's own store.
    """

    call_id: int
    role: str
    method: str
    out_key: str
    data_args: tuple[DataArg, ...] = ()
