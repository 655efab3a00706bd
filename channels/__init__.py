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
    SenderDiedError,
    TransportError,
    WouldBlock,
)
from channels._layout import Coords, GenCoords, GenerationLayout, Grouping, Layout
from channels._metrics import Metrics, reduce_metrics
from channels._pack import Packed, pack, unpack
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
from channels._pull import GroupPlan, Piece, PullPlan, assemble, plan_pull
from channels._remote import (
    CHANNEL_CONCURRENCY_GROUPS,
    BlockingSendChannel,
    ChannelAddress,
    ChannelHost,
    open_remote_channel,
)
from channels._remote_receive import RemoteReceiveChannel, open_receiver
from channels._rows import concat_meta, select_rows
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
from channels._split import split_rows
from channels._store import ShardStore, StoreStats
from channels._stream import ROW_ID_BITS, StreamItem, collect_parts, row_id

__all__ = [
    "CHANNEL_CONCURRENCY_GROUPS", "DP", "ROW_ID_BITS", "AllToAll", "Assignment", "AsyncflowError",
    "Balance",
    "Batch", "BatchMeta", "BlockingSendChannel", "BrokenResourceError", "ChannelAddress",
    "ChannelError", "ChannelHost", "ChannelStatistics", "ClosedResourceError", "Collected",
    "ColumnGroup", "ConfigError", "Coords", "EndOfStream", "FieldSpec", "GenCoords", "GenerationLayout",
    "GroupPlan", "Grouping", "Layout",
    "Metrics", "MicroDP", "MissingFieldError", "OneToAll", "Packed", "Piece", "PullPlan", "PullTiming",
    "RankResult", "RankTiming", "RankZero", "ReceiveChannel", "RemoteReceiveChannel", "RowRuns", "SchemaError", "Segment",
    "SendChannel", "SenderDiedError", "ShardStore", "StoreStats", "StreamItem", "TensorShards", "TransferProtocol",
    "TransportError", "WouldBlock", "assemble", "collect_parts", "concat_meta", "dtype_name", "merge_meta",
    "open_channel", "open_receiver", "open_remote_channel", "pack", "plan_pull", "reduce_metrics", "row_id",
    "runs_from_indices", "runs_length", "select_rows", "split_rows", "unpack",
]
