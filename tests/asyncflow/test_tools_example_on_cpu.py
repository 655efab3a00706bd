"""``make tools``'s config (examples/arith_tools.toml), shrunk to a few steps: the SFT
warm start with demonstrations of calling the calculator, then GRPO on episodes
whose tool is the function beside the config; it trains and reports episode
metrics."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from asyncflow.cli import main
from asyncflow.train import read_metrics

EXAMPLE = Path(__file__).parents[2] / "examples" / "arith_tools.toml"
SMALL = {
    "data.arithmetic.train_size": 200, "data.arithmetic.eval_size": 16,
    "sft.steps": 30, "sft.batch_size": 16,
    "train.steps": 2, "train.prompts_per_step": 4, "train.eval_size": 16, "train.eval_every": 0,
    "train.checkpoint_every": 0, "algorithm.sampling.n": 4,
}

pytestmark = pytest.mark.usefixtures("shared_ray")  # one Ray instance for the module's runs


@pytest.fixture(autouse=True)
def _environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "HF_HUB_DISABLE_PROGRESS_BARS"):
        monkeypatch.delenv(name, raising=False)


def test_the_tool_example_trains_on_episodes_that_call_its_tool(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the tool's module is found beside the config, not in the working directory
    sets = [f"{k}={v}" for k, v in (SMALL | {"output_dir": tmp_path / "out"}).items()]
    assert main(["train", str(EXAMPLE), "--no-progress", *(a for s in sets for a in ("--set", s))]) == 0
    out = capsys.readouterr().out
    assert "demonstrations=60" in out  # 30 % of the 200 training problems
    assert "held-out accuracy before RL:" in out and out.strip().splitlines()[-1].startswith("accuracy: ")
    rows = read_metrics(tmp_path / "out" / "latest" / "metrics.jsonl")
    steps = [r for r in rows if r["step"] > 0 and "actor/loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert math.isfinite(r["actor/loss"]) and 0 <= r["reward/mean"] <= 1
        assert 1 <= r["episode/turns"] <= 3
        outcomes = ("done", "max_turns", "budget", "error", "timeout")
        assert sum(r[f"episode/{o}"] for o in outcomes) == pytest.approx(1.0)
    assert "eval/accuracy" in rows[0] and "eval/accuracy" in rows[-1]
