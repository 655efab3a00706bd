"""bench.episodes writes the issue's keys (small sizes; no timing is asserted)."""

from __future__ import annotations

import json
from pathlib import Path

from bench import episodes


def test_episodes_bench_writes_the_issue_keys(tmp_path: Path) -> None:
    out = tmp_path / "episodes.json"
    assert episodes.main(["--json", str(out), "--episodes", "4", "--turns", "2", "--wait-ms", "20",
                          "--rounds", "1", "--threads", "1"]) == 0
    figures = json.loads(out.read_text())
    for key in ("overlapped_s", "no_wait_s", "serial_s", "episodes_per_s", "turns", "wait_ms"):
        assert key in figures, key
    assert figures["turns"] == 2 and figures["wait_ms"] == 20
    assert figures["serial_s"] > 0 and figures["overlapped_s"] > 0
