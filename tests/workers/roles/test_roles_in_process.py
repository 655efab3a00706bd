"""Actor, reference and critic roles built in this process (one rank, no Ray): the batch
contract, log-prob consistency, weight sync after updates, checkpoints, exports."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from roles_testlib import TINY, advantages_for, local_ctx, prompt_columns

from channels import Batch, ConfigError, MissingFieldError
from workers import Adopt, Chunk, Finish, Handoff, Tail
from workers.engines import TrainingConfig
from workers.models import TinyModelConfig, load_model, save_tiny_model
from workers.objectives import PolicyLoss
from workers.roles import (
    ActorConfig,
    ActorWorker,
    CriticConfig,
    CriticWorker,
    ReferenceConfig,
    ReferenceWorker,
    UpdateConfig,
)
from workers.roles._rollout import build_rollout
from workers.rollout import NativeRolloutConfig, SamplingParams

torch.set_num_threads(1)
R = 6
SAMPLE = SamplingParams(max_new_tokens=R, temperature=1.0)
GREEDY = SamplingParams(max_new_tokens=R, temperature=0.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_tiny_model(tmp_path_factory.mktemp("policy"), TINY, seed=0))


def _actor(model_dir: str, **kw) -> ActorWorker:
    config = ActorConfig(model_dir=model_dir, training=TrainingConfig(lr=1e-2), sampling=SAMPLE, **kw)
    return ActorWorker(local_ctx("actor"), config)


def test_generate_returns_n_consecutive_samples_per_prompt_with_the_contract_fields(model_dir: str) -> None:
    actor = _actor(model_dir)
    prompts = prompt_columns()
    out = actor.generate(Batch(prompts), n=3)
    rows = 3 * len(prompts["uid"])
    assert set(out) == {*prompts, "response_ids", "response_mask", "rollout_logprobs", "policy_version"}
    assert torch.equal(out["policy_version"], torch.zeros(rows, R, dtype=torch.int64))  # no update yet
    for name in prompts:  # prompt columns repeated, a prompt's samples consecutive
        assert torch.equal(out[name], prompts[name].repeat_interleave(3, dim=0)), name
    assert out["response_ids"].shape == out["response_mask"].shape == (rows, R)
    assert out["response_ids"].dtype == out["response_mask"].dtype == torch.int64
    assert out["rollout_logprobs"].dtype == torch.float32
    assert torch.all(out["rollout_logprobs"][out["response_mask"] == 0] == 0)
    lengths = out["response_mask"].sum(1)
    assert torch.all(lengths >= 1)
    # A response ends at the model's EOS (filled in from its config) or at R tokens.
    last = out["response_ids"].gather(1, (lengths - 1)[:, None]).squeeze(1)
    assert torch.all((last == actor._eos) | (lengths == R))
    assert not torch.equal(out["response_ids"][0], out["response_ids"][1]) or not torch.equal(
        out["response_ids"][1], out["response_ids"][2])  # samples of one prompt differ


def _streamed_with_handoff(actor: ActorWorker, prompts: Batch, *, n: int, params: SamplingParams,
                           steps: int) -> dict[str, torch.Tensor]:
    """``actor.generate`` driven as the streaming runtime drives it: this rank steps ``steps``
    times and hands its unfinished samples off; a second call (the adopting rank, no prompts
    of its own) adopts and finishes them. Every reported row, in row-id order."""
    chunks: list[Chunk] = []
    source = ActorWorker.generate.fn(actor, prompts, n=n, params=params)
    out, taken, tail = next(source), 0, None
    while tail is None:
        if isinstance(out, Chunk):
            chunks.append(out)
            out = next(source)
        elif isinstance(out, Tail):
            tail = out.rows
        else:
            taken += 1
            out = source.send(Handoff() if taken > steps else None)
    source.close()
    assert tail.num_rows, "nothing was left to migrate; take fewer steps"
    adopter = ActorWorker.generate.fn(actor, Batch({k: v[:0] for k, v in prompts.items()}), n=n, params=params)
    out, adopted = next(adopter), False
    try:
        while True:
            if isinstance(out, Chunk):
                chunks.append(out)
                out = next(adopter)
            elif adopted and out.pending == 0:
                out = adopter.send(Finish())
            else:
                out = adopter.send(None if adopted else Adopt(tail))
                adopted = True
    except StopIteration:
        pass
    rows = Batch.concat([c.rows for c in chunks])
    order = torch.argsort(torch.tensor([i for c in chunks for i in c.ids]))
    return {name: rows[name][order] for name in rows}


def test_generate_gives_each_prompt_its_max_new_tokens_column_batch_and_streamed(model_dir: str) -> None:
    actor = _actor(model_dir)
    budgets = torch.tensor([1, 6, 3, 2, 5])
    prompts = Batch({**prompt_columns(), "max_new_tokens": budgets})
    params = SamplingParams(max_new_tokens=R, temperature=1.0, seed=5, ignore_eos=True)
    out = actor.generate(prompts, n=2, params=params)
    assert out["response_ids"].shape == (10, R)
    assert out["response_mask"].sum(1).tolist() == budgets.repeat_interleave(2).tolist()
    assert torch.equal(out["max_new_tokens"], budgets.repeat_interleave(2))
    # Streamed with long-tail migration after two steps: the same rows.
    streamed = _streamed_with_handoff(actor, prompts, n=2, params=params, steps=2)
    assert set(streamed) == set(out)
    for name in out:
        if name == "rollout_logprobs":  # re-prefilled: equal up to float rounding
            torch.testing.assert_close(streamed[name], out[name], atol=1e-5, rtol=0)
        else:
            assert torch.equal(streamed[name], out[name]), name
    with pytest.raises(ConfigError, match=r"prompt row 1 \(uid 11\) has max_new_tokens=7"):
        actor.generate(Batch({**prompt_columns(), "max_new_tokens": torch.tensor([1, 7, 3, 2, 5])}),
                       params=params)


def test_groups_that_finish_in_one_step_are_reported_one_chunk_each(model_dir: str) -> None:
    """Every group ends at the same engine step (one budget, EOS ignored): the rank
    builds their rows together but still reports one chunk per group (a stream's
    micro-batches are counted in groups), and the rows are the batch call's."""
    actor = _actor(model_dir)
    prompts = Batch(prompt_columns())
    params = SamplingParams(max_new_tokens=R, temperature=1.0, seed=3, ignore_eos=True)
    chunks, source = [], ActorWorker.generate.fn(actor, prompts, n=3, params=params)
    out = next(source)
    try:
        while True:
            if isinstance(out, Chunk):
                chunks.append(out)
                out = next(source)
            else:
                out = source.send(Finish() if out.pending == 0 else None)
    except StopIteration:
        pass
    reported = [c for c in chunks if c.ids]
    groups = len(prompts["uid"])
    assert [c.rows.num_rows for c in reported] == [3] * groups
    assert all(c.rows.group_size == 3 for c in reported)
    assert [list(c.ids) for c in reported] == [[c.ids[0] + k for k in range(3)] for c in reported]
    whole = actor.generate(prompts, n=3, params=params)
    rows = Batch.concat([c.rows for c in reported])
    for name in whole:
        assert torch.equal(rows[name], whole[name]), name


