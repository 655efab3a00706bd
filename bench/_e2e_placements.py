"""Where the end-to-end workload's roles run, and Ray started for a placement (the
runs read it before anything heavy imports)."""

from __future__ import annotations

PLACEMENTS: dict[str, tuple[dict[str, int], dict[str, str]]] = {
    "one": ({"main": 1}, {"actor": "main", "ref": "main", "reward": "main"}),
    "dp2": ({"main": 2}, {"actor": "main", "ref": "main", "reward": "main"}),
    "split": ({"policy": 1, "side": 1}, {"actor": "policy", "ref": "side", "reward": "side"}),
}
"""The placements that fit two cores: one 1-rank pool; one 2-rank pool (data
parallel); the actor on one rank, reference and reward on the other."""


def start_ray_for(placement: str, *, device: str = "cpu", model_given: bool) -> None:
    """Start Ray and ``placement``'s CPU workers, which come up while the run goes on
    importing torch and the roles (see ``asyncflow.start_ray``). ``model_given``:
    the run loads a saved model and its driver builds none, so transformers is the
    workers' to import, not the driver's."""
    import asyncflow as af  # light: its names load on first use

    workers = sum(PLACEMENTS[placement][0].values()) if device == "cpu" else 0
    if model_given:
        af.start_ray(workers=workers, preload=("torch", "workers.roles"))
    else:
        af.start_ray(workers=workers)
