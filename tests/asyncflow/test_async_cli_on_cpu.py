"""Asynchronous off-policy training through ``asyncflow train`` on real Ray workers:
the actor trains on one pool while a rollout role generates on another, up to
``train.max_staleness`` steps ahead.

- ``max_staleness = 0`` reproduces the synchronous run (the actor generating
  itself) metric for metric;
- with ``max_staleness = 1`` every batch after the first is one version stale, the
  loss corrects it, and a run killed after a checkpoint and resumed repeats the
  uninterrupted run's next steps bit for bit (the in-flight batches are in the
  checkpoint, and so are the samples partial rollouts carry to the next batch);
- settings that cannot work are refused naming the key.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from asyncflow.cli import main
from asyncflow.train import load_config, read_metrics
from asyncflow.train._roles import role_specs
from channels import Layout
from support import config_file, wait_for_a_checkpoint
from workers.models import TinyModelConfig, save_tiny_model

TINY = TinyModelConfig(hidden_size=64, intermediate_size=128, num_attention_heads=1,
                       num_key_value_heads=1, head_dim=64, num_hidden_layers=1)

CONFIG = """
output_dir = "{out}"
seed = 3

[model]
path = "{model}"

[data.arithmetic]
digits = 1
train_size = 40
eval_size = 8

[train]
steps = {steps}
prompts_per_step = 4
checkpoint_every = 2
eval_size = 8
kl_metric = false
max_staleness = {staleness}
partial_rollout_decode_steps = {partial}
weight_sync_bucket_mb = 0.02    # ~20 KiB: the weights reach the rollout in about ten buckets

[algorithm]
name = "grpo"
sampling = {{ n = 4, temperature = 1.0, max_new_tokens = {max_new}, stop = {stop} }}

[reward]
function = "support:digit_share_reward"

[actor]
lr = 1e-2
micro_batch_size = 16

[pools]
main = {{ devices = 1, threads = 1 }}
{more}
"""

DISAGGREGATED = """gen = { devices = 1, threads = 1 }

