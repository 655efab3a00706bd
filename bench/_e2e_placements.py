"""Where the end-to-end workload's roles run (data only: the runs read it before
anything heavy imports)."""

from __future__ import annotations

PLACEMENTS: dict[str, tuple[dict[str, int], dict[str, str]]] = {
    "one": ({"main": 1}, {"actor": "main", "ref": "main", "reward": "main"}),
    "dp2": ({"main": 2}, {"actor": "main", "ref": "main", "reward": "main"}),
    "split": ({"policy": 1, "side": 1}, {"actor": "policy", "ref": "side", "reward": "side"}),
}
"""The placements that fit two cores: one 1-rank pool; one 2-rank pool (data
parallel); the actor on one rank, reference and reward on the other."""
