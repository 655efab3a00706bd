"""The actor's weights to a rollout role on another pool, in bounded buckets, each
pull bounded in time.

``rollout.load_weights(actor.weights())`` moves the whole model in one pull: the
rollout ranks receive every parameter before they copy any, and a producer that
stalls holds the pull for good. :class:`WeightSync` queues one ``load_weights``
call per bucket of parameters instead (selections of one ``actor.weights()``
future, planned from its metadata), each with ``timeout_s``: a rollout rank then
holds at most one bucket beside its weights, and a bucket not in within the
timeout ends in :class:`~asyncflow.CallTimeoutError` naming the rollout rank and
the actor ranks it pulls from, never a hang. The bytes moved are the model's, as
with one pull, peer to peer, no gather to one rank.

A rollout role laid out tensor parallel (``t > 1``) loads the parameters it splits
with ``load_weight_shards``, in buckets of their own: each rollout rank pulls only
the rows of its shard, so a split parameter's bytes cross once per replica, not
once per rank; the parameters it holds whole every rank pulls whole.
"""

from __future__ import annotations

from typing import Any

from asyncflow import DataFuture, RoleGroup
from channels import BatchMeta, ConfigError
from workers.roles import WEIGHTS_VERSION, ActorWorker, RolloutWorker, weight_buckets

BUCKET_BYTES = 256 << 20
"""Default bytes of one bucket (over all publishing ranks)."""

TIMEOUT_S = 30.0
"""Default seconds one bucket's pull may take once its call runs: many times what
a default bucket (:data:`BUCKET_BYTES`) takes over gloo on a CPU machine, and below
Ray's own limit on a direct-transport fetch (60 s, ``RAY_rdt_fetch_fail_timeout_milliseconds``),
past which Ray kills both ends of the transfer and the error would name a death
instead of the stall."""


class WeightSync:
    """Bucketed, time-bounded weight loads from ``actor`` into ``rollout``.

    Call :meth:`prepare` once (it reads the weights' metadata); then
    :meth:`submit` queues a load without waiting, or ``await sync()`` loads and
    returns the version.

    Args:
        actor: the group whose ``weights()`` publishes the weights.
        rollout: the group whose ``load_weights`` takes them.
        bucket_bytes: the most bytes of one bucket; a larger parameter is a bucket
            of its own.
        timeout_s: seconds a bucket's call may run (None: no limit).
    """

    def __init__(self, actor: RoleGroup[ActorWorker], rollout: RoleGroup[RolloutWorker], *, bucket_bytes: int = BUCKET_BYTES,
                 timeout_s: float | None = TIMEOUT_S) -> None:
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise ConfigError(f"WeightSync: bucket_bytes must be an int >= 1, got {bucket_bytes!r}")
        self.actor, self.rollout = actor, rollout
        self.bucket_bytes, self.timeout_s = bucket_bytes, timeout_s
        self.buckets: list[tuple[str, ...]] | None = None
        """The parameters of each bucket, once :meth:`prepare` read them."""
        self.sharded: list[bool] = []
        """Per bucket: its parameters are split over the rollout's tensor-parallel
        ranks (loaded with ``load_weight_shards``)."""

    async def prepare(self) -> None:
        """Plan the buckets from the metadata of one ``actor.weights()`` (its rows
        stay where they are) and the parameters the rollout role splits."""
        meta = await self.actor.weights()
        if not isinstance(meta, BatchMeta):
            raise ConfigError(f"WeightSync: {self.actor.name}.weights() returned {type(meta).__name__}, not rows")
        split = set((await self.rollout.split_parameters())[0]) if self.rollout.layout.t > 1 else set()
        whole = weight_buckets([f for f in meta.fields if f.name not in split], rows=meta.num_rows,
                               bucket_bytes=self.bucket_bytes)
        shards = weight_buckets([f for f in meta.fields if f.name in split], rows=meta.num_rows,
                                bucket_bytes=self.bucket_bytes)
        self.buckets, self.sharded = whole + shards, [False] * len(whole) + [True] * len(shards)

    def submit(self) -> list[DataFuture[Any]]:
        """Queue the loads of the actor's current weights, one call per bucket in
        bucket order (the rollout's pool runs them in that order, before anything
        queued on it later); returns their futures (each resolves to the version)."""
        if self.buckets is None:
            raise ConfigError("WeightSync.submit: call `await sync.prepare()` first")
        weights = self.actor.weights()
        if self.sharded == [False]:  # the whole model at once: no selection needed
            return [self.rollout.load_weights(weights, timeout_s=self.timeout_s)]
        loads: list[DataFuture[Any]] = []
        for names, sharded in zip(self.buckets, self.sharded, strict=True):
            bucket = weights.select((*names, WEIGHTS_VERSION))
            loads.append(self.rollout.load_weight_shards(bucket, timeout_s=self.timeout_s) if sharded
                         else self.rollout.load_weights(bucket, timeout_s=self.timeout_s))
        return loads

    async def sync(self) -> int:
        """Load the actor's current weights into every rollout rank; their version."""
        if self.buckets is None:
            await self.prepare()
        versions = [await f for f in self.submit()]
        return int(versions[-1][0])
