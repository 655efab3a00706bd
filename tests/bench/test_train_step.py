"""``python -m bench.train_step`` on the tiny shape: every mode runs ``train_step``
and the JSON has the keys the bench promises. Timings are reported, never asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.train_step import MODES, main, run

KEYS = {"tokens_per_s", "tflops", "peak_gib", "s_per_step"}


def test_every_mode_is_measured_and_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "train_step.json"
    args = ["--shape", "tiny", "--device", "cpu", "--rows", "4", "--tokens", "24", "--micro-batch", "2"]
    assert main([*args, "--steps", "1", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert set(record) == {"setup", *MODES} == {"setup", "fp32", "bf16", "bf16_ac"}
    assert record["setup"]["shape"] == "tiny" and record["setup"]["parameters"] == 893_568
    for mode in MODES:
        assert set(record[mode]) == KEYS, mode
        assert all(value > 0 for value in record[mode].values()), mode
        # TFLOP/s is the 6 * N * tokens/s convention, whatever the mode.
        expected = 6 * record["setup"]["parameters"] * record[mode]["tokens_per_s"] / 1e12
        assert record[mode]["tflops"] == pytest.approx(expected)
    assert "bf16_ac" in capsys.readouterr().out


def test_bad_arguments_are_refused_before_anything_runs() -> None:
    with pytest.raises(ValueError, match="unknown shape"):
        run(shape="7b", device=None, rows=1, tokens=8, micro_batch=1, steps=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown modes"):
        run(shape="tiny", device=None, rows=1, tokens=8, micro_batch=1, steps=1, modes=("fp16",))  # type: ignore[arg-type]
