"""The native engine's decode step as CUDA graphs (``decode="static"`` on CUDA),
compiled or not: the same tokens and log-probs as the same step run eagerly, the
dynamic cache's (and the uncompiled step's) greedy tokens in fp32, and bf16 log-probs
as close to the bf16 training engine's as exact arithmetic gets."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from transformers import PreTrainedModel

from workers.engines import TrainingConfig, TrainingEngine
from workers.models import TinyModelConfig, build_tiny_model
from workers.rollout import NativeRolloutConfig, NativeRolloutEngine, RolloutOutput, SamplingParams
from workers.rollout._sampling import row_seed, sample_tokens, signed_seeds

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SHAPE = TinyModelConfig(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                        num_key_value_heads=2, head_dim=64, vocab_size=32000, max_position_embeddings=512)
"""A Llama with grouped-query attention and a real vocabulary (bench.generation's
``small``, with 2 KV heads)."""
ROWS = 48


def _prompts(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, 100, (ROWS,), generator=gen).tolist()
    return [[1, *torch.randint(3, 32000, (n - 1,), generator=gen).tolist()] for n in lengths]


def _budgets(seed: int) -> list[int]:
    """Budgets that end rows at many different steps: the live rows cross every bucket."""
    return torch.randint(1, 65, (ROWS,), generator=torch.Generator().manual_seed(seed)).tolist()


def _model(dtype: torch.dtype) -> PreTrainedModel:
    return build_tiny_model(SHAPE, seed=0).to(device="cuda", dtype=dtype)


def _generate(model: PreTrainedModel, params: SamplingParams, **config: object) -> RolloutOutput:
    engine = NativeRolloutEngine(model, config=NativeRolloutConfig(**config))  # type: ignore[arg-type]
    return engine.generate(_prompts(0), params, max_new_tokens=_budgets(1))


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "uncompiled"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_graph_replay_gives_the_eager_steps_tokens_and_logprobs(
    dtype: torch.dtype, temperature: float, compiled: bool
) -> None:
    model = _model(dtype)
    params = SamplingParams(max_new_tokens=64, temperature=temperature, seed=3)
    graphs = _generate(model, params, decode="static", cuda_graphs=True, compile=compiled)
    eager = _generate(model, params, decode="static", cuda_graphs=False, compile=compiled)
    assert torch.equal(graphs.response_ids, eager.response_ids)
    assert torch.equal(graphs.logprobs, eager.logprobs)
    assert graphs.response_lengths.tolist() == _budgets(1)


def test_graph_decode_gives_the_dynamic_caches_greedy_tokens_in_fp32() -> None:
    model = _model(torch.float32)
    params = SamplingParams(max_new_tokens=64, temperature=0.0)
    graphs = _generate(model, params, decode="auto")
    dynamic = _generate(model, params, decode="dynamic")
    assert torch.equal(graphs.response_ids, dynamic.response_ids)
    torch.testing.assert_close(graphs.logprobs, dynamic.logprobs, atol=1e-4, rtol=0)


def test_the_compiled_step_gives_the_uncompiled_steps_greedy_tokens_in_fp32() -> None:
    model = _model(torch.float32)
    params = SamplingParams(max_new_tokens=64, temperature=0.0)
    compiled = _generate(model, params, decode="static", compile=True)
    uncompiled = _generate(model, params, decode="static", compile=False)
    assert torch.equal(compiled.response_ids, uncompiled.response_ids)
    torch.testing.assert_close(compiled.logprobs, uncompiled.logprobs, atol=1e-4, rtol=0)


def test_sampled_bf16_logprobs_are_as_close_to_the_training_engines_as_its_own_bf16_error() -> None:
    """The bf16 trainer is itself off the exact (fp32) log-probs by its rounding: a
    graph-decoded bf16 rollout is to be no further from it than that, and nearer than
    the dynamic cache's pure-bf16 arithmetic."""
    master = build_tiny_model(SHAPE, seed=0).cuda()  # float32 master weights, bf16 compute
    training = TrainingEngine(master, config=TrainingConfig(precision="bf16"))
    rollout = copy.deepcopy(master).to(torch.bfloat16)
    params = SamplingParams(max_new_tokens=64, temperature=1.0, seed=7)
    gaps = {}
    for name, model, decode, compiled in [("graph", rollout, "static", True),
                                          ("graph uncompiled", rollout, "static", False),
                                          ("dynamic", rollout, "dynamic", False), ("fp32", master, "static", False)]:
        out = _generate(model, params, decode=decode, compile=compiled)
        batch = {f: getattr(out, f).cuda() for f in ("prompt_ids", "prompt_mask", "response_ids", "response_mask")}
        expected, _ = training.log_probs(batch)
        gap = (out.logprobs.cuda() - expected)[batch["response_mask"].bool()].abs()
        gaps[name] = float(gap.mean())
        print(f"{name} decode vs bf16 training engine: mean |gap| {gap.mean():.2e}, max {gap.max():.2e}")
    for graph in ("graph", "graph uncompiled"):
        assert gaps[graph] <= gaps["fp32"] * 1.05
        assert gaps[graph] < gaps["dynamic"]


@pytest.mark.parametrize("rows", [256, 100, 3])
def test_the_compiled_sampler_picks_the_plain_ones_tokens_at_a_real_vocabulary(
    rows: int, caplog: pytest.LogCaptureFixture
) -> None:
    """The sampler of the model's own distribution, compiled (the decode step's on
    CUDA), picks the plain one's tokens with the same log-probs, at any batch size
    (sizes dynamic), without falling back."""
    logits = torch.randn(rows, 151936, generator=torch.Generator().manual_seed(rows)).cuda() * 3
    seeds = torch.tensor(signed_seeds([row_seed(4, i) for i in range(rows)]), device="cuda")
    lengths = torch.arange(rows, device="cuda")
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=4)
    with caplog.at_level(logging.WARNING, logger="workers.rollout._compiled"):
        tokens, logprobs = sample_tokens(logits, params, seeds, lengths=lengths, compiled=True)
    expected, expected_logprobs = sample_tokens(logits, params, seeds, lengths=lengths)
    assert not caplog.records
    assert torch.equal(tokens, expected)
    torch.testing.assert_close(logprobs, expected_logprobs, atol=1e-5, rtol=0)
