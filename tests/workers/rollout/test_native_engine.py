"""Native rollout engine on real tiny models: log-probs, continuous batching, EOS, seeds,
and generation runs (stepping, completion order, migration of unfinished samples)."""

from __future__ import annotations

import logging
import random
from typing import Any

import msgspec
import pytest
import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from channels import ConfigError
from workers.models import CharTokenizer, TinyModelConfig, build_tiny_model
from workers.rollout import (
    FinishedSample,
    GenerationRun,
    NativeRolloutConfig,
    NativeRolloutEngine,
    PartialSample,
    RolloutOutput,
    SamplingParams,
)
from workers.rollout._sampling import row_seed, sample_tokens

torch.set_num_threads(1)

TOKENIZER = CharTokenizer()
SAMPLED = SamplingParams(max_new_tokens=16, temperature=1.0, top_k=8, top_p=0.9, seed=11)
GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0)


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    texts = [
        f"{rng.randint(0, 10 ** rng.randint(1, 5))}+{rng.randint(0, 99)}=" for _ in range(count)
    ]
    return [TOKENIZER.encode(text) for text in texts]


PROMPTS = _prompts(7)


@pytest.fixture(scope="module")
def model() -> PreTrainedModel:
    return build_tiny_model(TinyModelConfig(), seed=0)


pytestmark = pytest.mark.usefixtures("decode")
DECODE = "dynamic"
"""The engines' KV cache (``NativeRolloutConfig.decode``): conftest's ``decode`` runs
every test with both."""


def _config(**settings: Any) -> NativeRolloutConfig:
    return NativeRolloutConfig(decode=DECODE, **settings)


def _engine(model: PreTrainedModel, max_batch_size: int = 32, seed: int = 0) -> NativeRolloutEngine:
    return NativeRolloutEngine(model, config=_config(max_batch_size=max_batch_size, seed=seed))


def _reference_logprobs(model: PreTrainedModel, out: RolloutOutput) -> torch.Tensor:
    """What the training engine computes: one forward over prompt ++ response."""
    ids = torch.cat([out.prompt_ids, out.response_ids], dim=1)
    mask = torch.cat([out.prompt_mask, out.response_mask], dim=1)
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    start = out.prompt_ids.shape[1] - 1
    logprobs = F.log_softmax(logits[:, start:-1].float(), dim=-1)
    chosen = logprobs.gather(-1, out.response_ids[..., None]).squeeze(-1)
    return chosen * out.response_mask


def _assert_same(a: RolloutOutput, b: RolloutOutput) -> None:
    assert torch.equal(a.response_ids, b.response_ids)
    assert torch.equal(a.response_mask, b.response_mask)
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_logprobs_equal_a_full_forward_pass(architecture: str) -> None:
    model = build_tiny_model(TinyModelConfig(architecture=architecture), seed=1)  # type: ignore[arg-type]
    params = SamplingParams(
        max_new_tokens=16, temperature=0.9, top_k=10, top_p=0.95, seed=1, eos_token_id=9
    )
    out = _engine(model, max_batch_size=3).generate(PROMPTS, params)
    assert out.response_ids.shape == out.logprobs.shape == (len(PROMPTS), 16)
    assert out.logprobs.dtype == torch.float32
    assert len(set(out.response_lengths.tolist())) > 1, "want rows that finish at different steps"
    torch.testing.assert_close(out.logprobs, _reference_logprobs(model, out), atol=1e-5, rtol=0)


def test_output_follows_padding_conventions(model: PreTrainedModel) -> None:
    out = _engine(model).generate(PROMPTS, GREEDY)
    width = max(len(p) for p in PROMPTS)
    assert out.prompt_ids.shape == (len(PROMPTS), width)
    for row, prompt in enumerate(PROMPTS):
        assert out.prompt_ids[row, width - len(prompt) :].tolist() == prompt
        assert out.prompt_mask[row].tolist() == [0] * (width - len(prompt)) + [1] * len(prompt)
    assert bool((out.response_mask == 1).all())
    assert bool((out.logprobs < 0).all())


