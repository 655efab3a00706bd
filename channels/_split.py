"""Splitting a batch's rows over ranks: :func:`split_rows`.

Without weights the split is contiguous and even. With weights (the rows' token
counts: ``DP(balance="tokens")``) the parts' summed weights are balanced, the parts
keep equal counts, and as many groups as balance allows stay where the even split
puts them: a data-parallel producer leaves its rows there (rank ``r`` of ``d``
made the ``r``-th contiguous share), so a group that stays is a group no rank pulls
from another.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from channels._errors import ConfigError
from channels._schema import RowRuns, runs_from_indices

MAX_SWAPS_PER_GROUP = 4
"""The balancing stops after this many swaps per group at most, a bound on the
driver's work (each swap narrows the gap between the heaviest and the lightest part,
so the search ends on its own long before on the batches measured)."""


def split_rows(n: int, parts: int, *, group_size: int = 1, weights: Sequence[int] | None = None) -> list[RowRuns]:
    """Split rows ``0..n-1`` into ``parts`` selections.

    Groups of ``group_size`` consecutive rows stay together, and the parts get as
    many groups each as the others, give or take one. Without ``weights`` the split
    is contiguous and even (order kept). With them, it starts from that split and
    swaps a group of the heaviest part (the largest summed weight) for a lighter
    group of the lightest part while a swap narrows their gap, the swap that
    halves it most closely first: groups move only where they even the loads out.
    When no swap is left, the heaviest and the lightest part differ by at most the
    heaviest group's weight. Within a part rows keep their order.

    Raises:
        ConfigError: ``n`` is not a multiple of ``group_size``.
    """
    if n % group_size:
        raise ConfigError(f"{n} rows cannot be split into whole groups of {group_size}")
    groups = n // group_size
    spans = _even(groups, parts)
    if weights is None:
        return [((a * group_size, b * group_size),) if b > a else () for a, b in spans]
    group_weights = [sum(weights[g * group_size:(g + 1) * group_size]) for g in range(groups)]
    members = _balanced(group_weights, [range(a, b) for a, b in spans])
    return [runs_from_indices(i for g in m for i in range(g * group_size, (g + 1) * group_size)) for m in members]


def _even(groups: int, parts: int) -> list[tuple[int, int]]:
    """Each part's groups ``[start, stop)`` in the contiguous even split."""
    base, extra = divmod(groups, parts)
    out, start = [], 0
    for p in range(parts):
        stop = start + base + (p < extra)
        out.append((start, stop))
        start = stop
    return out


def _balanced(weights: Sequence[int], parts: list[range]) -> list[list[int]]:
    """The groups of each part (sorted) after swapping from ``parts`` as
    :func:`split_rows` says."""
    held = [sorted((weights[g], g) for g in part) for part in parts]  # each part's (weight, group), lightest first
    load = [sum(w for w, _ in part) for part in held]
    count = range(len(held))
    for _ in range(MAX_SWAPS_PER_GROUP * len(weights)):
        heavy = max(count, key=lambda p: (load[p], -p))
        light = min(count, key=lambda p: (load[p], p))
        swap = _best_swap(held[heavy], held[light], load[heavy] - load[light])
        if swap is None:
            break
        out, into = swap
        held[heavy].remove(out)
        held[light].remove(into)
        bisect.insort(held[heavy], into)
        bisect.insort(held[light], out)
        load[heavy] += into[0] - out[0]
        load[light] += out[0] - into[0]
    return [sorted(g for _, g in part) for part in held]


def _best_swap(heavy: list[tuple[int, int]], light: list[tuple[int, int]], gap: int
               ) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """The (heavy part's, light part's) groups whose swap narrows ``gap`` most: it
    moves ``d`` = their weights' difference, ``0 < d < gap``, as close to ``gap / 2``
    as any pair; None when no pair narrows it."""
    light_weights = [w for w, _ in light]
    best: tuple[int, tuple[int, int], tuple[int, int]] | None = None
    for out in heavy:
        # the light group nearest out's weight - gap / 2 is the best partner, if any is in range
        at = bisect.bisect_left(light_weights, out[0] - gap / 2)
        for j in (at - 1, at):
            if 0 <= j < len(light):
                moved = out[0] - light[j][0]
                miss = abs(gap - 2 * moved)
                if 0 < moved < gap and (best is None or miss < best[0]):
                    best = (miss, out, light[j])
    return None if best is None else (best[1], best[2])