def test_log_prob_matches_the_rollout_logprobs(model_dir: str) -> None:
    actor = _actor(model_dir)
    rollout = actor.generate(Batch(prompt_columns()), n=2)
    mine = actor.log_prob(Batch(rollout))
    assert set(mine) == {"old_logprobs", "entropy"}
    torch.testing.assert_close(mine["old_logprobs"], rollout["rollout_logprobs"], atol=1e-5, rtol=0)
    reference = ReferenceWorker(local_ctx("ref"), ReferenceConfig(model_dir=model_dir))
    torch.testing.assert_close(reference.log_prob(Batch(rollout))["ref_logprobs"],
                               mine["old_logprobs"], atol=1e-6, rtol=0)


def _shares_memory(actor: ActorWorker) -> list[bool]:
    """Per parameter, whether the rollout engine's model samples from the training parameter's own memory."""
    assert actor.rollout is not None
    training = dict(actor.engine.model.named_parameters())
    return [p.data_ptr() == training[name].data_ptr() for name, p in actor.rollout.model.named_parameters()]


# The dynamic cache (the CPU's default) samples from the training parameters; the
# static one keeps a copy (a bind would turn its CUDA graphs off), loaded after updates.
@pytest.mark.parametrize("decode", ["dynamic", "static"])
def test_update_changes_the_weights_and_the_next_generate_uses_them(model_dir: str, decode: str) -> None:
    actor = _actor(model_dir, loss=PolicyLoss(kl_coef=0.1), rollout=NativeRolloutConfig(decode=decode))
    shared = decode == "dynamic"
    assert set(_shares_memory(actor)) == {shared}
    prompts = Batch(prompt_columns())
    before = actor.generate(prompts, params=GREEDY)
    rollout = actor.generate(prompts, n=4)
    ref = ReferenceWorker(local_ctx("ref"), ReferenceConfig(model_dir=model_dir)).log_prob(Batch(rollout))
    batch = {**rollout, **actor.log_prob(Batch(rollout)), **ref, "advantages": advantages_for(rollout)}
    metrics = actor.update(Batch(batch), schedule=UpdateConfig(epochs=2, mini_batches=2))
    assert metrics["actor/steps"] == 4.0
    assert {"actor/loss", "actor/grad_norm", "actor/kl", "actor/clip_fraction"} <= set(metrics)
    # The training weights moved: the old greedy responses score differently now ...
    moved = actor.log_prob(Batch(before))["old_logprobs"]
    assert (moved - before["rollout_logprobs"]).abs().max() > 1e-3
    # ... and the rollout engine samples from the same new weights.
    after = actor.generate(prompts, params=GREEDY)
    torch.testing.assert_close(actor.log_prob(Batch(after))["old_logprobs"],
                               after["rollout_logprobs"], atol=1e-5, rtol=0)
    assert set(_shares_memory(actor)) == {shared}


