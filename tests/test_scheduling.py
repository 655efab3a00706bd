"""The test schedule's groups (tests/scheduling.py) name what they must."""

from __future__ import annotations

from pathlib import Path

from scheduling import OWN_RAY, SHARED_WORKER


def test_every_module_that_stops_the_shared_ray_runs_in_its_group() -> None:
    tests = Path(__file__).parent
    stoppers = {str(p.relative_to(tests.parent)) for p in tests.rglob("test_*.py")
                if p != Path(__file__) and "no_shared_ray" in p.read_text()}
    assert stoppers == {module for module, group in SHARED_WORKER.items() if group == OWN_RAY}
