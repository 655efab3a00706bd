"""asyncflow's data plane: batch schemas, shard stores, peer-to-peer pull plans,
transfer protocols and typed channels. Imports none of the other packages.

The names load on first use (PEP 562, :mod:`channels._lazy`): ``from channels import
ConfigError`` imports the errors, not torch or Ray."""

# The imports under TYPE_CHECKING are for type checkers only; the names reach users
# through __getattr__ (channels._lazy).
# ruff: noqa: F401

from __future__ import annotations

from typing import TYPE_CHECKING

from channels._lazy import lazy_exports

_EXPORTS = {
    "channels._batch": ("Batch", "dtype_name"),
    "channels._channel": ("ChannelStatistics", "ReceiveChannel", "SendChannel", "open_channel"),
    "channels._errors": ("AsyncflowError", "BrokenResourceError", "ChannelError", "ClosedResourceError", "ConfigError",
        "EndOfStream", "MissingFieldError", "SchemaError", "SenderDiedError", "TransportError", "USER_CODE_ERRORS",
        "WouldBlock"),
    "channels._layout": ("Coords", "GenCoords", "GenerationLayout", "Grouping", "Layout"),
    "channels._metrics": ("Metrics", "reduce_metrics"),
    "channels._pack": ("Packed", "pack", "unpack"),
    "channels._protocols": ("DP", "AllToAll", "Assignment", "Balance", "Collected", "MicroDP", "OneToAll",
        "PullTiming", "RankResult", "RankTiming", "RankZero", "TensorShards", "TransferProtocol"),
    "channels._pull": ("GroupPlan", "Piece", "PullPlan", "assemble", "plan_pull"),
    "channels._remote": ("CHANNEL_CONCURRENCY_GROUPS", "BlockingSendChannel", "ChannelAddress", "ChannelHost",
        "open_remote_channel"),
    "channels._remote_receive": ("RemoteReceiveChannel", "open_receiver"),
    "channels._rows": ("concat_meta", "select_rows"),
    "channels._schema": ("BatchMeta", "ColumnGroup", "FieldSpec", "RowRuns", "Segment", "merge_meta",
        "runs_from_indices", "runs_length"),
    "channels._split": ("split_rows",),
    "channels._store": ("ShardStore", "StoreStats"),
    "channels._stream": ("ROW_ID_BITS", "StreamItem", "collect_parts", "row_id"),
}
__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from channels._batch import (
        Batch,
        dtype_name,
    )
    from channels._channel import (
        ChannelStatistics,
        ReceiveChannel,
        SendChannel,
        open_channel,
    )
    from channels._errors import (
        USER_CODE_ERRORS,
        AsyncflowError,
        BrokenResourceError,
        ChannelError,
        ClosedResourceError,
        ConfigError,
        EndOfStream,
        MissingFieldError,
        SchemaError,
        SenderDiedError,
        TransportError,
        WouldBlock,
    )
    from channels._layout import (
        Coords,
        GenCoords,
        GenerationLayout,
        Grouping,
        Layout,
    )
    from channels._metrics import (
        Metrics,
        reduce_metrics,
    )
    from channels._pack import (
        Packed,
        pack,
        unpack,
    )
    from channels._protocols import (
        DP,
        AllToAll,
        Assignment,
        Balance,
        Collected,
        MicroDP,
        OneToAll,
        PullTiming,
        RankResult,
        RankTiming,
        RankZero,
        TensorShards,
        TransferProtocol,
    )
    from channels._pull import (
        GroupPlan,
        Piece,
        PullPlan,
        assemble,
        plan_pull,
    )
    from channels._remote import (
        CHANNEL_CONCURRENCY_GROUPS,
        BlockingSendChannel,
        ChannelAddress,
        ChannelHost,
        open_remote_channel,
    )
    from channels._remote_receive import (
        RemoteReceiveChannel,
        open_receiver,
    )
    from channels._rows import (
        concat_meta,
        select_rows,
    )
    from channels._schema import (
        BatchMeta,
        ColumnGroup,
        FieldSpec,
        RowRuns,
        Segment,
        merge_meta,
        runs_from_indices,
        runs_length,
    )
    from channels._split import (
        split_rows,
    )
    from channels._store import (
        ShardStore,
        StoreStats,
    )
    from channels._stream import (
        ROW_ID_BITS,
        StreamItem,
        collect_parts,
        row_id,
    )
