"""The bytes a transition should move and keep per rank, from the layout alone
(HybridFlow section 5.4), to check the measured figures against.

With ``M`` the bytes of the tensor-parallel (split) parameters, ``R`` those of the
parameters every rank holds whole, ``N = p * t`` the ranks of one training replica
and ``dg = N / (pg * tg)``:

============  ========================  ==================================
method        sent (= received)         resident after the transition
============  ========================  ==================================
allgather     (N - 1) / N * M           M / N + M + R (training shard + whole model)
vanilla       (N - 1) / N * M           M / N + M / (pg*tg) + R
hybridflow    (dg - 1) / N * M          M / (pg*tg) + R (zero redundancy)
============  ========================  ==================================

The formulas are exact for ``p = pg = 1`` (every stage holds every parameter);
with pipeline stages they assume stages of equal size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from channels import Layout
from hybrid_engine._plan import Method, ParamSpec


@dataclass(frozen=True, kw_only=True)
class ExpectedBytes:
    """One rank's figures by the formulas."""

    sent: int
    """Bytes sent (and received) per rank."""
    resident: int
    """Parameter bytes held after the transition (training and generation)."""


def expected_bytes(layout: Layout, specs: Sequence[ParamSpec], method: Method) -> ExpectedBytes:
    """The formulas' figures for one rank of ``layout`` (see the module text)."""
    split = sum(s.nbytes for s in specs if s.dim is not None)
    whole = sum(s.nbytes for s in specs if s.dim is None)
    gen = layout.generation
    n = layout.p * layout.t
    shard, gen_shard = split // n, split // (gen.pg * gen.tg)
    if method == "hybridflow":
        return ExpectedBytes(sent=(layout.dg - 1) * split // n, resident=gen_shard + whole)
    sent = (n - 1) * split // n
    if method == "vanilla":
        return ExpectedBytes(sent=sent, resident=shard + gen_shard + whole)
    return ExpectedBytes(sent=sent, resident=shard + split + whole)