def test_rows_from_samples_are_padded_and_a_response_past_the_budget_is_refused() -> None:
    params = SamplingParams(max_new_tokens=3, pad_token_id=9)
    out = RolloutOutput.from_samples(
        [[1, 2], [3]], [FinishedSample(index=0, response_ids=[4], logprobs=[-0.5]),
                        FinishedSample(index=1, response_ids=[5, 6, 7], logprobs=[-1.0, -2.0, -3.0])], params)
    assert out.prompt_ids.tolist() == [[1, 2], [9, 3]] and out.prompt_mask.tolist() == [[1, 1], [0, 1]]
    assert out.response_ids.tolist() == [[4, 9, 9], [5, 6, 7]]
    assert out.response_mask.tolist() == [[1, 0, 0], [1, 1, 1]]
    assert out.logprobs.tolist() == [[-0.5, 0.0, 0.0], [-1.0, -2.0, -3.0]] and out.logprobs.dtype == torch.float32
    empty = RolloutOutput.from_samples([], [], params)
    assert empty.prompt_ids.shape == (0, 0) and empty.response_ids.shape == (0, 3)
    with pytest.raises(ValueError, match="4 tokens, more than max_new_tokens=3"):
        RolloutOutput.from_samples([[1]], [FinishedSample(index=0, response_ids=[1, 2, 3, 4], logprobs=[0.0] * 4)],
                                   params)


def test_continuous_batching_matches_static_batching(model: PreTrainedModel) -> None:
    static = _engine(model, max_batch_size=len(PROMPTS))
    for params in (GREEDY, SamplingParams(max_new_tokens=16, seed=5, eos_token_id=9)):
        expected = static.generate(PROMPTS, params)
        for size in (1, 3):
            _assert_same(_engine(model, max_batch_size=size).generate(PROMPTS, params), expected)


def test_rows_of_one_length_leave_and_join_as_when_decoded_alone(model: PreTrainedModel) -> None:
    # Prompts of one length decode without padding (no mask written per step) until
    # rows leave at their budgets and waiting ones join: the mask is then needed.
    prompts = [[1, *p] for p in torch.randint(3, 19, (5, 6), generator=torch.Generator().manual_seed(2)).tolist()]
    budgets = [3, 9, 5, 12, 7]
    for params in (SamplingParams(max_new_tokens=12, ignore_eos=True, seed=3),
                   SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.0)):
        expected = _engine(model, max_batch_size=1).generate(prompts, params, max_new_tokens=budgets)
        for size in (2, 5):
            _assert_same(_engine(model, max_batch_size=size).generate(prompts, params, max_new_tokens=budgets),
                         expected)


def test_waiting_prompts_join_while_others_decode(model: PreTrainedModel) -> None:
    long_prompt, short_prompt, eos = _long_and_short(model)
    batch_sizes: list[int] = []
    hook = model.get_input_embeddings().register_forward_pre_hook(
        lambda _module, args: batch_sizes.append(args[0].shape[0])
    )
    try:
        params = SamplingParams(max_new_tokens=12, temperature=0.0, eos_token_id=eos)
        stream = _engine(model, max_batch_size=2).generate_stream(
            [long_prompt, short_prompt, short_prompt, short_prompt], params
        )
        order = [sample.index for sample in stream]
    finally:
        hook.remove()
    # Static waves of two would finish [1, 0, 2, 3]; rows 2 and 3 take row 1's place
    # while row 0 is still decoding.
    assert order == [1, 2, 3, 0]
    assert max(batch_sizes) <= 2


def _long_and_short(model: PreTrainedModel) -> tuple[list[int], list[int], int]:
    """A prompt pair and an EOS id: the short one's first greedy token, absent from the long one's."""
    candidates = _prompts(12, seed=1)
    out = _engine(model).generate(candidates, SamplingParams(max_new_tokens=12, temperature=0.0))
    for short in range(len(candidates)):
        eos = int(out.response_ids[short, 0])
        for long in range(len(candidates)):
            if eos not in out.response_ids[long].tolist():
                return candidates[long], candidates[short], eos
    raise AssertionError("no prompt pair fits; change the candidate seed")


