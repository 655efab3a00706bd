"""``python -m bench.transition`` moves a small model's weights through every method
on 4 real gloo processes and writes the keys the issue names; the measured bytes
equal the formulas. Timings are reported, never asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_every_method_and_layout_is_measured_with_the_formulas_bytes(tmp_path: Path) -> None:
    out = tmp_path / "transition.json"
    done = subprocess.run([sys.executable, "-m", "bench.transition", "--size", "small", "--repeats", "1",
                           "--json", str(out)], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(out.read_text())
    for layouts in ("141-1221", "122-1122"):
        for method in ("allgather", "vanilla", "hybridflow"):
            for figure in ("s", "bytes", "peak_bytes"):
                assert record[f"{method}_{layouts}_{figure}"] > 0, (method, layouts, figure)
            assert record[f"{method}_{layouts}_matches_formula"] is True, (method, layouts)
        assert f"hybridflow_vs_allgather_{layouts}" in record
    # 1-4-1 -> 1-2-2-1: hybridflow gathers inside pairs (1/4 of the model), the others 3/4.
    assert record["hybridflow_141-1221_bytes"] * 3 == record["allgather_141-1221_bytes"]
    assert record["hybridflow_141-1221_peak_bytes"] < record["vanilla_141-1221_peak_bytes"]
    assert record["model_bytes"] > 0 and "| hybridflow |" in done.stdout
