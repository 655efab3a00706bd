"""The :class:`Metrics` protocol: each output rank returns a small dict of numbers
and the dicts are reduced key by key into one (means weighted by rows or tokens,
sums, extremes), so that a metric reported on ``d`` data-parallel ranks equals the
one a single rank reports on the same rows."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from channels._errors import ConfigError, SchemaError
from channels._layout import Layout
from channels._protocols import DP, Assignment, RankResult, TransferProtocol, _Replicated
from channels._schema import BatchMeta, runs_length

Reducer = Literal["mean", "token_mean", "sum", "max", "min"]
"""How :class:`Metrics` combines one key over the ranks that report it:

- ``"mean"``: weighted by the rows each rank had (its share of the call's first
  data argument), so a rank without rows does not count;
- ``"token_mean"``: weighted by the token count each rank reports under
  ``Metrics.tokens`` (a rank without tokens does not count);
- ``"sum"``, ``"max"``, ``"min"``: plain, over the reporting ranks.

A method whose value is already reduced over its ranks (equal on every rank)
keeps that value under any of them.
"""

_REDUCERS = ("mean", "token_mean", "sum", "max", "min")


class Metrics(TransferProtocol):
    """Rows distributed as ``over`` does; each output rank returns a small dict of
    numbers and the dicts are reduced key by key (see :data:`Reducer`), so that a
    mean reported on ``d`` data-parallel ranks equals the one a single rank reports
    on the same rows.

    Args:
        over: the protocol that distributes the rows (default ``DP()``).
        reduce: per-key reducers, e.g. ``{"tokens": "sum", "kl": "token_mean"}``.
        default: the reducer of keys not in ``reduce``.
        tokens: the key under which each rank reports its token count, the weight
            of ``"token_mean"`` keys (required when one is declared).

    Raises:
        ConfigError: an unknown reducer, or a ``"token_mean"`` key without ``tokens``.
    """

    def __init__(self, *, over: _Replicated | None = None, reduce: Mapping[str, Reducer] | None = None,
                 default: Reducer = "mean", tokens: str | None = None) -> None:
        self.over = over if over is not None else DP()
        self.reduce = dict(reduce or {})
        self.default = default
        self.tokens = tokens
        for k, how in [*self.reduce.items(), ("<default>", default)]:
            if how not in _REDUCERS:
                name = "Metrics.default" if k == "<default>" else f"Metrics.reduce[{k!r}]"
                raise ConfigError(f"{name} must be one of {', '.join(_REDUCERS)}, got {how!r}")
        if tokens is None and "token_mean" in (default, *self.reduce.values()):
            raise ConfigError("Metrics: a 'token_mean' reducer needs tokens=KEY, the metric under which "
                              "each rank reports its token count")

    def distribute(self, meta: BatchMeta, layout: Layout, row_lengths: Sequence[int] | None) -> list[Assignment]:
        return self.over.distribute(meta, layout, row_lengths)

    def collect(self, results: Sequence[RankResult], layout: Layout, assignments: Sequence[Assignment] | None) -> dict[str, float]:
        ranks = [r for r, (_, out) in enumerate(self.over.replicas(layout)) if out]
        weights = None
        if assignments is not None:
            weights = [float(runs_length(assignments[r] or ())) for r in ranks]
        return reduce_metrics([results[r].value for r in ranks], self.reduce, weights=weights,
                              default=self.default, tokens=self.tokens)

    def counting_ranks(self, layout: Layout) -> list[bool] | None:
        """As ``over``'s."""
        return self.over.counting_ranks(layout)

    def __repr__(self) -> str:
        extra = "" if self.tokens is None else f", tokens={self.tokens!r}"
        return f"Metrics(over={self.over!r}, reduce={self.reduce}, default={self.default!r}{extra})"


def reduce_metrics(dicts: Sequence[Any], reduce: Mapping[str, Reducer] | None = None,
                   weights: Sequence[float] | None = None, *, default: Reducer = "mean",
                   tokens: str | None = None) -> dict[str, float]:
    """Reduce metric dicts (one per rank) key by key, as :data:`Reducer` says.

    A ``"mean"`` key is weighted by ``weights`` (the rows each dict's rank had), a
    ``"token_mean"`` key by the dict's own ``tokens`` entry; either is taken over the
    dicts that report the key, so ranks without rows (or tokens) do not dilute it.
    When every reporting rank weighs 0, the plain mean is used.

    Args:
        dicts: each rank's metrics.
        reduce: per-key reducers.
        weights: rows per dict (None: equal weights).
        default: the reducer of keys not in ``reduce``.
        tokens: the key holding each dict's token count (for ``"token_mean"``).

    Raises:
        SchemaError: an entry is not a dict of numbers, or a dict that reports a
            ``"token_mean"`` key lacks its ``tokens`` entry.
        ConfigError: a ``"token_mean"`` key without ``tokens``.
    """
    reduce = reduce or {}
    rows = list(weights) if weights is not None else [1.0] * len(dicts)
    values: dict[str, list[tuple[float, float]]] = {}
    for d, row_weight in zip(dicts, rows, strict=True):
        if not isinstance(d, Mapping):
            raise SchemaError(f"a Metrics method must return a dict of numbers, got {type(d).__name__}")
        for k, v in d.items():
            how = reduce.get(k, default)
            weight = _token_weight(d, k, tokens) if how == "token_mean" else row_weight
            try:
                values.setdefault(k, []).append((float(v), weight))
            except (TypeError, ValueError):
                raise SchemaError(f"metric {k!r} is not a number: {v!r}") from None
    return {k: _reduce(reduce.get(k, default), xs) for k, xs in values.items()}


def _token_weight(d: Mapping[str, Any], key: str, tokens: str | None) -> float:
    if tokens is None:
        raise ConfigError(f"metric {key!r} is reduced as 'token_mean' but no tokens key is given; "
                          "pass tokens=KEY (the metric holding each rank's token count)")
    if tokens not in d:
        raise SchemaError(f"metric {key!r} is a token mean, but a rank did not report its token count "
                          f"{tokens!r}; return it beside the means")
    try:
        return float(d[tokens])
    except (TypeError, ValueError):
        raise SchemaError(f"metric {tokens!r} is not a number: {d[tokens]!r}") from None


def _reduce(how: str, xs: list[tuple[float, float]]) -> float:
    vals = [x for x, _ in xs]
    if how == "sum":
        return float(sum(vals))
    if how == "max":
        return float(max(vals))
    if how == "min":
        return float(min(vals))
    if len(set(vals)) == 1:  # already reduced over the ranks: keep it exactly
        return vals[0]
    total = sum(weight for _, weight in xs)
    if total <= 0:
        return float(sum(vals) / len(vals))
    return float(sum(x * weight for x, weight in xs) / total)
