"""``python -m bench.e2e`` runs the workload end to end (real Ray workers, one
process per run) and writes the keys the issue names; with TRL installed, TRL's
side too; with ``--paired``, asyncflow and the floor step in turn in one run.
Timings are reported, never asserted."""

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


@pytest.mark.slow
def test_asyncflow_side_records_steps_stages_and_startup_and_the_floor_beside(tmp_path: Path) -> None:
    record = _run(tmp_path, "--placement", "split", "--no-trl")
    assert record["best_placement"] == "split"
    assert record["asyncflow_tokens_per_s"] == pytest.approx(record["job"]["tokens_per_step"]
                                                              / record["split_s_per_step"])
    (run,) = record["runs"]["split"]
    assert set(run["stage_ms"]) == {"actor.generate", "actor.update", "ref.log_prob", "reward.score",
                                    "reward.stats"}, "GRPO's stages, and no actor.log_prob (on-policy)"
    assert set(run["pool_busy_ms"]) == {"policy", "side"}
    # The timed steps (1 warm-up, 1 timed) ran untraced; the stages come from the traced ones after them.
    assert len(run["steps_s"]) == 2 + run["traced_steps"] and run["traced_steps"] >= 1
    assert run["s_per_step"] == run["steps_s"][1]
    assert run["startup_s"]["imported"] < run["startup_s"]["roles_spawned"] < run["startup_s"]["first_step_done"]
    assert record["asyncflow_first_step_s"] == record["split_first_step_s"] == run["startup_s"]["first_step_done"]
    assert 0 <= run["last_metrics"]["actor/logprob_mismatch"] < 1e-4
    # every run loads the one model bench.e2e saved; asyncflow's driver then needs no transformers
    assert run["model_given"] and run["driver_imported_transformers"] is False
    # The plain-PyTorch floor, on one and two ranks, in the same rounds.
    assert record["floor_s_per_step"] == min(record["floor_1_s_per_step"], record["floor_2_s_per_step"])
    assert record["asyncflow_vs_floor"] == pytest.approx(record["asyncflow_tokens_per_s"]
                                                         / record["floor_tokens_per_s"])
    assert "floor_ratio" not in record, "no TRL, no ratio to it"
    for ranks in (1, 2):
        (floor,) = record["runs"][f"floor_{ranks}"]
        assert floor["ranks"] == ranks and len(floor["steps_s"]) == 2
        assert record[f"floor_{ranks}_first_step_s"] == floor["startup_s"]["first_step_done"]
        assert set(floor["stage_ms"]) == {"generate", "reward", "ref", "update"}
        assert 0 <= floor["last_metrics"]["kl_to_ref"] < 1, "one step of lr 1e-4 from the reference"


@pytest.mark.slow
def test_paired_runs_step_both_sides_in_turn_and_take_the_ratio_round_by_round(tmp_path: Path) -> None:
    record = _run(tmp_path, "--placement", "one", "--paired")
    (run,) = record["paired_runs"]["one"]
    assert set(run["steps_s"]) == {"asyncflow", "floor_1", "floor_2"}
    assert all(len(steps) == run["rounds"] == 1 for steps in run["steps_s"].values())
    floor = run["best_floor"]
    assert run[f"{floor}_s_per_step"] == min(run["floor_1_s_per_step"], run["floor_2_s_per_step"])
    assert run["asyncflow_vs_floor"] == pytest.approx(run["steps_s"][floor][0] / run["steps_s"]["asyncflow"][0])
    assert record["asyncflow_vs_floor_paired"] == record["one_vs_floor_paired"] == run["asyncflow_vs_floor"]
    assert record["best_placement"] == "one"


def test_a_paired_record_takes_the_median_of_each_rounds_ratio() -> None:
    from bench._e2e_job import E2EJob
    from bench._e2e_paired import record

    times = {"asyncflow": [0.2, 0.4, 0.1], "floor_1": [0.3, 0.3, 0.3], "floor_2": [0.1, 0.2, 0.2]}
    got = record(E2EJob(), "dp2", times)
    assert got["best_floor"] == "floor_2" and got["floor_2_s_per_step"] == 0.2
    assert got["asyncflow_vs_floor"] == pytest.approx(0.5), "rounds 0.5, 0.5, 2.0: their median"
    assert got["asyncflow_s_per_step"] == 0.2 and got["rounds"] == 3


