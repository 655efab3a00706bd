"""Partial rollouts on a rollout role built in this process (one rank, native
engine): a call stops after its decode steps, keeps what is unfinished, and the
next call finishes it under its own weights, each token labelled with the
version that sampled it; the carried samples survive a checkpoint."""

from __future__ import annotations

import pytest
import torch
from roles_testlib import TINY, local_ctx, prompt_columns

from channels import Batch, ConfigError, SchemaError
from workers.models import load_model, save_tiny_model
from workers.roles import PartialRollout, RolloutWorker, RolloutWorkerConfig
from workers.roles._weights import weight_rows
from workers.rollout import SamplingParams

torch.set_num_threads(1)
R = 8
PARAMS = SamplingParams(max_new_tokens=R, temperature=1.0, seed=3)
BUDGETS = torch.tensor([1, 8, 2, 8, 3])
"""Each prompt's own token budget: groups finish at different decode steps."""
N = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_tiny_model(tmp_path_factory.mktemp("policy"), TINY, seed=0))


def _rollout(model_dir: str) -> RolloutWorker:
    return RolloutWorker(local_ctx("rollout"), RolloutWorkerConfig(model_dir=model_dir, sampling=PARAMS))


def _prompts(first_uid: int) -> Batch:
    cols = prompt_columns()
    return Batch({**cols, "uid": cols["uid"] - 10 + first_uid, "max_new_tokens": BUDGETS})


def _load_version_1(rollout: RolloutWorker, model_dir: str, version: int = 1) -> None:
    """Weights that differ from the model directory's, as the actor's ``version``."""
    model = load_model(model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(version)))
    assert rollout.load_weights(Batch(weight_rows(model, local_ctx("actor"), version=version))) == version


def _lengths(rows: Batch) -> list[int]:
    return rows["response_mask"].sum(1).tolist()


def _two_calls(model_dir: str, mode: str) -> tuple[Batch, Batch, RolloutWorker]:
    rollout = _rollout(model_dir)
    partial = PartialRollout(decode_steps=2, mode=mode)  # type: ignore[arg-type]
    first = rollout.generate(_prompts(100), n=N, partial=partial)
    _load_version_1(rollout, model_dir)
    second = rollout.generate(_prompts(200), n=N, partial=partial)
    return first, second, rollout


def test_a_call_returns_what_finished_and_the_next_finishes_the_rest_under_its_weights(model_dir: str) -> None:
    first, second, rollout = _two_calls(model_dir, "continue")
    # The first call stops after 2 engine steps (3 tokens: prefill and one decode,
    # then one more): the groups of budget 1, 2 and 3 finished.
    assert sorted(set(first["uid"].tolist())) == [100, 102, 104]
    again = _rollout(model_dir)
    again.generate(_prompts(100), n=N, partial=PartialRollout(decode_steps=2))
    assert again.carried()["tokens"] == 2 * N * 3  # the two 8-token groups, 3 tokens each so far
    assert all(v == 0 for v in first["policy_version"].flatten().tolist())
    # The second finishes its own short groups and every carried one (its rows come after).
    uids = second["uid"].tolist()
    assert sorted(set(uids)) == [101, 103, 200, 202, 204]
    assert uids[-2 * N:] == [101, 101, 103, 103]
    # Its own long groups wait for the next call, 5 tokens each so far (the call ran
    # until the carried samples had their last 5).
    waiting = rollout.carried()
    assert waiting["rows"]["uid"].tolist() == [201, 201, 203, 203]
    assert waiting["tokens"] == 2 * N * 5
    carried = second["uid"] >= 100
    carried &= second["uid"] < 200
    for row in carried.nonzero().flatten().tolist():
        assert int(second["response_mask"][row].sum()) == R  # the whole response, carried tokens included
        # Tokens sampled in the first call keep version 0, the rest are version 1's.
        assert second["policy_version"][row].tolist() == [0] * 3 + [1] * (R - 3)
    own = second["uid"] >= 200
    assert torch.all(second["policy_version"][own] == 1)


def test_restart_samples_the_carried_responses_again_under_the_new_weights(model_dir: str) -> None:
    first, second, _ = _two_calls(model_dir, "restart")
    assert sorted(set(first["uid"].tolist())) == [100, 102, 104]
    carried = (second["uid"] >= 100) & (second["uid"] < 200)
    assert int(carried.sum()) == 2 * N
    mask = second["response_mask"][carried].bool()
    assert torch.all(second["policy_version"][carried][mask] == 1)  # every token from one version