def test_the_rollout_samples_from_the_training_parameters_as_from_a_copy_of_them(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """Bit for bit: a copy's parameters start on a cache line and require no
    gradients, and the loaded training parameters must compute as they do (else a
    run whose rollout engine holds a copy, another pool's, drifts from one that
    samples from the training parameters). A model with two heads of 64: on
    ``TINY`` the products round alike either way."""
    model_dir = str(save_tiny_model(tmp_path_factory.mktemp("wider"), TinyModelConfig(), seed=0))
    actor = _actor(model_dir)
    assert set(_shares_memory(actor)) == {True}
    copy = build_rollout(NativeRolloutConfig(), model=actor.engine.model, model_dir=model_dir, rank=0,
                         precision="fp32")
    prompts = Batch(prompt_columns())
    bound = actor.generate(prompts, params=GREEDY, n=4)
    actor.rollout = copy
    copied = actor.generate(prompts, params=GREEDY, n=4)
    assert torch.equal(bound["response_ids"], copied["response_ids"])
    assert torch.equal(bound["rollout_logprobs"], copied["rollout_logprobs"])


def test_update_names_missing_fields_and_too_few_rows(model_dir: str) -> None:
    actor = _actor(model_dir)
    rollout = actor.generate(Batch(prompt_columns()))
    with pytest.raises(MissingFieldError, match="'advantages'"):
        actor.update(Batch(rollout))  # old_logprobs may be absent (on-policy), advantages not
    batch = Batch({**rollout, **actor.log_prob(Batch(rollout)), "advantages": advantages_for(rollout)})
    with pytest.raises(MissingFieldError, match="'ref_logprobs'"):
        actor.update(batch, loss=PolicyLoss(kl_coef=0.1))
    with pytest.raises(ConfigError, match="mini_batches=9"):
        actor.update(batch, schedule=UpdateConfig(mini_batches=9))
    with pytest.raises(ConfigError, match="needs the critic on the actor's pool"):
        actor.update(batch, with_critic=True)  # no critic in this process


def test_checkpoint_roundtrip_restores_training_and_rollout_weights(model_dir: str, tmp_path: Path) -> None:
    actor = _actor(model_dir)
    prompts = Batch(prompt_columns())
    rollout = actor.generate(prompts, n=2)
    batch = Batch({**rollout, **actor.log_prob(Batch(rollout)), "advantages": advantages_for(rollout)})
    actor.update(batch)
    saved = actor.generate(prompts, params=GREEDY)
    actor.save_checkpoint(str(tmp_path / "ckpt"))
    actor.update(batch)
    actor.update(batch)
    assert actor.engine.step == 3
    actor.load_checkpoint(str(tmp_path / "ckpt"))
    assert actor.engine.step == 1
    restored = actor.generate(prompts, params=GREEDY)
    assert torch.equal(restored["response_ids"], saved["response_ids"])
    torch.testing.assert_close(restored["rollout_logprobs"], saved["rollout_logprobs"], atol=1e-6, rtol=0)
    torch.testing.assert_close(actor.log_prob(Batch(saved))["old_logprobs"], saved["rollout_logprobs"],
                               atol=1e-5, rtol=0)
    with pytest.raises(ConfigError, match="no checkpoint"):
        actor.load_checkpoint(str(tmp_path / "nothing"))


def test_export_hf_writes_a_model_directory_any_role_can_load(model_dir: str, tmp_path: Path) -> None:
    actor = _actor(model_dir)
    rollout = actor.generate(Batch(prompt_columns()), n=2)
    actor.update(Batch({**rollout, **actor.log_prob(Batch(rollout)),
                        "advantages": advantages_for(rollout)}))
    actor.export_hf(str(tmp_path / "hf"))
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    exported = load_model(tmp_path / "hf")
    for name, tensor in actor.engine.model.state_dict().items():
        assert torch.equal(exported.state_dict()[name], tensor), name
    again = _actor(str(tmp_path / "hf"))
    torch.testing.assert_close(again.log_prob(Batch(rollout))["old_logprobs"],
                               actor.log_prob(Batch(rollout))["old_logprobs"], atol=1e-6, rtol=0)


def test_critic_values_update_checkpoint_and_export(model_dir: str, tmp_path: Path) -> None:
    critic = CriticWorker(local_ctx("critic"), CriticConfig(
        model_dir=model_dir, training=TrainingConfig(lr=1e-2), update=UpdateConfig(epochs=4)))
    rollout = _actor(model_dir).generate(Batch(prompt_columns()), n=2)
    values = critic.values(Batch(rollout))["values"]
    assert values.shape == (10, R) and torch.all(values[rollout["response_mask"] == 0] == 0)
    returns = torch.ones_like(values) * rollout["response_mask"]
    critic.save_checkpoint(str(tmp_path / "ckpt"))
    metrics = critic.update(Batch({**rollout, "values": values, "returns": returns}))
    assert metrics["critic/steps"] == 4.0 and "critic/value_clip_fraction" in metrics
    new = critic.values(Batch(rollout))["values"]
    mask = rollout["response_mask"].bool()
    assert (new[mask] - 1).abs().mean() < (values[mask] - 1).abs().mean()  # towards the returns
    critic.export_hf(str(tmp_path / "hf"))
    exported = CriticWorker(local_ctx("critic"), CriticConfig(model_dir=str(tmp_path / "hf")))
    torch.testing.assert_close(exported.values(Batch(rollout))["values"], new, atol=1e-6, rtol=0)
    critic.load_checkpoint(str(tmp_path / "ckpt"))
    torch.testing.assert_close(critic.values(Batch(rollout))["values"], values, atol=1e-6, rtol=0)
    with pytest.raises(MissingFieldError, match="'returns'"):
        critic.update(Batch({**rollout, "values": values}))


def test_configs_reject_bad_fields_by_name(model_dir: str) -> None:
    with pytest.raises(ConfigError, match=r"ActorConfig\.model_dir"):
        ActorConfig(model_dir=None)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"ActorConfig\.rollout must be a NativeRolloutConfig or"):
        ActorConfig(model_dir=model_dir, rollout="vllm")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"UpdateConfig\.mini_batches"):
        UpdateConfig(mini_batches=0)
    with pytest.raises(ConfigError, match=r"CriticConfig\.loss"):
        CriticConfig(model_dir=model_dir, loss=PolicyLoss())  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        ActorConfig(model_dir=model_dir, lr=1.0)  # type: ignore[call-arg]
    with pytest.raises(ConfigError, match="n must be an int >= 1"):
        _actor(model_dir).generate(Batch(prompt_columns()), n=0)
