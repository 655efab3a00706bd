"""The long-tail migration simulator (``asyncflow.runtime._migration``): its modes against
each other, RLHFuse's threshold choice, the step-cost fit and the length sampler."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncflow.runtime._migration import (
    GenerationWorkload,
    Simulated,
    StepCost,
    choose_migration,
    long_tail_lengths,
    predicted_speedups,
    simulate_generation,
)
from channels import ConfigError

STEP = StepCost(base_s=0.020, per_sample_s=0.0002, prefill_per_token_s=2e-5)
TAIL = long_tail_lengths(4096, median=32, p99_ratio=8, max_len=512, seed=0)


def full_batch_cost(lengths, step=STEP, max_batch=64):
    """Seconds of decoding one sample costs, on average, in a full decode batch."""
    return float(np.mean(lengths)) * step.decode_s(max_batch) / max_batch


def tail_workload(instances=8, inference_times=1.0) -> GenerationWorkload:
    lengths = tuple(TAIL[: instances * 64])
    return GenerationWorkload(lengths=lengths, instances=instances, max_batch=64, step=STEP, prompt_tokens=128,
                    micro_batch=8, inference_s_per_sample=inference_times * full_batch_cost(lengths))


@st.composite
def workloads(draw) -> GenerationWorkload:
    step = StepCost(base_s=draw(st.floats(0, 0.1)), per_sample_s=draw(st.floats(0, 0.01)),
                    prefill_per_token_s=draw(st.floats(0, 0.001)))
    return GenerationWorkload(lengths=tuple(draw(st.lists(st.integers(1, 60), min_size=1, max_size=40))),
                    instances=draw(st.integers(1, 6)), max_batch=draw(st.integers(1, 8)), step=step,
                    inference_s_per_sample=draw(st.floats(0, 0.2)), prompt_tokens=draw(st.integers(0, 20)),
                    micro_batch=draw(st.integers(1, 5)))


def least_work_s(w: GenerationWorkload) -> float:
    """Instance-seconds no schedule can do without: every token decoded in a full
    batch (a step's base cost shared by ``max_batch`` samples), every prompt
    prefilled once, every sample's inference."""
    n = len(w.lengths)
    decode = sum(w.lengths) * (w.step.base_s / w.max_batch + w.step.per_sample_s)
    return decode + n * w.prompt_tokens * w.step.prefill_per_token_s + n * w.inference_s_per_sample


@settings(max_examples=300, deadline=None)
@given(w=workloads(), data=st.data())
def test_total_time_is_at_least_the_work_spread_over_instances(w, data):
    threshold = data.draw(st.integers(0, len(w.lengths)))
    targets = data.draw(st.integers(1, w.instances))
    bound = least_work_s(w) / w.instances
    for run in (simulate_generation(w, "batch"), simulate_generation(w, "stream"),
                simulate_generation(w, "migrate", threshold=threshold, targets=targets)):
        assert run.total_s >= bound * (1 - 1e-9)
        assert run.total_s >= run.generation_s


@settings(max_examples=300, deadline=None)
@given(w=workloads())
def test_stream_is_never_slower_than_batch_and_threshold_zero_is_stream(w):
    stream = simulate_generation(w, "stream")
    assert stream.total_s <= simulate_generation(w, "batch").total_s * (1 + 1e-9)
    assert simulate_generation(w, "migrate", threshold=0, targets=w.instances) == stream
    assert stream.migrated_at_s is None


def test_a_timeline_worked_by_hand():
    # Two instances, each with a 1-token and a 10-token sample; 1 s per decode step,
    # 2 s of inference per sample. Batch and stream: all four inferences wait for
    # the two long samples (t=10) and take two rounds: 14 s. Migrating the two
    # long samples onto one instance at t=1 (both have made 1 token) frees the
    # other: it infers the short samples at 1-5 and one long one at 10-12.
    w = GenerationWorkload(lengths=(1, 10, 1, 10), instances=2, max_batch=4, inference_s_per_sample=2.0,
                 step=StepCost(base_s=1.0, per_sample_s=0.0))
    assert simulate_generation(w, "batch") == Simulated(total_s=14.0, generation_s=10.0)
    assert simulate_generation(w, "stream").total_s == 14.0
    fused = simulate_generation(w, "migrate", threshold=2, targets=1)
    assert fused == Simulated(total_s=12.0, generation_s=10.0, migrated_at_s=1.0, migrated=1)
    assert simulate_generation(w, "migrate", threshold=2, targets=2).total_s == 14.0  # nothing freed


def test_stream_overlaps_inference_with_the_tail():
    w = tail_workload()
    batch, stream = simulate_generation(w, "batch"), simulate_generation(w, "stream")
    assert batch.generation_s == stream.generation_s
    assert stream.total_s < batch.total_s


def test_equal_lengths_gain_nothing():
    w = GenerationWorkload(lengths=(100,) * 128, instances=8, max_batch=64, step=STEP, inference_s_per_sample=0.05)
    choice = choose_migration(w)
    assert choice.threshold == 0
    assert choice.speedup == pytest.approx(1.0)


def test_long_tail_with_expensive_inference_migrates_and_beats_stream():
    choice = choose_migration(tail_workload(inference_times=4.0))
    assert choice.threshold > 0
    assert choice.predicted_s < choice.stream_s < choice.batch_s
    assert choice.speedup == pytest.approx(choice.batch_s / choice.predicted_s)


def test_cheap_inference_is_hidden_by_streaming_alone():
    # Instances finish their own samples long before the longest sample is done,
    # so streaming already overlaps all the inference; moving samples only costs.
    choice = choose_migration(tail_workload(inference_times=1.0))
    assert choice.threshold == 0
    assert choice.predicted_s == choice.stream_s


def test_choice_is_the_fastest_threshold_tried():
    w = tail_workload(inference_times=4.0)
    choice = choose_migration(w)
    n = len(w.lengths)
    thresholds = [t for t, _ in choice.tried]
    assert thresholds[0] == 0 and thresholds[1] == round(0.05 * n) and thresholds[-1] == round(0.95 * n)
    assert choice.predicted_s == min(s for _, s in choice.tried)
    assert (choice.threshold, choice.predicted_s) in choice.tried
    assert choice.targets == max(1, -(-choice.threshold // w.max_batch))
    fused = simulate_generation(w, "migrate", threshold=choice.threshold, targets=choice.targets)
    assert fused.total_s == choice.predicted_s
    assert fused.migrated_at_s is not None and 0 < fused.migrated <= choice.threshold
    assert fused.reprefill_s > 0  # moved samples had a prompt and tokens to prefill again


def test_overloading_few_targets_is_slower_than_enough_targets():
    w = tail_workload(inference_times=4.0)
    threshold = len(w.lengths) // 2
    crowded = simulate_generation(w, "migrate", threshold=threshold, targets=1)
    spread = simulate_generation(w, "migrate", threshold=threshold, targets=-(-threshold // w.max_batch))
    assert spread.total_s < crowded.total_s


def test_step_cost_fit_recovers_known_coefficients():
    rng = np.random.default_rng(0)
    points = [(b, 0.020 + 0.0003 * b + rng.normal(0, 1e-5)) for b in (1, 2, 4, 8, 16, 32, 64) for _ in range(3)]
    cost = StepCost.fit(points, prefill_per_token_s=1e-5)
    assert cost.base_s == pytest.approx(0.020, rel=1e-2)
    assert cost.per_sample_s == pytest.approx(0.0003, rel=1e-2)
    assert cost.prefill_per_token_s == 1e-5
    exact = StepCost.fit([(1, 1.5), (3, 2.5)])
    assert (exact.base_s, exact.per_sample_s) == pytest.approx((1.0, 0.5))
    with pytest.raises(ConfigError, match="points"):
        StepCost.fit([(4, 0.1), (4, 0.2)])


def test_long_tail_lengths_meet_their_p99_to_median_ratio():
    lengths = long_tail_lengths(8192, median=32, p99_ratio=8, max_len=512, seed=7)
    a = np.asarray(lengths)
    assert np.median(a) == 32
    assert np.percentile(a, 99) >= 8 * np.median(a)
    assert a.min() >= 1 and a.max() <= 512
    assert lengths == long_tail_lengths(8192, median=32, p99_ratio=8, max_len=512, seed=7)
    assert lengths != long_tail_lengths(8192, median=32, p99_ratio=8, max_len=512, seed=8)


def test_predicted_speedups_per_instance_count():
    choices = predicted_speedups(TAIL, instances=(8, 32), samples_per_instance=64, step=STEP,
                                 inference_s_per_sample=4 * full_batch_cost(TAIL), max_batch=64,
                                 prompt_tokens=128, micro_batch=8)
    assert sorted(choices) == [8, 32]
    for choice in choices.values():
        assert choice.speedup >= choice.batch_s / choice.stream_s > 1
    again = predicted_speedups(TAIL, instances=(8,), samples_per_instance=64, step=STEP,
                               inference_s_per_sample=4 * full_batch_cost(TAIL), max_batch=64,
                               prompt_tokens=128, micro_batch=8)
    assert again[8] == choices[8]


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: StepCost(base_s=-1.0, per_sample_s=0.0), "StepCost.base_s"),
        (lambda: GenerationWorkload(lengths=(), instances=1, max_batch=1, step=STEP, inference_s_per_sample=0.0),
         "GenerationWorkload.lengths"),
        (lambda: GenerationWorkload(lengths=(3, 0), instances=1, max_batch=1, step=STEP, inference_s_per_sample=0.0),
         "GenerationWorkload.lengths"),
        (lambda: GenerationWorkload(lengths=(3,), instances=0, max_batch=1, step=STEP, inference_s_per_sample=0.0),
         "GenerationWorkload.instances"),
        (lambda: simulate_generation(tail_workload(), "fused"), "mode"),  # type: ignore[arg-type]
        (lambda: simulate_generation(tail_workload(), "migrate", threshold=-1), "threshold"),
        (lambda: simulate_generation(tail_workload(), "migrate", threshold=4, targets=9), "targets"),
        (lambda: long_tail_lengths(10, median=32, p99_ratio=8, max_len=16, seed=0), "max_len"),
    ],
)
def test_bad_inputs_are_config_errors_naming_the_field(make, field):
    with pytest.raises(ConfigError, match=field):
        make()
