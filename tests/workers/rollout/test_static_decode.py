"""The native engine's static KV cache on the CPU (eager steps; the CUDA graphs are
tested in test_graph_decode_on_cuda.py): the same samples as the dynamic cache while
rows finish, move between slots, join mid-run and outgrow the cache, and a decoder
reused across runs only while the weights stay where they were, and a step that
fails to compile running uncompiled (compiling itself is tested on CUDA).

test_native_engine.py and test_sampling_options.py run every one of their tests with
both caches as well."""

from __future__ import annotations

import importlib.util
import logging

import pytest
import torch
from transformers import PreTrainedModel

from channels import ConfigError
from workers.models import TinyModelConfig, build_tiny_model
from workers.rollout import (
    FinishedSample,
    NativeRolloutConfig,
    NativeRolloutEngine,
    PartialSample,
    SamplingParams,
)
from workers.rollout._static_cache import StaticDecoder, bucket_of

torch.set_num_threads(1)

SHAPE = TinyModelConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=32, vocab_size=512, max_position_embeddings=512)
SAMPLED = SamplingParams(max_new_tokens=24, temperature=1.0, top_k=40, seed=5)


@pytest.fixture(scope="module")
def model() -> PreTrainedModel:
    return build_tiny_model(SHAPE, seed=0)


def _prompts(count: int, seed: int, shortest: int = 3, longest: int = 20) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(shortest, longest + 1, (count,), generator=gen).tolist()
    return [[1, *torch.randint(3, 512, (n - 1,), generator=gen).tolist()] for n in lengths]


def _engine(model: PreTrainedModel, decode: str, max_batch_size: int | None = None) -> NativeRolloutEngine:
    return NativeRolloutEngine(model, config=NativeRolloutConfig(decode=decode, max_batch_size=max_batch_size))  # type: ignore[arg-type]


def _step_to_end(run: object) -> dict[int, FinishedSample]:
    finished: dict[int, FinishedSample] = {}
    while run.pending:  # type: ignore[attr-defined]
        finished.update((s.index, s) for s in run.step())  # type: ignore[attr-defined]
    return finished


def _assert_same_samples(a: dict[int, FinishedSample], b: dict[int, FinishedSample]) -> None:
    assert a.keys() == b.keys()
    for index in a:
        assert a[index].response_ids == b[index].response_ids, index
        torch.testing.assert_close(torch.tensor(a[index].logprobs), torch.tensor(b[index].logprobs),
                                   atol=1e-5, rtol=0)


def test_buckets_are_powers_of_two_up_to_the_slots() -> None:
    assert [bucket_of(n, 24) for n in (1, 2, 3, 5, 8, 9, 17, 24)] == [1, 2, 4, 8, 8, 16, 24, 24]
    assert bucket_of(0, 8) == 1


@pytest.mark.parametrize("max_batch_size", [None, 5])
def test_rows_that_finish_at_different_steps_get_the_dynamic_caches_samples(
    model: PreTrainedModel, max_batch_size: int | None
) -> None:
    prompts = _prompts(13, seed=1)
    budgets = torch.randint(1, 25, (13,), generator=torch.Generator().manual_seed(2)).tolist()
    results = [
        _step_to_end(_engine(model, decode, max_batch_size).start(prompts, SAMPLED, max_new_tokens=budgets))
        for decode in ("dynamic", "static")
    ]
    _assert_same_samples(*results)
    assert [len(results[1][i].response_ids) for i in range(13)] == budgets


@pytest.mark.parametrize("decode", ["dynamic", "static"])
def test_a_prompts_samples_prefill_once_and_sample_as_if_alone(model: PreTrainedModel, decode: str) -> None:
    """GRPO's n samples per prompt: each distinct prompt goes through the model once
    at the prefill, and every sample gets the tokens it gets in a run of its own."""
    distinct = _prompts(3, seed=6)
    prompts = [distinct[k] for k in (0, 0, 0, 1, 1, 1, 2, 2, 0)]
    fed: list[int] = []
    hook = model.model.embed_tokens.register_forward_hook(lambda _m, args, _out: fed.append(args[0].shape[0]))
    try:
        together = _step_to_end(_engine(model, decode).start(prompts, SAMPLED))
    finally:
        hook.remove()
    assert fed[0] == 3  # the prefill; then one row per sample at every step
    alone = {}
    for index, prompt in enumerate(prompts):
        alone |= _step_to_end(_engine(model, decode).start([prompt], SAMPLED, indices=[index]))
    _assert_same_samples(together, alone)
    assert len({tuple(together[i].response_ids) for i in range(3)}) > 1  # one prompt, own streams


