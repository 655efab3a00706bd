"""``python -m bench.async_rl`` runs synchronous and asynchronous GRPO on a small
workload and the weight synchronisation of a small model, and writes the keys the
issue names; the weight-sync bytes are the model's. Timings are reported, never
asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from asyncflow.tracing import CallRecord, RankSpan, Trace
from bench._weight_sync import COLOCATED, params_of
from bench.async_rl import median_run, step_busy
from bench.transition import model_specs
from hybrid_engine import expected_bytes


@pytest.mark.slow
def test_async_rl_writes_the_issue_keys(tmp_path: Path) -> None:
    out = tmp_path / "async_rl.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench.async_rl", "--json", str(out), "--steps", "1", "--warmup", "1", "--rounds", "1",
         "--modes", "sync_one", "async1", "async2", "async1_partial", "--sizes", "small",
         "--job", "prompts=2", "n=2", "micro_batch=4", "median_tokens=4", "max_tokens=8", "p99_ratio=2",
         "partial_steps=2"],
        capture_output=True, text=True, timeout=280, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(out.read_text())
    for key in ("sync_tokens_per_s", "async1_tokens_per_s", "async2_tokens_per_s", "async1_partial_tokens_per_s",
                "weight_sync_small_s", "weight_sync_small_colocated_s"):
        assert record[key] > 0, key
    assert record["weight_sync_small_bytes"] == 4 * params_of("small")
    assert record["weight_sync_small_params"] == params_of("small")
    # The hybrid engine's 121-1121 transition: the bytes of the layouts' formula.
    want = expected_bytes(COLOCATED, model_specs("small"), "hybridflow").sent
    assert record["weight_sync_small_colocated_bytes"] == want
    # The measured step is step 2; its batch was generated with the first batch, by version 0.
    assert record["async1_mean_staleness"] == record["async2_mean_staleness"] == 1
    assert set(record["async1_pool_step_ms"]) == {"train", "gen"}
    assert record["async1_step_over_busiest"] > 0
    assert len(record["async1_tokens_per_s_rounds"]) == 1
    assert "| async1 |" in done.stdout


def _call(call_id: int, pool: str, method: str, seconds: tuple[float, ...]) -> CallRecord:
    spans = tuple(RankSpan(pool=pool, rank=r, worker=r, start=call_id, end=call_id + s, rows=0, bytes_pulled=0)
                  for r, s in enumerate(seconds))
    return CallRecord(call_id=call_id, role="r", method=method, pool=pool, rank_local=False, deps=(),
                      submitted=call_id, started=call_id, finished=call_id + max(seconds), ranks=spans)


def test_a_steps_busy_time_counts_each_stage_as_often_as_it_runs_a_step() -> None:
    # Three steps: the rollout's pool generated one batch before the window opened
    # (not traced) and two inside it; the weights came in two buckets a step; the
    # train pool's two ranks took 0.2 and 0.3 s a step.
    calls = [_call(1, "gen", "generate", (0.5,)), _call(2, "gen", "generate", (0.7,)),
             *(_call(10 + i, "gen", "load", (0.01,)) for i in range(6)),
             *(_call(20 + i, "train", "update", (0.2, 0.3)) for i in range(3))]
    busy = step_busy(Trace(calls=calls, pools={"gen": 1, "train": 2, "idle": 1}), steps=3)
    assert busy == pytest.approx({"gen": 0.6 + 2 * 0.01, "train": 0.3, "idle": 0.0})


def test_the_median_run_is_a_run_of_its_own() -> None:
    runs = [{"tokens_per_s": t, "id": i} for i, t in enumerate((5.0, 9.0, 7.0, 1.0))]
    assert median_run(runs)["id"] == 0  # 5.0: the slower of the middle two
    assert median_run(runs[:3])["id"] == 2