def test_eos_stops_a_row_and_masks_the_rest(model: PreTrainedModel) -> None:
    long_prompt, short_prompt, eos = _long_and_short(model)
    params = SamplingParams(max_new_tokens=12, temperature=0.0, eos_token_id=eos, pad_token_id=0)
    out = _engine(model).generate([long_prompt, short_prompt], params)
    assert out.response_lengths.tolist() == [12, 1]
    assert out.response_ids[1].tolist() == [eos] + [0] * 11
    assert out.response_mask[1].tolist() == [1] + [0] * 11
    assert bool((out.logprobs[1, 1:] == 0).all()) and float(out.logprobs[1, 0]) < 0


def test_top_k_one_is_greedy(model: PreTrainedModel) -> None:
    engine = _engine(model)
    top1 = engine.generate(PROMPTS, SamplingParams(max_new_tokens=16, temperature=1.3, top_k=1))
    _assert_same(top1, engine.generate(PROMPTS, GREEDY))


def test_each_token_is_drawn_with_its_samples_stream_at_its_position(model: PreTrainedModel) -> None:
    """Token ``k`` of sample ``i`` is what the sampler picks from the model's distribution
    there with the uniform at position ``k`` of the stream ``row_seed(seed, i)``,
    whichever rows share its steps (the stream migration carries)."""
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=5, ignore_eos=True)
    out = _engine(model).generate(PROMPTS[:3], params)
    for index, prompt in enumerate(PROMPTS[:3]):
        response = out.response_ids[index].tolist()
        with torch.no_grad():
            logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].float()
        seeds = [row_seed(5, index)] * len(response)
        tokens, _ = sample_tokens(logits, params, seeds, lengths=list(range(len(response))))
        assert tokens.tolist() == response, index


def test_sampling_is_deterministic_given_the_seed(model: PreTrainedModel) -> None:
    engine = _engine(model)
    first = engine.generate(PROMPTS, SAMPLED)
    _assert_same(engine.generate(PROMPTS, SAMPLED), first)
    reseeded = SamplingParams(max_new_tokens=16, temperature=1.0, top_k=8, top_p=0.9, seed=12)
    assert not torch.equal(engine.generate(PROMPTS, reseeded).response_ids, first.response_ids)
    assert not torch.equal(
        first.response_ids, _engine(model).generate(PROMPTS, GREEDY).response_ids
    )


def test_unseeded_requests_follow_the_engine_seed(model: PreTrainedModel) -> None:
    params = SamplingParams(max_new_tokens=16)
    engine, twin = _engine(model, seed=4), _engine(model, seed=4)
    first, second = engine.generate(PROMPTS, params), engine.generate(PROMPTS, params)
    assert not torch.equal(first.response_ids, second.response_ids)
    _assert_same(twin.generate(PROMPTS, params), first)
    _assert_same(twin.generate(PROMPTS, params), second)


def test_stream_reports_every_sample_once_and_keeps_grad_mode(model: PreTrainedModel) -> None:
    expected = _engine(model).generate(PROMPTS, SAMPLED)
    seen = set()
    for sample in _engine(model, max_batch_size=2).generate_stream(PROMPTS, SAMPLED):
        assert torch.is_grad_enabled(), "the engine must not leak no_grad into the consumer"
        assert sample.index not in seen
        seen.add(sample.index)
        count = int(expected.response_lengths[sample.index])
        assert sample.response_ids == expected.response_ids[sample.index, :count].tolist()
        torch.testing.assert_close(
            torch.tensor(sample.logprobs),
            expected.logprobs[sample.index, :count],
            atol=1e-5,
            rtol=0,
        )
    assert seen == set(range(len(PROMPTS)))


def test_prompt_limits_are_checked_before_generation(model: PreTrainedModel) -> None:
    engine = _engine(model)
    params = SamplingParams(max_new_tokens=10, temperature=0.0)
    fits = engine.generate([PROMPTS[0], [4] * 246], params)
    assert fits.response_ids.shape == (2, 10)
    with pytest.raises(ValueError, match=r"prompts\[1\] has 247 tokens.*257 > .*=256"):
        engine.generate_stream([PROMPTS[0], [4] * 247], params)
    with pytest.raises(ValueError, match=r"prompts\[0\] is empty"):
        engine.generate([[]], params)
    with pytest.raises(ValueError, match=r"prompts\[1\] holds token id 99"):
        engine.generate([[4], [4, 99]], params)
    assert engine.generate([], params).response_ids.shape == (0, 10)


