"""``python -m bench.e2e`` runs the workload end to end (real Ray workers, one
process per run) and writes the keys the issue names; with TRL installed, TRL's
side too. Timings are reported, never asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def _run(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "e2e.json"
    done = subprocess.run([sys.executable, "-m", "bench.e2e", "--rounds", "1", "--steps", "1", "--warmup", "1",
                           "--json", str(out), *args], capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    record: dict = json.loads(out.read_text())
    return record


def test_asyncflow_side_records_steps_stages_and_startup(tmp_path: Path) -> None:
    record = _run(tmp_path, "--placement", "split", "--no-trl")
    assert record["best_placement"] == "split"
    assert record["asyncflow_tokens_per_s"] == pytest.approx(record["job"]["tokens_per_step"]
                                                              / record["split_s_per_step"])
    (run,) = record["runs"]["split"]
    assert set(run["stage_ms"]) == {"actor.generate", "actor.update", "ref.log_prob", "reward.score",
                                    "reward.stats"}, "GRPO's stages, and no actor.log_prob (on-policy)"
    assert set(run["pool_busy_ms"]) == {"policy", "side"}
    assert run["startup_s"]["imported"] < run["startup_s"]["roles_spawned"] < run["startup_s"]["first_step_done"]
    assert 0 <= run["last_metrics"]["actor/logprob_mismatch"] < 1e-4


def test_trl_side_and_the_ratio(tmp_path: Path) -> None:
    pytest.importorskip("trl", reason="the optional compare extra (pip install -e '.[compare]')")
    record = _run(tmp_path, "--placement", "one")
    assert record["ratio"] == pytest.approx(record["asyncflow_tokens_per_s"] / record["trl_tokens_per_s"])
    (run,) = record["runs"]["trl"]
    assert run["framework"] == "trl" and len(run["steps_s"]) == 2
