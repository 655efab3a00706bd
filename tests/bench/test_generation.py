"""``python -m bench.generation --device cpu --engines ...`` on the tiny model: the
engine comparison of the CUDA mode runs on the CPU without vLLM, and its JSON has the
keys the bench promises. Timings are reported, never asserted."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from bench.generation import main

ENGINES = ["native_eager", "hf_generate"]


def test_the_engines_are_timed_and_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "generation.json"
    main([
        "--device", "cpu", "--model", "tiny", "--engines", ",".join(ENGINES), "--dtypes", "float32",
        "--batches", "4", "--prompt-len", "8", "--new-tokens", "8", "--runs", "2", "--threads", "1",
        "--json", str(out),
    ])
    setup = json.loads(out.read_text())
    assert {"gpu", "torch", "transformers", "model", "parameters", "prompt_len", "new_tokens"} <= set(setup)
    assert (setup["model"], setup["prompt_len"], setup["new_tokens"], setup["gpu"]) == ("tiny", 8, 8, None)
    records = setup["results"]
    assert [r["engine"] for r in records] == ENGINES
    for r in records:
        assert {"device", "dtype", "batch", "engine", "tokens_per_s", "ms_per_step", "seconds_runs", "warmup_s"} <= set(r)
        assert (r["device"], r["dtype"], r["batch"], len(r["seconds_runs"])) == ("cpu", "float32", 4, 2)
        assert r["tokens_per_s"] > 0 and r["ms_per_step"] > 0 and r["warmup_s"] > 0
    # From the runs themselves: the medians, 4 prompts x 8 new tokens per call.
    native, hf = (statistics.median(r["seconds_runs"]) for r in records)
    assert records[0]["over_hf_generate"] == pytest.approx(hf / native)
    assert records[1]["over_hf_generate"] == pytest.approx(1.0)
    for r, median in zip(records, (native, hf), strict=True):
        assert r["tokens_per_s"] == pytest.approx(4 * 8 / median)
        assert r["ms_per_step"] == pytest.approx(median / 8 * 1e3)
    table = capsys.readouterr().out
    assert all(engine in table for engine in ENGINES)


def test_unknown_engines_are_refused_before_the_model_is_built() -> None:
    with pytest.raises(ValueError, match="--engines must name some of native_graph"):
        main(["--device", "cpu", "--model", "tiny", "--engines", "native_eager,vllm"])


def test_the_profile_says_where_a_step_goes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "generation.json"
    main([
        "--device", "cpu", "--model", "tiny", "--engines", "native_eager", "--dtypes", "float32", "--batches", "4",
        "--prompt-len", "8", "--new-tokens", "8", "--runs", "1", "--threads", "1", "--profile", "5",
        "--json", str(out),
    ])
    (record,) = json.loads(out.read_text())["results"]
    profile = record["profile"]
    assert 0 < len(profile["top"]) <= 5
    assert all(k["name"] and k["ms_per_step"] > 0 and k["calls_per_step"] > 0 for k in profile["top"])
    assert [k["ms_per_step"] for k in profile["top"]] == sorted((k["ms_per_step"] for k in profile["top"]), reverse=True)
    assert sum(k["ms_per_step"] for k in profile["top"]) <= profile["total_ms_per_step"] * (1 + 1e-9)
    assert "aten::" in " ".join(k["name"] for k in profile["top"])  # the CPU's operators
    assert "ms of kernels per step" in capsys.readouterr().out