def test_update_weights_changes_greedy_output() -> None:
    model = build_tiny_model(TinyModelConfig(), seed=0)
    engine = _engine(model, max_batch_size=3)
    before = engine.generate(PROMPTS, GREEDY)
    update = build_tiny_model(TinyModelConfig(), seed=1)
    assert engine.update_weights(update.state_dict().items()) == len(update.state_dict())
    after = engine.generate(PROMPTS, GREEDY)
    assert not torch.equal(before.response_ids, after.response_ids)
    _assert_same(after, _engine(update).generate(PROMPTS, GREEDY))
    torch.testing.assert_close(
        after.logprobs, _reference_logprobs(update, after), atol=1e-5, rtol=0
    )
    with pytest.raises(ValueError, match=r"'lm_head\.bias'"):
        engine.update_weights([("lm_head.bias", torch.zeros(19))])
    with pytest.raises(ValueError, match=r"shape \(2, 2\)"):
        engine.update_weights([("lm_head.weight", torch.zeros(2, 2))])


def test_bound_weights_are_viewed_not_copied_and_released_weights_refuse_to_generate() -> None:
    model = build_tiny_model(TinyModelConfig(), seed=0)
    engine = _engine(model)
    update = build_tiny_model(TinyModelConfig(), seed=1)
    held = {name: p.detach().clone() for name, p in update.named_parameters()}
    engine.release_weights()
    assert all(p.numel() == 0 for p in engine.model.parameters())
    with pytest.raises(ConfigError, match="weights were released"):
        engine.generate(PROMPTS, GREEDY)
    assert engine.bind_weights(held.items()) == len(held)
    for name, p in engine.model.named_parameters():  # the same memory, no copy
        assert p.untyped_storage().data_ptr() == held[name].untyped_storage().data_ptr()
    _assert_same(engine.generate(PROMPTS, GREEDY), _engine(update).generate(PROMPTS, GREEDY))
    engine.release_weights()
    with pytest.raises(ConfigError, match=r"'lm_head\.weight' as \(2, 2\)"):
        engine.bind_weights([("lm_head.weight", torch.zeros(2, 2))])


# Generation runs: stepping, streaming order, export/admit (migration between engines).


def _step_to_end(run: GenerationRun) -> tuple[dict[int, FinishedSample], dict[int, int]]:
    """Step ``run`` until done: each sample, and the step (1-based) that reported it."""
    samples: dict[int, FinishedSample] = {}
    steps: dict[int, int] = {}
    count = 0
    while run.pending:
        count += 1
        for sample in run.step():
            assert sample.index not in samples, "a sample was reported twice"
            samples[sample.index], steps[sample.index] = sample, count
    return samples, steps


def _rows(
    prompts: list[list[int]], samples: dict[int, FinishedSample], params: SamplingParams
) -> RolloutOutput:
    return RolloutOutput.from_samples(prompts, [samples[i] for i in range(len(prompts))], params)


@pytest.mark.parametrize("params", [SAMPLED, GREEDY], ids=["sampled", "greedy"])
def test_stepping_a_run_gives_the_rows_of_generate(
    model: PreTrainedModel, params: SamplingParams
) -> None:
    engine = _engine(model, max_batch_size=3)
    expected = engine.generate(PROMPTS, params)
    run = engine.start(PROMPTS, params)
    assert run.pending == len(PROMPTS)
    samples, _ = _step_to_end(run)
    _assert_same(_rows(PROMPTS, samples, params), expected)
    # The caller's indices are reported back; greedy rows do not depend on them.
    if params.greedy:
        ids = [100 + 3 * i for i in range(len(PROMPTS))]
        relabelled, _ = _step_to_end(engine.start(PROMPTS, params, indices=ids))
        assert sorted(relabelled) == ids
        for row, index in enumerate(ids):
            assert relabelled[index].response_ids == samples[row].response_ids
    with pytest.raises(ValueError, match="indices"):
        engine.start(PROMPTS, params, indices=[0] * len(PROMPTS))


