"""The native engine's token sampling (:mod:`workers.rollout._sampling`): counter-based
per-sample streams, their statistics, top-k/top-p exclusion, batch independence,
determinism and the row seeds that migrated samples carry."""

from __future__ import annotations

import logging

import pytest
import torch

from channels import ConfigError
from workers.rollout import SamplingParams
from workers.rollout._sampling import (
    _inverse_cdf,
    _uniforms,
    pack_row_seed,
    row_seed,
    sample_tokens,
    signed_seeds,
    splitmix64,
    unpack_row_seed,
)

torch.set_num_threads(1)

ROWS, POSITIONS = 1000, 40
"""40k draws per distribution: a frequency's standard error is at most 0.0025."""

SAMPLED = SamplingParams(max_new_tokens=POSITIONS, temperature=1.0, seed=0)


def _reference_splitmix64(seed: int, count: int) -> list[int]:
    """The first ``count`` outputs of SplitMix64 (Steele et al.) in plain Python."""
    mask, state, out = (1 << 64) - 1, seed, []
    for _ in range(count):
        state = (state + 0x9E3779B97F4A7C15) & mask
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        out.append(z ^ (z >> 31))
    return out


def _frequencies(logits: torch.Tensor, params: SamplingParams, seed: int = 0) -> torch.Tensor:
    """Token frequencies of ``ROWS`` rows (own row seeds) times ``POSITIONS`` positions,
    every row sampling from the same ``logits`` ([vocab])."""
    seeds = [row_seed(seed, i) for i in range(ROWS)]
    batch = logits.expand(ROWS, -1)
    counts = torch.zeros(logits.shape[-1], dtype=torch.float64)
    for position in range(POSITIONS):
        tokens, _ = sample_tokens(batch, params, seeds, lengths=[position] * ROWS)
        counts += torch.bincount(tokens, minlength=logits.shape[-1])
    return counts / counts.sum()


def test_splitmix64_matches_the_reference_generator() -> None:
    seeds = [0, 1, 2**63 - 1, 2**63, 2**64 - 1, row_seed(5, 3)]
    signed = torch.tensor([s - 2**64 if s >= 2**63 else s for s in seeds], dtype=torch.int64)
    bits = splitmix64(signed[:, None], torch.arange(50)[None, :])
    got = [[b % 2**64 for b in row] for row in bits.tolist()]
    assert got == [_reference_splitmix64(seed, 50) for seed in seeds]


def test_uniforms_are_the_top_bits_of_the_stream_in_float64_and_float32() -> None:
    seeds = [row_seed(1, i) for i in range(200)]
    lengths = [i % 7 for i in range(200)]
    u64 = _uniforms(seeds, lengths, torch.float64, torch.device("cpu"))
    u32 = _uniforms(seeds, lengths, torch.float32, torch.device("cpu"))
    assert u64.dtype == torch.float64 and u32.dtype == torch.float32
    assert bool(((u64 >= 0) & (u64 < 1)).all()) and bool(((u32 >= 0) & (u32 < 1)).all())
    assert bool((u64 - u32.double()).abs().max() < 2**-24)
    expected = [_reference_splitmix64(s, n + 1)[n] >> 11 for s, n in zip(seeds, lengths, strict=True)]
    assert (u64 * 2**53).long().tolist() == expected


def test_sampled_frequencies_match_the_distribution() -> None:
    probs = torch.tensor([0.05, 0.3, 0.0, 0.15, 0.02, 0.28, 0.2, 0.0])
    freqs = _frequencies(probs.log(), SAMPLED)
    assert float((freqs - probs.double()).abs().max()) < 0.01
    assert freqs[2] == 0 and freqs[7] == 0


def test_temperature_reshapes_the_sampled_distribution() -> None:
    logits = torch.tensor([0.0, 1.0, 2.0, -1.0])
    params = SamplingParams(max_new_tokens=POSITIONS, temperature=0.5, seed=0)
    freqs = _frequencies(logits, params)
    assert float((freqs - torch.softmax(logits.double() / 0.5, -1)).abs().max()) < 0.01