def test_partial_rollouts_are_reproducible_and_resume_from_the_carried_samples(model_dir: str) -> None:
    first, second, _ = _two_calls(model_dir, "continue")
    again_first, again_second, _ = _two_calls(model_dir, "continue")
    for name in first:
        assert torch.equal(first[name], again_first[name]), name
        assert torch.equal(second[name], again_second[name]), name
    # A checkpoint after the first call: a new rank takes the carried samples back.
    rollout = _rollout(model_dir)
    partial = PartialRollout(decode_steps=2)
    rollout.generate(_prompts(100), n=N, partial=partial)
    saved = [rollout.carried()]
    resumed = _rollout(model_dir)
    assert resumed.restore_carried(saved) == 2 * N
    _load_version_1(resumed, model_dir)
    out = resumed.generate(_prompts(200), n=N, partial=partial)
    for name in second:
        assert torch.equal(out[name], second[name]), name


def test_without_partial_a_call_keeps_the_carried_samples_for_the_next_partial_one(model_dir: str) -> None:
    rollout = _rollout(model_dir)
    rollout.generate(_prompts(100), n=N, partial=PartialRollout(decode_steps=2))
    carried = rollout.carried()
    carried["rows"] = {name: column.clone() for name, column in carried["rows"].items()}
    assert carried["rows"]["uid"].tolist() == [101, 101, 103, 103] and carried["tokens"] == 2 * N * 3
    plain = rollout.generate(_prompts(300), n=N)  # evaluation: its own prompts, to the end
    assert sorted(set(plain["uid"].tolist())) == [300, 301, 302, 303, 304]
    assert sorted(set(_lengths(plain))) == [1, 2, 3, 8]
    kept = rollout.carried()  # the same samples, untouched
    assert kept["tokens"] == carried["tokens"] and kept["rows"].keys() == carried["rows"].keys()
    for name, column in carried["rows"].items():
        assert torch.equal(kept["rows"][name], column), name


def test_a_sample_is_carried_over_up_to_max_carries_calls(model_dir: str) -> None:
    rollout = _rollout(model_dir)
    partial = PartialRollout(decode_steps=2, max_carries=2)
    first = rollout.generate(_prompts(100), n=N, partial=partial)
    _load_version_1(rollout, model_dir, 1)
    second = rollout.generate(_prompts(200), n=N, partial=partial)
    _load_version_1(rollout, model_dir, 2)
    third = rollout.generate(_prompts(300), n=N, partial=partial)
    assert sorted(set(first["uid"].tolist())) == [100, 102, 104]
    # Carried once, the long groups may be carried again: the second call stops at its own short groups.
    assert sorted(set(second["uid"].tolist())) == [200, 202, 204]
    # Carried twice, they finish in the third call, over three versions (the second
    # call's long groups, carried once, go on to the next call).
    assert sorted(set(third["uid"].tolist())) == [101, 103, 300, 302, 304]
    assert sorted(set(rollout.carried()["rows"]["uid"].tolist())) == [201, 203, 301, 303]
    for row in ((third["uid"] == 101) | (third["uid"] == 103)).nonzero().flatten().tolist():
        versions = third["policy_version"][row].tolist()
        assert int(third["response_mask"][row].sum()) == R
        assert versions == sorted(versions) and set(versions) == {0, 1, 2}, versions


def test_carried_samples_need_the_next_batch_to_have_their_widths(model_dir: str) -> None:
    """Carried rows join the next call's output, so its prompt columns must be as
    wide as theirs: a batch padded to other widths is refused by name, not left to
    fail in a concatenation (data sources pad every batch of a run alike)."""
    rollout = _rollout(model_dir)
    partial = PartialRollout(decode_steps=2)
    rollout.generate(_prompts(100), n=N, partial=partial)
    wider = _prompts(200)
    pad = torch.full((wider.num_rows, 1), int(wider["answer_ids"].max()) + 1)
    wider = wider.update({"answer_ids": torch.cat([wider["answer_ids"], pad], dim=1)})
    with pytest.raises(SchemaError, match=r"samples carried over from an earlier call have rows of shape \[\d+\] "
                                          r"in prompt column 'answer_ids', this call's prompts \[\d+\]"):
        rollout.generate(wider, n=N, partial=partial)


def test_partial_rollout_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="decode_steps must be an int >= 1"):
        PartialRollout(decode_steps=0)
    with pytest.raises(ConfigError, match="mode must be"):
        PartialRollout(decode_steps=2, mode="pause")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="max_carries must be an int >= 1"):
        PartialRollout(decode_steps=2, max_carries=0)