def test_a_short_sample_is_reported_in_an_earlier_step_than_a_long_one(
    model: PreTrainedModel,
) -> None:
    long_prompt, short_prompt, eos = _long_and_short(model)
    params = SamplingParams(max_new_tokens=12, temperature=0.0, eos_token_id=eos)
    samples, steps = _step_to_end(_engine(model).start([long_prompt, short_prompt], params))
    assert len(samples[1].response_ids) == 1 and len(samples[0].response_ids) == 12
    assert steps[1] < steps[0]


def _same_weights(model: PreTrainedModel) -> PreTrainedModel:
    """Another model object with ``model``'s weights (another engine's, say another process's)."""
    twin = build_tiny_model(TinyModelConfig(), seed=7)
    twin.load_state_dict(model.state_dict())
    return twin


@pytest.mark.parametrize(
    "params",
    [SAMPLED, GREEDY, SamplingParams(max_new_tokens=16, eos_token_id=9)],
    ids=["sampled", "greedy", "unseeded"],
)
def test_exported_samples_continue_on_another_engine_as_if_uninterrupted(
    model: PreTrainedModel, params: SamplingParams
) -> None:
    expected = _engine(model, max_batch_size=3, seed=4).generate(PROMPTS, params)
    source = _engine(model, max_batch_size=3, seed=4).start(PROMPTS, params)
    finished: dict[int, FinishedSample] = {}
    for _ in range(4):
        finished.update((sample.index, sample) for sample in source.step())
    moved = source.export()
    assert source.pending == 0 and source.step() == []
    # Some samples were decoding (tokens so far), some still waiting (none yet).
    assert any(p.response_ids for p in moved) and any(not p.response_ids for p in moved)
    assert all((p.rng_state is None) == params.greedy for p in moved)
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(moved), type=list[PartialSample])

    # Another engine, another seed: the samples carry their own random streams.
    target = _engine(_same_weights(model), max_batch_size=2, seed=99).start([], params)
    target.admit(wire)
    assert target.pending == len(moved)
    resumed, _ = _step_to_end(target)
    assert set(resumed).isdisjoint(finished)
    out = _rows(PROMPTS, finished | resumed, params)
    assert torch.equal(out.response_ids, expected.response_ids)
    assert torch.equal(out.response_mask, expected.response_mask)
    torch.testing.assert_close(out.logprobs, expected.logprobs, atol=1e-4, rtol=0)


def test_export_empties_the_run_and_finished_samples_are_refused(model: PreTrainedModel) -> None:
    long_prompt, short_prompt, eos = _long_and_short(model)
    params = SamplingParams(max_new_tokens=6, eos_token_id=eos, seed=3)
    engine = _engine(model)
    run = engine.start([long_prompt, short_prompt], params)
    run.step()
    (partial,) = (p for p in run.export() if p.index == 0)
    assert run.pending == 0
    full = msgspec.structs.replace(partial, response_ids=[5] * 6, logprobs=[-1.0] * 6)
    with pytest.raises(ValueError, match=r"index=0 is finished: it has 6 tokens"):
        run.admit([full])
    ended = msgspec.structs.replace(partial, response_ids=[5, eos], logprobs=[-1.0, -1.0])
    with pytest.raises(ValueError, match=r"index=0 is finished: its response holds eos"):
        run.admit([ended])
    with pytest.raises(ValueError, match=r"index=0 carries an rng_state of 7 bytes"):
        run.admit([msgspec.structs.replace(partial, rng_state=b"\0" * 7)])
    run.admit([partial])
    with pytest.raises(ValueError, match=r"index=0 is already pending"):
        run.admit([partial])
    assert run.pending == 1

    # New weights end the run; its samples can still leave it.
    engine.update_weights(model.state_dict().items())
    with pytest.raises(RuntimeError, match=r"weights changed.*export\(\)"):
        run.step()
    assert [p.index for p in run.export()] == [0]
    run.close()
    run.close()
    with pytest.raises(RuntimeError, match="closed"):
        run.admit([partial])


# ignore_eos and per-prompt token budgets (max_new_tokens), through migration too.

BUDGETS = [1, 16, 5, 9, 2, 12, 7]


def _cut_at_eos(tokens: list[int], eos: int) -> int:
    """Length of ``tokens`` up to and including its first ``eos`` (all when none)."""
    return tokens.index(eos) + 1 if eos in tokens else len(tokens)