def test_top_k_and_top_p_excluded_tokens_never_appear() -> None:
    probs = torch.tensor([0.1, 0.4, 0.05, 0.25, 0.15, 0.05])
    top_k = SamplingParams(max_new_tokens=POSITIONS, temperature=1.0, top_k=3, seed=0)
    freqs = _frequencies(probs.log(), top_k)
    kept = torch.tensor([0.0, 0.4, 0.0, 0.25, 0.15, 0.0]) / 0.8
    assert bool((freqs[kept == 0] == 0).all())
    assert float((freqs - kept.double()).abs().max()) < 0.01
    # Sorted: 0.4, 0.25 (reach 0.65 >= 0.6), so 0.15 and the rest are dropped.
    top_p = SamplingParams(max_new_tokens=POSITIONS, temperature=1.0, top_p=0.6, seed=0)
    freqs = _frequencies(probs.log(), top_p)
    kept = torch.tensor([0.0, 0.4, 0.0, 0.25, 0.0, 0.0]) / 0.65
    assert bool((freqs[kept == 0] == 0).all())
    assert float((freqs - kept.double()).abs().max()) < 0.01


def test_extreme_uniforms_never_pick_zero_probability_tokens() -> None:
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0, 0.0]] * 4 + [[1e-30, 0.0, 1.0, 0.0, 0.0, 0.0]])
    top = 1 - 2**-53
    uniforms = torch.tensor([0.0, top, 0.5 - 2**-53, 0.5, top], dtype=torch.float64)
    assert _inverse_cdf(probs, uniforms).tolist() == [1, 3, 1, 3, 2]
    # Probabilities summing to a little less than 1 (float32 rounding) still cover [0, 1).
    short = torch.tensor([[0.25, 0.25, 0.4999, 0.0]])
    assert _inverse_cdf(short, torch.tensor([top], dtype=torch.float64)).tolist() == [2]
    # A target at the very total (the guard against rounding) picks the last non-zero token.
    assert _inverse_cdf(probs[:1], torch.tensor([1.0], dtype=torch.float64)).tolist() == [3]


def test_a_row_samples_the_same_tokens_alone_or_in_any_batch() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 32, generator=generator)
    seeds = [row_seed(3, i) for i in range(16)]
    params = SamplingParams(max_new_tokens=POSITIONS, temperature=1.0, top_p=0.9, seed=3)
    for position in range(20):
        lengths = [position + i % 3 for i in range(16)]
        batch, batch_logprobs = sample_tokens(logits, params, seeds, lengths=lengths)
        order = torch.randperm(16, generator=generator).tolist()
        shuffled, _ = sample_tokens(
            logits[order], params, [seeds[i] for i in order], lengths=[lengths[i] for i in order]
        )
        assert shuffled.tolist() == [batch[i] for i in order]
        for i in (0, 7, 15):
            alone, alone_logprob = sample_tokens(
                logits[i : i + 1], params, seeds[i : i + 1], lengths=lengths[i : i + 1]
            )
            assert alone.tolist() == [batch[i]]
            torch.testing.assert_close(alone_logprob, batch_logprobs[i : i + 1])


def test_the_same_seed_gives_the_same_tokens_and_other_seeds_others() -> None:
    logits = torch.zeros(8, 50)

    def draw(seed: int) -> list[list[int]]:
        seeds = [row_seed(seed, i) for i in range(8)]
        return [sample_tokens(logits, SAMPLED, seeds, lengths=[k] * 8)[0].tolist() for k in range(10)]

    assert draw(1) == draw(1)
    assert draw(1) != draw(2)
    rows = list(zip(*draw(1), strict=True))
    assert len(set(rows)) == 8  # each row its own stream


def test_row_seeds_pack_into_rng_state_bytes() -> None:
    assert row_seed(7, 2) == row_seed(7, 2)
    assert len({row_seed(7, 2), row_seed(7, 3), row_seed(8, 2), row_seed(7, 2, skip=4)}) == 4
    for seed in (0, 2**63, 2**64 - 1, row_seed(7, 2)):
        state = pack_row_seed(seed)
        assert len(state) == 8 and unpack_row_seed(state, index=0) == seed
    with pytest.raises(ConfigError, match=r"index=5 carries an rng_state of 3 bytes"):
        unpack_row_seed(b"abc", index=5)


