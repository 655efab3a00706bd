"""asyncflow's data plane: batch schemas, shard stores, peer-to-peer pull plans,
transfer protocols and typed channels. Imports none of the other packages."""

from channels._batch import Batch, dtype_name
from channels._channel import ChannelStatistics, ReceiveChannel, SendChannel, open_channel
from channels._errors import (
    AsyncflowError,
    BrokenResourceError,
    ChannelError,
    ClosedResourceError,
    ConfigError,
    EndOfStream,
    MissingFieldError,
    SchemaError,
    TransportError,
    WouldBlock,
)
from channels._layout import Coords, Layout
from channels._protocols import (
    DP,
    AllToAll,
    Assignment,
    Collected,
    Metrics,
    MicroDP,
    OneToAll,
    RankResult,
    RankZero,
    TransferProtocol,
    reduce_metrics,
    split_rows,
)
from channels._pull import GroupPlan, Piece, PullPlan, assemble, plan_pull
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
from channels._store import ShardStore, StoreStats

__all__ = [
    "DP", "AllToAll", "Assignment", "AsyncflowError", "Batch", "BatchMeta", "BrokenResourceError",
    "ChannelError", "ChannelStatistics", "ClosedResourceError", "Collected", "ColumnGroup",
    "ConfigError", "Coords", "EndOfStream", "FieldSpec", "GroupPlan", "Layout", "Metrics",
    "MicroDP", "MissingFieldError", "OneToAll", "Piece", "PullPlan", "RankResult", "RankZero",
    "ReceiveChannel", "RowRuns", "SchemaError", "Segment", "SendChannel", "ShardStore",
    "StoreStats", "TransferProtocol", "TransportError", "WouldBlock", "assemble", "dtype_name",
    "merge_meta", "open_channel", "plan_pull", "reduce_metrics", "runs_from_indices",
    "runs_length", "split_rows",
]