@pytest.mark.parametrize("params", [SAMPLED, GREEDY], ids=["sampled", "greedy"])
def test_ignore_eos_runs_every_response_to_its_budget(
    model: PreTrainedModel, params: SamplingParams
) -> None:
    engine = _engine(model, max_batch_size=3)
    free = engine.generate(PROMPTS, params)  # no EOS: every response has 16 tokens
    eos = int(free.response_ids[0, 2])
    ignoring = msgspec.structs.replace(params, eos_token_id=eos, ignore_eos=True)
    out = engine.generate(PROMPTS, ignoring)
    assert out.response_lengths.tolist() == [16] * len(PROMPTS)
    _assert_same(out, free)
    # Without ignore_eos the same EOS ends row 0 after its third token at the latest.
    stopped = engine.generate(PROMPTS, msgspec.structs.replace(params, eos_token_id=eos))
    for row in range(len(PROMPTS)):
        count = _cut_at_eos(free.response_ids[row].tolist(), eos)
        assert int(stopped.response_lengths[row]) == count
    assert int(stopped.response_lengths[0]) <= 3

    # Runs honour it too, and admit a sample whose response already holds EOS.
    samples, _ = _step_to_end(engine.start(PROMPTS, ignoring))
    _assert_same(_rows(PROMPTS, samples, ignoring), free)
    run = engine.start([], ignoring)
    carried = free.response_ids[0, :3].tolist()
    run.admit([PartialSample(index=0, prompt=PROMPTS[0], response_ids=carried,
                             logprobs=free.logprobs[0, :3].tolist())])
    (resumed,) = _step_to_end(run)[0].values()
    assert len(resumed.response_ids) == 16 and resumed.response_ids[:3] == carried
    assert eos in carried


@pytest.mark.parametrize("params", [SAMPLED, GREEDY], ids=["sampled", "greedy"])
def test_per_prompt_budgets_give_those_lengths(
    model: PreTrainedModel, params: SamplingParams
) -> None:
    engine = _engine(model, max_batch_size=3)
    free = engine.generate(PROMPTS, params)
    eos = int(free.response_ids[1, 2])  # row 1 (budget 16) would stop at its third token
    ignoring = msgspec.structs.replace(params, eos_token_id=eos, ignore_eos=True)
    exact = engine.generate(PROMPTS, ignoring, max_new_tokens=BUDGETS)
    assert exact.response_ids.shape == (len(PROMPTS), 16)  # still padded to the params' width
    assert exact.response_lengths.tolist() == BUDGETS
    for row, budget in enumerate(BUDGETS):  # a budget ends a response, it does not change it
        assert exact.response_ids[row, :budget].tolist() == free.response_ids[row, :budget].tolist()
    torch.testing.assert_close(exact.logprobs, free.logprobs * exact.response_mask, atol=1e-5, rtol=0)
    streamed = {s.index: s for s in engine.generate_stream(PROMPTS, ignoring, max_new_tokens=BUDGETS)}
    assert [len(streamed[i].response_ids) for i in range(len(PROMPTS))] == BUDGETS

    # Without ignore_eos a response stops at its budget or its first EOS, never later.
    capped = engine.generate(
        PROMPTS, msgspec.structs.replace(params, eos_token_id=eos), max_new_tokens=BUDGETS
    )
    for row, budget in enumerate(BUDGETS):
        count = _cut_at_eos(free.response_ids[row, :budget].tolist(), eos)
        assert int(capped.response_lengths[row]) == count <= budget
    assert int(capped.response_lengths[1]) <= 3