def test_the_table_shows_each_rounds_step_beside_their_median() -> None:
    from bench.e2e import table

    runs = {"dp2": [{"s_per_step": s, "startup_s": {"first_step_done": 7.0}, "stage_ms": {"actor.update": 60.4}}
                    for s in (0.156, 0.217, 0.129)]}
    text = table({"runs": runs, "dp2_s_per_step": 0.156, "job": {"tokens_per_step": 2048}})
    header, _, row = text.splitlines()
    assert "rounds' s/step" in header
    assert "| 0.156, 0.217, 0.129 |" in row and "actor.update 60" in row


def test_a_paired_run_says_when_a_floor_rank_ends_instead_of_waiting(tmp_path: Path) -> None:
    from bench._e2e_job import E2EJob
    from bench._e2e_paired import _Floor

    floor = _Floor(1, E2EJob(), str(tmp_path / "no-model"))  # the rank cannot load its model
    try:
        with pytest.raises(RuntimeError, match=r"a floor rank ended: exit codes \[1\]"):
            floor.ready()
    finally:
        floor.close()


def test_trl_side_and_the_ratio(tmp_path: Path) -> None:
    pytest.importorskip("trl", reason="the optional compare extra (pip install -e '.[compare]')")
    record = _run(tmp_path, "--placement", "one", "--no-floor")
    assert record["ratio"] == pytest.approx(record["asyncflow_tokens_per_s"] / record["trl_tokens_per_s"])
    (run,) = record["runs"]["trl"]
    assert run["framework"] == "trl" and len(run["steps_s"]) == 2
    assert set(run["stage_ms"]) == {"generate", "reward", "log_prob", "update"}
    assert all(ms > 0 for ms in run["stage_ms"].values()), run["stage_ms"]
    assert sum(run["stage_ms"].values()) <= 1000 * run["steps_s"][1] * 1.01, "the stages are parts of the step"


def test_the_floors_decode_samples_from_the_model() -> None:
    """The floor's log-probs of the tokens it sampled are the model's (a forward
    pass over the whole sequences), so its decode is the workload's real arithmetic."""
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM

    from bench._e2e_floor import generate, token_logprobs
    from bench._e2e_job import E2EJob

    job = E2EJob(prompts=4)
    with tempfile.TemporaryDirectory() as tmp:
        model = AutoModelForCausalLM.from_pretrained(job.save_model(Path(tmp) / "m"))
    torch.manual_seed(0)
    prompts = job.prompt_ids()
    tokens, logprobs = generate(model, prompts, job.new_tokens)
    assert tokens.shape == logprobs.shape == (job.prompts, job.new_tokens)
    with torch.no_grad():
        forward = token_logprobs(model, torch.cat([prompts, tokens], dim=1), job.prompt_len)
    torch.testing.assert_close(logprobs, forward, atol=1e-5, rtol=0)


def _exit_with(code: int) -> None:
    raise SystemExit(code)


def test_a_floor_rank_that_dies_fails_the_run_at_once() -> None:
    """A rank that dies without a record ends the wait with its exit code (its peer
    would otherwise wait in the all-reduce until the timeout)."""
    import multiprocessing
    import time

    from bench._e2e_floor import wait_for_ranks

    ctx = multiprocessing.get_context("fork")
    dead = ctx.Process(target=_exit_with, args=(3,))
    dead.start()
    dead.join()
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"exit codes \[3\]"):
        wait_for_ranks(ctx.Queue(), [dead], timeout_s=60)
    assert time.monotonic() - started < 30


def test_the_gpu_workload_is_the_issues_and_trl_accumulates_it_into_one_update() -> None:
    from bench._e2e_job import E2EJob
    from bench._e2e_trl import grpo_settings

    job = E2EJob.on("cuda")
    assert (job.prompts, job.n, job.new_tokens, job.rows) == (64, 8, 256, 512)
    shape = job.model()
    assert (shape.hidden_size, shape.num_hidden_layers, shape.vocab_size) == (896, 24, 151936)
    assert shape.max_position_embeddings >= job.prompt_len + job.new_tokens
    gpu = grpo_settings(job)
    assert gpu["per_device_train_batch_size"] * gpu["gradient_accumulation_steps"] == job.rows
    assert gpu["bf16"] and not gpu["use_cpu"] and not gpu["gradient_checkpointing"]
    cpu = grpo_settings(E2EJob.on("cpu"))
    assert (cpu["per_device_train_batch_size"], cpu["gradient_accumulation_steps"]) == (64, 1)
    assert cpu["use_cpu"] and not cpu["bf16"]