[placement]
rollout = { pool = "gen" }
"""


pytestmark = pytest.mark.usefixtures("shared_ray")  # one Ray instance for the module's runs


@pytest.fixture(autouse=True)
def _environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # main() sets these for the Ray it starts; later tests' Ray must not inherit them.
    for name in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "HF_HUB_DISABLE_PROGRESS_BARS"):
        monkeypatch.delenv(name, raising=False)
    # Ray's workers inherit this environment: they import the test's reward module.
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parents[1]) + os.pathsep + os.environ.get("PYTHONPATH", ""))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_tiny_model(tmp_path_factory.mktemp("model"), TINY, seed=0))


def _config(tmp: Path, model: str, name: str, *, steps: int = 3, staleness: int = 0,
            disaggregated: bool = True, partial: int = 0, max_new: int = 4, stop: tuple[str, ...] = ()) -> Path:
    path = config_file(tmp, name)
    path.write_text(CONFIG.format(out=tmp / name, model=model, steps=steps, staleness=staleness, partial=partial,
                                  max_new=max_new, stop=json.dumps(list(stop)),
                                  more=DISAGGREGATED if disaggregated else ""))
    return path


DECOUPLED = ("--set", "algorithm.policy.off_policy=decoupled")

STOP = ("1", "3", "5", "7", "9")
"""The killed run's responses end at an odd digit: groups finish at different
decode steps, so that partial rollouts carry some over."""


def _learned(row: dict[str, float]) -> dict[str, float]:
    """What the step computed (not its timing, not the asynchronous bookkeeping)."""
    return {k: v for k, v in row.items() if not k.startswith(("time/", "throughput/", "async/"))}


@pytest.mark.slow
def test_staleness_zero_reproduces_the_synchronous_run(tmp_path: Path, model_dir: str) -> None:
    assert main(["train", str(_config(tmp_path, model_dir, "sync", disaggregated=False)), "--no-progress"]) == 0
    assert main(["train", str(_config(tmp_path, model_dir, "async0")), "--no-progress"]) == 0
    sync = read_metrics(tmp_path / "sync" / "latest" / "metrics.jsonl")
    async0 = read_metrics(tmp_path / "async0" / "latest" / "metrics.jsonl")
    assert [r["step"] for r in async0] == [r["step"] for r in sync]
    assert [r["step"] for r in async0][:4] == [0, 1, 2, 3]
    for s, a in zip(sync, async0, strict=True):
        assert _learned(a) == _learned(s)
    steps = async0[1:4]
    assert any(r["actor/loss"] != 0 for r in steps)  # the policy moved: the equality means something
    assert all(r["async/staleness"] == 0 and r["actor/stale_fraction"] == 0 for r in steps)
    assert [r["async/weights_version"] for r in steps] == [0, 1, 2]


def test_scorers_on_the_rollout_pool_score_each_batch_behind_its_generation(tmp_path: Path, model_dir: str) -> None:
    """Reward and reference on the rollout's pool: each batch's scores and reference
    log-probs are queued right behind its generation (in the step that queued it,
    depending on it), not by the step that trains on it; still, at
    ``max_staleness = 0`` the run is the synchronous one metric for metric."""
    kl = ["--set", "train.kl_metric=true", "--no-progress"]
    assert main(["train", str(_config(tmp_path, model_dir, "sync", disaggregated=False)), *kl]) == 0
    assert main(["train", str(_config(tmp_path, model_dir, "ahead")), *kl, "--trace", "--set", "train.trace_steps=3",
                 "--set", "placement.reward.pool=gen", "--set", "placement.ref.pool=gen"]) == 0
    sync = read_metrics(tmp_path / "sync" / "latest" / "metrics.jsonl")
    ahead = read_metrics(tmp_path / "ahead" / "latest" / "metrics.jsonl")
    assert any("actor/kl_to_ref" in r for r in sync) and any(r.get("actor/loss") for r in sync)
    for s, a in zip(sync, ahead, strict=True):
        assert _learned(a) == _learned(s)
    events = json.loads((tmp_path / "ahead" / "latest" / "trace.json").read_text())["traceEvents"]
    calls = {e["args"]["call_id"]: e for e in events if e.get("ph") == "X" and e.get("cat") == "driver"}
    generations = {i: e for i, e in calls.items() if e["name"] == "rollout.generate"}
    scorers = [e for e in calls.values() if e["name"] in ("reward.score", "ref.log_prob")]
    assert len(scorers) >= 4
    for e in scorers:  # each depends on a generation queued in the same step
        (source,) = [generations[d] for d in e["args"]["deps"] if d in generations]
        assert source["args"]["step"] == e["args"]["step"]
    assert {e["args"]["step"] for e in scorers} - {0}  # queued while an earlier step trained


def test_the_next_step_queues_behind_the_update_with_the_same_results(tmp_path: Path, model_dir: str) -> None:
    """``train.overlap_steps``: step ``m + 1`` starts once step ``m`` submitted its
    update (the driver no longer waits for step ``m``'s metrics before it), except
    after a checkpoint step and the last; the metrics are those of steps run one
    after the other. Whether step ``m + 1``'s update then reaches the training pool
    before step ``m``'s ends depends on how fast the driver runs; that it never does
    without the overlap does not."""
    common = ["--no-progress", "--trace", "--set", "train.trace_steps=5", "--set", "train.checkpoint_every=3"]
    assert main(["train", str(_config(tmp_path, model_dir, "apart", steps=5, staleness=1)), *common,
                 "--set", "train.overlap_steps=false"]) == 0
    assert main(["train", str(_config(tmp_path, model_dir, "overlapped", steps=5, staleness=1)), *common,
                 "--set", "train.overlap_steps=true"]) == 0
    apart = read_metrics(tmp_path / "apart" / "latest" / "metrics.jsonl")
    overlapped = read_metrics(tmp_path / "overlapped" / "latest" / "metrics.jsonl")
    assert any(r.get("actor/loss") for r in apart)
    for a, o in zip(apart, overlapped, strict=True):
        assert _learned(o) == _learned(a)
    # The default correction (behaviour): a stale batch's ratio is taken against the
    # rollout's log-probs (approx_kl > 0 at the update's start), with no weight.
    steps = [r for r in overlapped if "actor/loss" in r]
    assert [r["async/staleness"] for r in steps] == [0, 1, 1, 1, 1]
    assert steps[0]["actor/approx_kl"] == 0 and all(r["actor/approx_kl"] != 0 for r in steps[1:])
    assert all(r["actor/is_weight"] == 1 for r in steps)

    def submitted_before_the_last_ended(name: str) -> list[bool]:
        events = json.loads((tmp_path / name / "latest" / "trace.json").read_text())["traceEvents"]
        updates = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "driver"
                          and e["name"] == "actor.update"), key=lambda e: e["ts"])
        assert len(updates) == 5
        # A driver event starts when its pool starts the call; it was submitted queued_ms before.
        return [b["ts"] - 1000 * b["args"]["queued_ms"] < a["ts"] + a["dur"] for a, b in itertools.pairwise(updates)]

    # Steps 2 and 3 start while 1 and 2 run; step 3 checkpoints, so step 4 waits for it.
    assert [r["async/overlapped"] for r in steps] == [1, 1, 0, 1, 0]
    assert [r["async/overlapped"] for r in apart if "actor/loss" in r] == [0] * 5
    assert submitted_before_the_last_ended("apart") == [False] * 4
    queued = submitted_before_the_last_ended("overlapped")
    assert queued[2] is False  # behind the checkpoint
    assert all(r["async/overlapped"] for q, r in zip(queued, steps, strict=False) if q)


def test_a_tensor_parallel_rollout_role_trains_ahead(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """``placement.rollout.t = 2``: the rollout generates tensor parallel on its own
    2-rank pool from the shards each rank pulls; its log-probs are the actor's."""
    two_heads = TinyModelConfig(hidden_size=64, intermediate_size=128, num_attention_heads=2,
                                num_key_value_heads=2, head_dim=32, num_hidden_layers=1)
    model = str(save_tiny_model(tmp_path_factory.mktemp("two_heads"), two_heads, seed=0))
    cfg = _config(tmp_path, model, "tp", steps=3, staleness=1)
    overrides: dict[str, object] = {"pools.gen.devices": 2, "placement.rollout.t": 2, "train.trace_steps": 3}
    specs = role_specs(load_config(cfg, overrides), model)
    assert specs["rollout"].pool.name == "gen" and specs["rollout"].layout == Layout(p=1, t=2, d=1)
    assert main(["train", str(cfg), "--no-progress",
                 *(a for key, value in overrides.items() for a in ("--set", f"{key}={value}"))]) == 0
    steps = [r for r in read_metrics(tmp_path / "tp" / "latest" / "metrics.jsonl") if "actor/loss" in r]
    assert [r["async/staleness"] for r in steps] == [0, 1, 1]
    assert any(r["actor/loss"] != 0 for r in steps)
    assert steps[0]["actor/logprob_mismatch"] < 1e-4  # fresh tokens: the rollout's log-probs are the actor's
    # The split parameters reached the rollout as shards: every load_weight_shards
    # call ran on both tensor ranks of its pool, each pulling from the actor.
    events = json.loads((tmp_path / "tp" / "latest" / "trace.json").read_text())["traceEvents"]
    (gen,) = [e["pid"] for e in events if e["name"] == "process_name" and e["args"]["name"] == "pool gen"]
    shards = [e for e in events if e.get("ph") == "X" and e["pid"] == gen and e["name"] == "rollout.load_weight_shards"]
    ranks_of: dict[int, set[int]] = {}
    for e in shards:
        ranks_of.setdefault(e["args"]["call_id"], set()).add(e["tid"])
    assert ranks_of and all(ranks == {0, 1} for ranks in ranks_of.values()), shards
    assert all(e["args"]["bytes_pulled"] > 0 for e in shards), shards


@pytest.mark.slow
def test_a_killed_asynchronous_run_resumes_exactly(tmp_path: Path, model_dir: str) -> None:
    """SIGKILL a worker of a ``max_staleness = 1`` run with partial rollouts after its
    first checkpoint: the run ends in one line; ``--resume`` repeats what an
    uninterrupted run computes after the checkpoint, bit for bit, although the
    batches generated ahead at the checkpoint came from weights the checkpoint no
    longer holds, and the rollout rank that held the carried samples is gone (both
    are in the checkpoint)."""
    # One engine step a batch (two tokens) before unfinished samples carry over.
    run = _config(tmp_path, model_dir, "run", steps=10_000, staleness=1, partial=1, max_new=8,
                  stop=STOP)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]),
                                                        os.environ.get("PYTHONPATH", "")])}
    with (tmp_path / "stdout.txt").open("w") as out, (tmp_path / "stderr.txt").open("w") as err_file:
        proc = subprocess.Popen([sys.executable, "-m", "asyncflow.cli", "train", str(run), "--no-progress", *DECOUPLED],
                                stdout=out, stderr=err_file, text=True, env=env)
        wait_for_a_checkpoint(proc, tmp_path / "run" / "latest" / "checkpoints", tmp_path / "stderr.txt")
        workers = [p for p in psutil.Process(proc.pid).children(recursive=True)
                   if p.name().startswith("ray::WorkerProcess")]
        assert workers
        workers[0].send_signal(signal.SIGKILL)
        proc.wait(timeout=120)
    err = (tmp_path / "stderr.txt").read_text()
    assert proc.returncode == 1, err
    assert err.strip().splitlines()[-1].startswith("asyncflow: RunInterruptedError: "), err
    assert "never retrieved" not in err  # the generations queued behind the failed update

    checkpoints = tmp_path / "run" / "latest" / "checkpoints"
    checkpoint = checkpoints / (checkpoints / "latest").read_text().strip()
    state = json.loads((checkpoint / "state.json").read_text())
    resumed_from = state["step"]
    # The batches generated ahead: the next one by the weights of the step before the
    # checkpoint's, and the one after by the checkpoint's own (queued as soon as the
    # checkpoint step's update was).
    assert state["in_flight"] == [{"batch": resumed_from + 1, "version": resumed_from - 1},
                                  {"batch": resumed_from + 2, "version": resumed_from}]
    assert (checkpoint / "in_flight" / "carried.pt").is_file()
    target = resumed_from + 2
    assert main(["train", str(run), "--resume", "--set", f"train.steps={target}", "--no-progress", *DECOUPLED]) == 0
    reference = _config(tmp_path, model_dir, "reference", steps=target, staleness=1, partial=1, max_new=8,
                  stop=STOP)
    assert main(["train", str(reference), "--no-progress", *DECOUPLED]) == 0
    got = {r["step"]: r for r in read_metrics(tmp_path / "run" / "latest" / "metrics.jsonl")}
    want = {r["step"]: r for r in read_metrics(tmp_path / "reference" / "latest" / "metrics.jsonl")}
    for step in (resumed_from + 1, target):
        assert _learned(got[step]) == _learned(want[step]), step

    steps = [want[s] for s in range(1, target + 1)]
    # Batch 1 is the starting policy's; every later one was generated one update behind
    # and (decoupled correction) weighted by the truncated importance weight.
    assert [r["async/staleness"] for r in steps] == [0] + [1] * (target - 1)
    assert [r["actor/stale_fraction"] for r in steps] == [0] + [1] * (target - 1)
    assert steps[0]["actor/is_weight"] == 1 and all(r["actor/is_weight"] != 1 for r in steps[1:])
    assert [r["async/in_flight"] for r in steps] == [1] * (target - 1) + [0]
    # Carried samples finished under newer weights: some samples span two versions.
    assert steps[0]["actor/mixed_version_samples"] == 0
    assert any(r["actor/mixed_version_samples"] > 0 for r in steps[1:])
    assert max(r["actor/version_lag_max"] for r in steps) >= 2  # a carried token: one more than max_staleness


@pytest.mark.parametrize(("extra", "message"), [
    (["--set", "train.max_staleness=1"], "needs a rollout role"),
    (["--set", "train.partial_rollout_decode_steps=2"], "partial rollouts carry samples between its calls"),
    (["--set", "placement.rollout.t=2", "--set", "pools.gen.devices=2"], "must divide the model's num_attention_heads"),
    (["--set", "placement.rollout.gen.t=1"], "a rollout role's own layout is its generation layout"),
    (["--set", "train.stream=true"], "train.stream with a rollout role"),
    (["--set", "algorithm.name=remax"], "samples inside its step"),
])
def test_impossible_asynchronous_settings_are_refused(tmp_path: Path, model_dir: str, capsys: pytest.CaptureFixture[str],
                                                     extra: list[str], message: str) -> None:
    disaggregated = not any(e.startswith(("train.max_staleness", "train.partial_rollout")) for e in extra)
    cfg = _config(tmp_path, model_dir, "bad", disaggregated=disaggregated)
    assert main(["train", str(cfg), *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