@pytest.mark.parametrize("params", [SAMPLED, GREEDY], ids=["sampled", "greedy"])
def test_a_migrated_sample_keeps_its_budget(model: PreTrainedModel, params: SamplingParams) -> None:
    ignoring = msgspec.structs.replace(params, eos_token_id=9, ignore_eos=True)
    expected = _engine(model, max_batch_size=3, seed=4).generate(
        PROMPTS, ignoring, max_new_tokens=BUDGETS
    )
    source = _engine(model, max_batch_size=3, seed=4).start(
        PROMPTS, ignoring, max_new_tokens=BUDGETS
    )
    finished: dict[int, FinishedSample] = {}
    for _ in range(4):
        finished.update((sample.index, sample) for sample in source.step())
    moved = source.export()
    assert any(p.response_ids for p in moved) and any(not p.response_ids for p in moved)
    assert {p.index: p.max_new_tokens for p in moved} == {p.index: BUDGETS[p.index] for p in moved}
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(moved), type=list[PartialSample])

    target = _engine(_same_weights(model), max_batch_size=2, seed=99).start([], ignoring)
    target.admit(wire)
    resumed, _ = _step_to_end(target)
    out = _rows(PROMPTS, finished | resumed, ignoring)
    assert out.response_lengths.tolist() == BUDGETS
    assert torch.equal(out.response_ids, expected.response_ids)
    torch.testing.assert_close(out.logprobs, expected.logprobs, atol=1e-4, rtol=0)


def test_bad_budgets_are_refused_naming_the_prompt(model: PreTrainedModel) -> None:
    engine = _engine(model)
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    for bad in (0, 9, -1, True, 2.0):
        with pytest.raises(ConfigError, match=rf"max_new_tokens\[1\] \(prompt 1\) is {bad!r}"):
            engine.generate(PROMPTS[:2], params, max_new_tokens=[3, bad])  # type: ignore[list-item]
    with pytest.raises(ConfigError, match=r"2 prompts but 3 max_new_tokens"):
        engine.start(PROMPTS[:2], params, max_new_tokens=[1, 2, 3])
    with pytest.raises(ConfigError, match=r"max_new_tokens\[0\] \(prompt 0\) is 0"):
        engine.generate_stream(PROMPTS[:1], params, max_new_tokens=[0])
    # A prompt needs room for its own budget only.
    fits = engine.generate([[4] * 250], SamplingParams(max_new_tokens=10), max_new_tokens=[6])
    assert fits.response_ids.shape == (1, 10) and int(fits.response_lengths[0]) <= 6
    with pytest.raises(ConfigError, match=r"prompts\[0\] has 251 tokens; with max_new_tokens=6"):
        engine.generate([[4] * 251], SamplingParams(max_new_tokens=10), max_new_tokens=[6])

    # Admitted samples: a budget wider than the run's responses, or already reached.
    run = engine.start([], params)
    partial = PartialSample(index=0, prompt=PROMPTS[0], response_ids=[5, 6], logprobs=[-1.0, -1.0])
    with pytest.raises(ConfigError, match=r"index=0 max_new_tokens is 9; .* 1\.\.8"):
        run.admit([msgspec.structs.replace(partial, max_new_tokens=9)])
    with pytest.raises(ConfigError, match=r"index=0 is finished: it has 2 tokens and its budget"):
        run.admit([msgspec.structs.replace(partial, max_new_tokens=2)])
    run.admit([msgspec.structs.replace(partial, max_new_tokens=3)])
    (resumed,) = _step_to_end(run)[0].values()
    assert len(resumed.response_ids) == 3


def test_the_default_batch_is_sized_from_the_request_and_a_cap_that_splits_it_is_logged(
        model: PreTrainedModel, caplog: pytest.LogCaptureFixture) -> None:
    params = SamplingParams(max_new_tokens=4, temperature=1.0, ignore_eos=True, seed=3)
    widths: list[int] = []
    # every model call (prefill, decode step; transformers' or the lean one) embeds its input ids first
    hook = model.get_input_embeddings().register_forward_hook(lambda _m, args, _out: widths.append(args[0].shape[0]))
    try:
        with caplog.at_level(logging.INFO, logger="workers.rollout._native"):
            uncapped = NativeRolloutEngine(model, config=_config()).generate(PROMPTS, params)
            assert widths == [len(PROMPTS)] * 4  # one prefill and three decodes of every sample
            assert "7 samples decode in one batch (max_batch_size=None)" in caplog.text
            widths.clear()
            capped = NativeRolloutEngine(model, config=_config(max_batch_size=3))
            _assert_same(capped.generate(PROMPTS, params), uncapped)
            assert max(widths) == 3 and len(widths) > 4
            capped.generate(PROMPTS, params)
    finally:
        hook.remove()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, "warned once per engine"
    assert "7 samples exceed max_batch_size=3; they decode in waves of at most 3" in warnings[0].getMessage()
