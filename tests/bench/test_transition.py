"""``python -m bench.transition`` moves a small model's weights with every method
on real gloo processes and writes the keys the issue names; the measured bytes
equal the formulas. Timings are reported, never asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

METHODS = ("allgather", "vanilla", "hybridflow")


def _run(tmp_path: Path, *args: str) -> tuple[dict, str]:
    out = tmp_path / "transition.json"
    done = subprocess.run([sys.executable, "-m", "bench.transition", "--size", "small", "--repeats", "1",
                           "--json", str(out), *args], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    record: dict = json.loads(out.read_text())
    return record, done.stdout


def _keys(layouts: tuple[str, ...]) -> set[str]:
    keys = {"model_bytes", "params", "bucket_bytes", "ranks"}
    for name in layouts:
        keys |= {f"{m}_{name}_{f}" for m in METHODS for f in ("s", "back_s", "bytes", "peak_bytes", "matches_formula")}
        keys |= {f"hybridflow_vs_{base}_{name}" for base in ("allgather", "vanilla")}
    return keys


def test_four_ranks_every_method_and_layout_measured_with_the_formulas_bytes(tmp_path: Path) -> None:
    record, stdout = _run(tmp_path)
    assert set(record) == _keys(("141-1221", "122-1122"))
    assert record["ranks"] == 4 and record["bucket_bytes"] == 64 << 20
    assert record["model_bytes"] == 4 * record["params"] > 0, "fp32"
    for k, v in record.items():
        if k.endswith("_matches_formula"):
            assert v is True, k
        elif k.endswith(("_s", "_bytes")):
            assert v > 0, k
    # 1-4-1 -> 1-2-2-1: hybridflow gathers inside pairs (1/4 of the model per rank),
    # the baselines inside all four (3/4); it keeps half the model, vanilla also its
    # training quarter, allgather the whole model besides.
    assert record["hybridflow_141-1221_bytes"] < record["allgather_141-1221_bytes"]
    assert record["hybridflow_141-1221_bytes"] * 3 == record["allgather_141-1221_bytes"]
    peaks = [record[f"{m}_141-1221_peak_bytes"] for m in ("hybridflow", "vanilla", "allgather")]
    assert peaks == sorted(set(peaks)), peaks
    # 1-2-2 -> 1-1-2-2: tg = 1, so every method gathers the same bytes.
    assert len({record[f"{m}_122-1122_bytes"] for m in METHODS}) == 1
    assert "| 141-1221 | hybridflow |" in stdout and "WARNING" not in stdout

