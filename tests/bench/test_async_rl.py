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

from bench._weight_sync import COLOCATED, params_of
from bench.transition import model_specs
from hybrid_engine import expected_bytes


@pytest.mark.slow
def test_async_rl_writes_the_issue_keys(tmp_path: Path) -> None:
    out = tmp_path / "async_rl.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench.async_rl", "--json", str(out), "--steps", "1", "--warmup", "1",
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
    assert "| async1 |" in done.stdout
