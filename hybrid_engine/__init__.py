"""Resharding of the actor's weights between its training layout (p-t-d) and its
generation layout (pg-tg-dg-d): HybridFlow's 3D-HybridEngine.

- :func:`make_plan` computes, from a :class:`~channels.Layout` with its
  :class:`~channels.GenerationLayout` and the model's :class:`ParamSpec` s, which
  rows each rank gathers from which, in buckets of bounded size, for one of three
  methods: ``hybridflow`` (gathers inside micro-DP groups only, each training
  shard reused in place: zero redundancy), and the baselines ``vanilla``
  (HybridFlow-V grouping) and ``allgather`` (every rank gathers the whole model).
- :class:`Resharder` runs a plan on real tensors over torch.distributed and counts
  the bytes it sends, receives and holds (:class:`TransitionStats`);
  :meth:`Resharder.to_training` reverses it bit for bit.
- :func:`expected_bytes` gives the figures the methods should reach, from the
  layout alone.

The rank arithmetic of the layouts (``GenerationLayout``, ``Layout.gen_coords``)
lives in ``channels``, where the ``MicroDP`` transfer protocol uses it too.
"""

from hybrid_engine._formulas import ExpectedBytes, expected_bytes
from hybrid_engine._plan import (
    METHODS,
    Bucket,
    Method,
    ParamSpec,
    Plan,
    Slab,
    layout_from,
    make_plan,
)
from hybrid_engine._reshard import GroupFactory, Resharder, TransitionStats

__all__ = [
    "METHODS", "Bucket", "ExpectedBytes", "GroupFactory", "Method", "ParamSpec", "Plan", "Resharder", "Slab",
    "TransitionStats", "expected_bytes", "layout_from", "make_plan",
]