def test_a_sample_admitted_mid_run_that_outgrows_the_cache_continues_as_on_the_dynamic_cache(
    model: PreTrainedModel,
) -> None:
    params = SamplingParams(max_new_tokens=40, temperature=1.0, seed=9)
    short, long = _prompts(3, seed=3, longest=6), _prompts(2, seed=4, shortest=150, longest=200)
    moved = [PartialSample(index=10 + i, prompt=p, response_ids=[], logprobs=[]) for i, p in enumerate(long)]
    results = []
    for decode in ("dynamic", "static"):
        engine = _engine(model, decode)
        run = engine.start(short, params)
        finished = {s.index: s for s in run.step()}
        run.admit(moved)  # 200 + 40 tokens: more than the 64 the first rows asked for
        finished |= _step_to_end(run)
        results.append(finished)
    _assert_same_samples(*results)


def test_an_exported_run_hands_over_its_responses_so_far(model: PreTrainedModel) -> None:
    prompts = _prompts(6, seed=5)
    exported = []
    for decode in ("dynamic", "static"):
        run = _engine(model, decode).start(prompts, SAMPLED)
        for _ in range(7):
            run.step()
        exported.append(run.export())
    assert [p.response_ids for p in exported[0]] == [p.response_ids for p in exported[1]]
    assert all(len(p.response_ids) == 8 for p in exported[1])
    assert [p.rng_state for p in exported[0]] == [p.rng_state for p in exported[1]]


def test_the_decoder_is_kept_between_runs_until_the_weights_move(model: PreTrainedModel) -> None:
    engine = _engine(build_tiny_model(SHAPE, seed=0), "static")
    prompts = _prompts(4, seed=6)
    first = engine.generate(prompts, SAMPLED)
    pool = engine._decoders
    assert pool is not None and pool._idle is not None
    kept = pool._idle
    assert torch.equal(engine.generate(prompts, SAMPLED).response_ids, first.response_ids)
    assert pool._idle is kept  # the second run reused its cache

    weights = [(name, tensor.clone()) for name, tensor in engine.model.named_parameters()]
    engine.release_weights()
    assert pool._idle is None  # the cache's memory goes with the weights'
    assert pool.graphs  # (ignored on the CPU, which runs the steps eagerly anyway)
    engine.bind_weights(weights)
    assert not pool.graphs, "bound weights are new tensors at every bind: no graph would be replayed twice"
    assert not pool.compiled
    assert torch.equal(engine.generate(prompts, SAMPLED).response_ids, first.response_ids)
    assert pool._idle is not kept


def test_static_decode_is_refused_for_a_model_the_step_does_not_reproduce() -> None:
    lm = build_tiny_model(SHAPE, seed=0)
    lm.config._attn_implementation = "eager"
    with pytest.raises(ConfigError, match="decode='static' needs a Llama- or Qwen2-shaped model"):
        _engine(lm, "static")
    assert _engine(lm, "auto")._decoders is None
    with pytest.raises(ConfigError, match="decode must be"):
        NativeRolloutConfig(decode="graph")  # type: ignore[arg-type]


def test_a_step_that_fails_to_compile_runs_uncompiled_after_one_warning_per_part(
    model: PreTrainedModel, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(step: object, **options: object) -> object:
        def fail(*args: object) -> torch.Tensor:
            raise RuntimeError("no compiler here")
        return fail

    monkeypatch.setattr(torch, "compile", broken)
    plain, compiled = (StaticDecoder(model, slots=4, length=32, graphs=False, compiled=flag) for flag in (False, True))
    for decoder in (plain, compiled):
        decoder.tokens[:] = torch.tensor([5, 6, 7, 8])
        decoder.positions[:] = torch.tensor([0, 1, 2, 3])
    with caplog.at_level(logging.WARNING, logger="workers.rollout._compiled"):
        for _ in range(2):
            assert torch.equal(compiled.step(3), plain.step(3))
    assert [r.getMessage() for r in caplog.records] == [
        f"native rollout: compiling the static decode step's part {part} attention failed "
        "(RuntimeError: no compiler here); it runs uncompiled" for part in ("before", "after")
    ]


def test_compiling_is_auto_by_default_on_cuda_with_triton_only() -> None:
    auto = NativeRolloutConfig()
    assert auto.compile == "auto"
    assert not auto.compiles(torch.device("cpu"))
    assert auto.compiles(torch.device("cuda")) == (importlib.util.find_spec("triton") is not None)
    assert NativeRolloutConfig(compile=True).compiles(torch.device("cpu"))
    assert not NativeRolloutConfig(compile=False).compiles(torch.device("cuda"))
    with pytest.raises(ConfigError, match="compile must be a bool or 'auto'"):
        NativeRolloutConfig(compile="yes")  # type: ignore[arg-type]

