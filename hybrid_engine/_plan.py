"""What moves where when the actor's weights go from the training layout to the
generation layout: plain arithmetic over a :class:`~channels.Layout`, no tensors.

A parameter is described by a :class:`ParamSpec`: its full shape, dtype, the
dimension tensor parallelism splits (or none: every rank of its stage holds it
whole) and its training pipeline stage. Training rank ``(pp, tp)`` holds chunk
``tp`` of ``t`` of every parameter of stage ``pp``; a rank at generation position
``(gpp, gtp)`` needs chunks ``gtp*t/tg .. (gtp+1)*t/tg - 1`` (its generation
shard, chunk ``gtp`` of ``tg``) of every parameter of stages ``gpp*p/pg ..
(gpp+1)*p/pg - 1``.

A :class:`Plan` lists buckets: each is a group of ranks and the row slabs its
members contribute; every member receives every other member's slab. Buckets
hold at most ``bucket_bytes`` gathered bytes, so a transition needs one bucket
of staging memory beyond the weights it keeps.

Methods (the ``hybridflow`` one is HybridFlow's 3D-HybridEngine; the others are
its baselines, kept for measurement):

- ``"hybridflow"``: the ``hybridflow`` grouping; gathers inside micro-DP groups
  (the ``dg`` ranks whose training shards make one generation shard), and each
  rank's training shard becomes part of its generation shard in place.
- ``"vanilla"``: the ``vanilla`` grouping; gathers the whole model inside each
  training replica's ``p*t`` ranks, keeps its generation shard beside its
  training shard.
- ``"allgather"``: gathers the whole model inside each training replica and keeps
  all of it (what the actor did before the hybrid engine).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from channels import ConfigError, GenerationLayout, Layout

Method = Literal["allgather", "vanilla", "hybridflow"]
METHODS: tuple[Method, ...] = ("allgather", "vanilla", "hybridflow")


@dataclass(frozen=True, kw_only=True)
class ParamSpec:
    """One parameter of the model, unsharded."""

    name: str
    """Its name (as the rollout engine loads it)."""
    shape: tuple[int, ...]
    """The full shape."""
    dtype: torch.dtype
    """Its dtype."""
    dim: int | None = None
    """The dimension training tensor parallelism splits into ``t`` equal chunks; None:
    whole on every rank of its stage (norms, unsplit embeddings)."""
    stage: int = 0
    """The training pipeline stage that holds it."""

    @property
    def nbytes(self) -> int:
        """Bytes of the full tensor."""
        return _numel(self.shape) * _itemsize(self.dtype)

    def chunk_shape(self, parts: int) -> tuple[int, ...]:
        """The shape of one of ``parts`` chunks along :attr:`dim` (the full shape if
        it is not split)."""
        if self.dim is None:
            return self.shape
        return tuple(n // parts if i == self.dim else n for i, n in enumerate(self.shape))


@dataclass(frozen=True, kw_only=True)
class Slab:
    """Rows ``lo..hi`` (along the chunk's first dimension) of one training chunk."""

    param: str
    chunk: int
    """Training TP chunk index (0 for a parameter that is not split)."""
    lo: int
    hi: int


@dataclass(frozen=True, kw_only=True)
class Bucket:
    """One gather: each contributor sends its slabs to every other member."""

    group: tuple[int, ...]
    """The members (layout ranks, increasing)."""
    stage: int
    """The training stage of the bucket's parameters."""
    slabs: dict[int, tuple[Slab, ...]]
    """Per contributing member, what it sends, in order (the same rows of each
    member's own chunk)."""
    nbytes: int
    """Gathered bytes (all contributions)."""


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A transition of one model between one layout's training and generation shards."""

    layout: Layout
    method: Method
    specs: tuple[ParamSpec, ...]
    buckets: tuple[Bucket, ...]
    bucket_bytes: int

    def spec(self, name: str) -> ParamSpec:
        """The spec named ``name``."""
        return self._by_name[name]

    @functools.cached_property
    def _by_name(self) -> dict[str, ParamSpec]:
        return {s.name: s for s in self.specs}

    def training_chunk(self, rank: int, spec: ParamSpec) -> int | None:
        """The chunk of ``spec`` that ``rank`` trains with (None: not on its stage)."""
        c = self.layout.coords(rank)
        if spec.stage != c.pp:
            return None
        return c.tp if spec.dim is not None else 0

    def generation_chunks(self, rank: int, spec: ParamSpec) -> range:
        """The training chunks that make ``rank``'s generation shard of ``spec``
        (empty: not in its generation stage; ``range(t)`` when it keeps everything)."""
        g, gen = self.layout.gen_coords(rank), self.layout.generation
        if self.method == "allgather":
            return range(self.layout.t if spec.dim is not None else 1)
        ap = self.layout.p // gen.pg
        if not g.pp * ap <= spec.stage < (g.pp + 1) * ap:
            return range(0)
        if spec.dim is None:
            return range(1)
        at = self.layout.t // gen.tg
        return range(g.tp * at, (g.tp + 1) * at)

    def generation_shape(self, rank: int, spec: ParamSpec) -> tuple[int, ...] | None:
        """The shape of ``rank``'s generation tensor of ``spec`` (None: it holds none)."""
        chunks = self.generation_chunks(rank, spec)
        if not chunks:
            return None
        if spec.dim is None:
            return spec.shape
        part = spec.chunk_shape(self.layout.t)
        return tuple(n * len(chunks) if i == spec.dim else n for i, n in enumerate(part))


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def check_specs(layout: Layout, specs: Sequence[ParamSpec]) -> None:
    """Refuse specs that ``layout`` cannot split (naming the parameter and the
    divisibility that fails)."""
    seen: set[str] = set()
    for s in specs:
        if s.name in seen:
            raise ConfigError(f"parameter {s.name!r} appears twice")
        seen.add(s.name)
        if not 0 <= s.stage < layout.p:
            raise ConfigError(f"parameter {s.name!r}: stage {s.stage} is outside the layout's p={layout.p}")
        if s.dim is not None:
            if not 0 <= s.dim < len(s.shape):
                raise ConfigError(f"parameter {s.name!r}: dim {s.dim} is not a dimension of shape {s.shape}")
            if s.shape[s.dim] % layout.t:
                raise ConfigError(f"parameter {s.name!r}: size {s.shape[s.dim]} of dimension {s.dim} is not "
                                  f"divisible by the training tensor size t={layout.t}")


def make_plan(layout: Layout, specs: Sequence[ParamSpec], *, method: Method,
              bucket_bytes: int = 64 << 20) -> Plan:
    """The buckets that take every rank of ``layout`` from its training to its
    generation shards with ``method``.

    Args:
        layout: the training layout with its generation layout (``layout.gen``).
        specs: the model's parameters, in the order to send them.
        method: ``"hybridflow"``, ``"vanilla"`` or ``"allgather"``.
        bucket_bytes: the most gathered bytes of one bucket.

    Raises:
        ConfigError: an unknown method, a method whose grouping differs from the
            layout's, a parameter the layout cannot split, or a bucket too small
            for one row of a parameter from every member.
    """
    if method not in METHODS:
        raise ConfigError(f"resharding method must be one of {METHODS}, got {method!r}")
    gen = layout.generation
    if method != "allgather" and gen.grouping != method:
        raise ConfigError(f"method {method!r} needs the {method!r} grouping, but the layout's generation "
                          f"grouping is {gen.grouping!r}")
    if bucket_bytes < 1:
        raise ConfigError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    check_specs(layout, specs)
    groups = layout.gen_groups("micro_dp") if method == "hybridflow" else _replica_groups(layout)
    buckets: list[Bucket] = []
    for group in groups:
        for stage in range(layout.p):
            contributors = [r for r in group if layout.coords(r).pp == stage]
            if not contributors:
                continue
            buckets.extend(_bucket_stage(layout, specs, group, stage, contributors, bucket_bytes))
    return Plan(layout=layout, method=method, specs=tuple(specs), buckets=tuple(buckets),
                bucket_bytes=bucket_bytes)


def _replica_groups(layout: Layout) -> list[tuple[int, ...]]:
    """The ``p*t`` ranks of each training replica."""
    groups: dict[int, list[int]] = {}
    for r in range(layout.world):
        groups.setdefault(layout.coords(r).dp, []).append(r)
    return [tuple(v) for _, v in sorted(groups.items())]


def _bucket_stage(layout: Layout, specs: Sequence[ParamSpec], group: tuple[int, ...], stage: int,
                  contributors: list[int], bucket_bytes: int) -> list[Bucket]:
    """Buckets of one stage's parameters inside ``group``: each contributor's chunk
    is cut into row slabs so that no bucket gathers more than ``bucket_bytes``."""
    out: list[Bucket] = []
    pending: dict[int, list[Slab]] = {r: [] for r in contributors}
    size = 0

    def flush() -> None:
        nonlocal size
        if size:
            out.append(Bucket(group=group, stage=stage, slabs={r: tuple(v) for r, v in pending.items()},
                              nbytes=size))
        for v in pending.values():
            v.clear()
        size = 0

    for spec in specs:
        if spec.stage != stage:
            continue
        if spec.dim is None:
            # Whole on every contributor: nothing to send unless members of other
            # stages need it, and then only the first contributor sends.
            if len(contributors) == len(group):
                continue
            senders = contributors[:1]
        else:
            senders = contributors
        chunk = spec.chunk_shape(layout.t)
        rows = chunk[0] if chunk else 1
        row_bytes = (_numel(chunk[1:]) if chunk else 1) * _itemsize(spec.dtype) * len(senders)
        if row_bytes > bucket_bytes:
            raise ConfigError(f"bucket_bytes={bucket_bytes} cannot hold one row of {spec.name!r} from "
                              f"{len(senders)} ranks ({row_bytes} bytes); raise it")
        lo = 0
        while lo < rows:
            take = min(rows - lo, (bucket_bytes - size) // row_bytes)
            if take == 0:
                flush()
                continue
            for r in contributors:
                if r in senders:
                    c = layout.coords(r).tp if spec.dim is not None else 0
                    pending[r].append(Slab(param=spec.name, chunk=c, lo=lo, hi=lo + take))
            size += take * row_bytes
            lo += take
    flush()
    return [b for b in out if any(b.slabs.values())]


def layout_from(t: int, tg: int, *, p: int = 1, pg: int = 1, d: int = 1,
                grouping: Literal["hybridflow", "vanilla"] = "hybridflow") -> Layout:
    """``Layout(p, t, d)`` generating in ``pg-tg``: a shorthand for benches and tests."""
    return Layout(p=p, t=t, d=d, gen=GenerationLayout(pg=pg, tg=tg, grouping=grouping))