def test_sampling_without_row_seeds_is_refused_and_greedy_needs_none() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0]])
    with pytest.raises(ValueError, match="row seed"):
        sample_tokens(logits, SAMPLED, [None], lengths=[0])
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0)
    tokens, logprobs = sample_tokens(logits, greedy, [None], lengths=[0])
    assert tokens.tolist() == [1]
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1)[:, 1])



def test_the_last_token_of_non_zero_probability_bounds_every_pick() -> None:
    probs = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0], [0.2, 0.0, 0.8, 0.0]])
    near_one = torch.full((3,), 1.0 - 2**-53, dtype=torch.float64)
    assert _inverse_cdf(probs, near_one).tolist() == [1, 3, 2]


@pytest.mark.parametrize("vocab", [7, 256, 1000, 4096])
def test_the_two_level_cdf_picks_what_one_cumulative_sum_over_the_vocabulary_picks(vocab: int) -> None:
    generator = torch.Generator().manual_seed(vocab)
    probs = torch.softmax(torch.randn(300, vocab, generator=generator) * 4, dim=-1)
    probs[:100] = probs[:100].masked_fill(torch.rand(100, vocab, generator=generator) < 0.7, 0.0)
    probs[:100, 0] += 1e-3  # no row without mass
    uniforms = torch.rand(300, generator=generator, dtype=torch.float64)
    cdf = probs.double().cumsum(dim=-1)
    expected = torch.searchsorted(cdf, uniforms[:, None] * cdf[:, -1:], right=True).squeeze(-1)
    assert _inverse_cdf(probs, uniforms).tolist() == expected.tolist()



def test_sampling_the_models_own_distribution_picks_what_the_filtered_path_picks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At temperature 1 without top-k/p the sampler skips the softmax (unnormalised
    weights pick the token, their total gives the log-probs' normaliser): the same
    tokens, and log-probs within float rounding, as the general path."""
    from workers.rollout import _sampling

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 3000, generator=generator) * 4
    seeds = [row_seed(9, i) for i in range(64)]
    params = SamplingParams(max_new_tokens=POSITIONS, temperature=1.0, seed=9)
    fast = [sample_tokens(logits, params, seeds, lengths=[k] * 64) for k in range(10)]
    monkeypatch.setattr(_sampling, "_samples_raw", lambda *_: False)
    general = [sample_tokens(logits, params, seeds, lengths=[k] * 64) for k in range(10)]
    for (tokens, logprobs), (expected, expected_logprobs) in zip(fast, general, strict=True):
        assert tokens.tolist() == expected.tolist()
        torch.testing.assert_close(logprobs, expected_logprobs, atol=1e-5, rtol=0)
        torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0])


def test_the_compiled_sampler_falls_back_to_the_plain_one_after_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``compiled=True`` goes through ``torch.compile`` (really compiled on CUDA:
    test_graph_decode_on_cuda.py); a compiler that fails leaves the same tokens and
    log-probs, after one warning."""
    from workers.rollout import _compiled, _sampling

    calls = []

    def broken(fn: object, **options: object) -> object:
        calls.append(fn)

        def fail(*args: object) -> torch.Tensor:
            raise RuntimeError("no compiler here")

        return fail

    monkeypatch.setattr(torch, "compile", broken)
    monkeypatch.setattr(_sampling, "_COMPILED_SAMPLE_RAW", _compiled.Compiled(_sampling._sample_raw, "the sampler"))
    logits = torch.randn(32, 1000, generator=torch.Generator().manual_seed(0)) * 4
    seeds, lengths = torch.tensor(signed_seeds([row_seed(3, i) for i in range(32)])), torch.arange(32)
    with caplog.at_level(logging.WARNING, logger="workers.rollout._compiled"):
        for _ in range(2):
            got = sample_tokens(logits, SAMPLED, seeds, lengths=lengths, compiled=True)
            expected = sample_tokens(logits, SAMPLED, seeds, lengths=lengths)
            assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert calls == [_sampling._sample_raw]
    assert [r.getMessage() for r in caplog.records] == [
        "native rollout: compiling the sampler failed (RuntimeError: no compiler here); it runs uncompiled"
    ]
