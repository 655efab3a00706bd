"""Choosing the long-tail migration threshold: a simulator of one RL step's
generation and inference (RLHFuse's inter-stage fusion, §4.2 and §7.3).

The model. The actor's data-parallel ranks are ``instances``, each holding the full
weights and a contiguous, equal share of the samples (the first ranks take one more
when the count does not divide). An instance decodes with continuous batching: at
most ``max_batch`` samples in its decode batch, the others admitted as rows finish,
each paying a prefill of its tokens first. A decode step of ``b`` samples takes
``base_s + per_sample_s * b`` seconds and gives each one token; a sample of length
``L`` needs ``L`` steps. The inference roles (reference, reward, critic) share the
devices: ``inference_s_per_sample`` is their cost per sample on one instance, in
micro-batches of finished samples (in finishing order), each on whichever free
instance can start it first. An instance either generates or, once it has no
sample left to generate, runs inference. ``simulate_generation``'s modes:

- ``batch``: inference starts when the last sample of the batch is done.
- ``stream``: a micro-batch starts as soon as its samples are done.
- ``migrate``: stream, and when the samples still generating fall to ``threshold``
  or below they move onto the ``targets`` instances that hold most of them
  (RLHFuse's destination rule), freeing the others for inference. A moved sample
  is prefilled again on arrival (prompt and tokens so far); a target's own samples
  keep their cache.

Assumptions: a step's cost depends on its batch, not on sequence lengths (decode is
memory-bound); migration costs only the re-prefill (no transfer time, no weight
reload); at the trigger a decode step or prefill in flight is lost; a target's KV
memory is not modelled (``max_batch`` stands for both limits); one migration per
step, which RLHFuse found enough.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import pairwise
from typing import Literal

import numpy as np

from channels import ConfigError

Mode = Literal["batch", "stream", "migrate"]


def _check(ok: bool, field: str, value: object, want: str) -> None:
    if not ok:
        raise ConfigError(f"{field} must be {want}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class StepCost:
    """What decoding and prefilling cost on one generation instance."""

    base_s: float
    """Seconds of a decode step whatever its batch (reading the weights)."""
    per_sample_s: float
    """Seconds each sample in the decode batch adds to a step."""
    prefill_per_token_s: float = 0.0
    """Seconds of prefill per token (a prompt, or a migrated sample's prompt and tokens)."""

    def __post_init__(self) -> None:
        for name in ("base_s", "per_sample_s", "prefill_per_token_s"):
            value = getattr(self, name)
            _check(math.isfinite(value) and value >= 0, f"StepCost.{name}", value, "a finite number >= 0")

    def decode_s(self, batch: int) -> float:
        """Seconds of one decode step of ``batch`` samples."""
        return self.base_s + self.per_sample_s * batch

    @classmethod
    def fit(cls, points: Sequence[tuple[int, float]], *, prefill_per_token_s: float = 0.0) -> StepCost:
        """Least squares of measured ``(batch size, step seconds)`` points.

        A negative intercept or slope (noise) is dropped and the other refitted.
        Raises ConfigError unless the points have at least two batch sizes.
        """
        b = np.asarray([p[0] for p in points], dtype=float)
        s = np.asarray([p[1] for p in points], dtype=float)
        _check(len(np.unique(b)) >= 2, "points", points, "(batch, seconds) pairs of at least two batch sizes")
        per, base = np.polyfit(b, s, 1)
        if base < 0:
            base, per = 0.0, float(b @ s / (b @ b))
        if per < 0:
            base, per = float(s.mean()), 0.0
        return cls(base_s=float(base), per_sample_s=float(per), prefill_per_token_s=prefill_per_token_s)


@dataclass(frozen=True, kw_only=True)
class GenerationWorkload:
    """One RL step's generation and inference, as the simulator sees it."""

    lengths: tuple[int, ...]
    """Response lengths (decode steps) of the step's samples, in row order."""
    instances: int
    """Generation instances (actor data-parallel ranks), each also running inference."""
    max_batch: int
    """Most samples in one instance's decode batch."""
    step: StepCost
    """Decode and prefill costs."""
    inference_s_per_sample: float
    """Seconds of inference (every inference role together) per sample on one instance."""
    prompt_tokens: int = 0
    """Prompt length, prefilled on admission and again after a migration."""
    micro_batch: int = 1
    """Finished samples per inference call."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "lengths", tuple(self.lengths))  # a list would not hash
        _check(len(self.lengths) > 0 and all(int(n) == n >= 1 for n in self.lengths),
               "GenerationWorkload.lengths", self.lengths, "a non-empty tuple of ints >= 1")
        for name in ("instances", "max_batch", "micro_batch"):
            _check(getattr(self, name) >= 1, f"GenerationWorkload.{name}", getattr(self, name), "an int >= 1")
        _check(self.prompt_tokens >= 0, "GenerationWorkload.prompt_tokens", self.prompt_tokens, "an int >= 0")
        cost = self.inference_s_per_sample
        _check(math.isfinite(cost) and cost >= 0, "GenerationWorkload.inference_s_per_sample", cost, "a finite number >= 0")


@dataclass(frozen=True, kw_only=True)
class Simulated:
    """The simulated timeline of one step's generation and inference."""

    total_s: float
    """Until the last inference micro-batch is done (and generation, if later)."""
    generation_s: float
    """Until the last sample is generated."""
    migrated_at_s: float | None = None
    """When migration fired; None when it did not."""
    migrated: int = 0
    """Samples moved onto the targets."""
    reprefill_s: float = 0.0
    """Prefill seconds spent again on moved samples (their migration cost)."""


@dataclass(frozen=True, kw_only=True)
class MigrationChoice:
    """The threshold ``choose_migration`` picked, and what the model predicts for it."""

    threshold: int
    """Migrate when this many samples or fewer are still generating (0: never)."""
    targets: int
    """Instances that take the migrated samples."""
    predicted_s: float
    """Simulated time with this choice."""
    batch_s: float
    """Simulated time of ``batch`` mode."""
    stream_s: float
    """Simulated time of ``stream`` mode (threshold 0)."""
    speedup: float
    """``batch_s / predicted_s``."""
    tried: tuple[tuple[int, float], ...] = ()
    """Every ``(threshold, simulated seconds)`` tried, in threshold order."""


@dataclass
class _Run:
    """One instance's decoding: per sample its finish time, admission step and the
    time its prefill ended; per interval of constant batch its ``(start time, start
    step, step seconds)``."""

    finish: list[float]
    admit_step: list[int]
    prefilled_s: list[float]
    marks: list[tuple[float, int, float]]
    last_step: int

    def steps_done(self, t: float) -> int:
        """Decode steps completed by time ``t`` (a step in flight does not count)."""
        i = bisect_right([m[0] for m in self.marks], t) - 1
        if i < 0:
            return 0
        t0, s0, d = self.marks[i]
        end = self.marks[i + 1][1] if i + 1 < len(self.marks) else self.last_step
        return end if d <= 0 else min(end, s0 + int((t - t0) / d))


def _decode(remaining: Sequence[int], prefill: Sequence[int], *, in_batch: int, start_s: float,
            max_batch: int, step: StepCost) -> _Run:
    """Continuous batching on one instance: the first ``in_batch`` samples are already
    in the decode batch, the others wait in order and are prefilled on admission."""
    n = len(remaining)
    run = _Run(finish=[0.0] * n, admit_step=[0] * n, prefilled_s=[start_s] * n, marks=[], last_step=0)
    batch = [(remaining[i], i) for i in range(in_batch)]  # (step it finishes at, sample)
    heapq.heapify(batch)
    t, s, nxt = start_s, 0, in_batch
    while batch or nxt < n:
        while nxt < n and len(batch) < max_batch:
            t += prefill[nxt] * step.prefill_per_token_s
            run.admit_step[nxt], run.prefilled_s[nxt] = s, t
            heapq.heappush(batch, (s + remaining[nxt], nxt))
            nxt += 1
        d = step.decode_s(len(batch))
        run.marks.append((t, s, d))
        t += (batch[0][0] - s) * d
        s = batch[0][0]
        while batch and batch[0][0] == s:
            run.finish[heapq.heappop(batch)[1]] = t
    run.last_step = s
    return run


def _shares(w: GenerationWorkload) -> list[range]:
    q, r = divmod(len(w.lengths), w.instances)
    return [range(a, b) for a, b in pairwise(i * q + min(i, r) for i in range(w.instances + 1))]


@lru_cache(maxsize=8)
def _streamed(w: GenerationWorkload) -> list[_Run]:
    """Every instance decoding its own share from time 0 (shared by all modes)."""
    return [_decode([w.lengths[i] for i in share], [w.prompt_tokens] * len(share), in_batch=0,
                    start_s=0.0, max_batch=w.max_batch, step=w.step) for share in _shares(w)]


def _infer(ready: Sequence[float], free: list[float], w: GenerationWorkload) -> float:
    """When the last micro-batch is done: micro-batches in ``ready`` order (sorted
    finish times), each on the instance free first; ``free`` is when each can start."""
    heapq.heapify(free)
    n = len(ready)
    for k in range(0, n, w.micro_batch):
        end = min(k + w.micro_batch, n)
        start = max(heapq.heappop(free), ready[end - 1])
        heapq.heappush(free, start + (end - k) * w.inference_s_per_sample)
    return float(max(free))


def simulate_generation(w: GenerationWorkload, mode: Mode, *, threshold: int = 0, targets: int = 1) -> Simulated:
    """Simulate one step of ``w`` run in ``mode`` (see the module docstring).

    ``threshold`` and ``targets`` apply to ``migrate`` only; ``migrate`` with
    threshold 0 is ``stream``. Raises ConfigError for an unknown mode, a negative
    threshold or targets outside ``1..w.instances``.
    """
    _check(mode in ("batch", "stream", "migrate"), "mode", mode, "'batch', 'stream' or 'migrate'")
    _check(threshold >= 0, "threshold", threshold, "an int >= 0")
    _check(1 <= targets <= w.instances, "targets", targets, f"between 1 and instances ({w.instances})")
    runs = _streamed(w)
    finish = sorted(t for run in runs for t in run.finish)
    generation_s = finish[-1]
    if mode == "batch":
        return Simulated(total_s=_infer([generation_s] * len(finish), [generation_s] * w.instances, w),
                         generation_s=generation_s)
    n = len(finish)
    moment = 0.0 if threshold >= n else finish[n - threshold - 1]
    if mode == "stream" or threshold == 0 or moment >= generation_s:
        free = [max(run.finish, default=0.0) for run in runs]
        return Simulated(total_s=_infer(finish, free, w), generation_s=generation_s)
    return _migrate(w, runs, moment, targets)


def _migrate(w: GenerationWorkload, runs: list[_Run], moment: float, targets: int) -> Simulated:
    """Stream until ``moment``, then move the unfinished samples onto ``targets`` instances."""
    shares = _shares(w)
    done: list[float] = []
    left: list[list[tuple[int, int, bool]]] = []  # per instance: (remaining steps, progress, has KV)
    for run, share in zip(runs, shares, strict=True):
        steps = run.steps_done(moment)
        done += [t for t in run.finish if t <= moment]
        left.append([])
        for i, t in enumerate(run.finish):
            if t > moment:
                length = w.lengths[share[i]]
                admitted = run.prefilled_s[i] <= moment  # a prefill in flight is lost
                progress = min(length - 1, max(0, steps - run.admit_step[i])) if admitted else 0
                left[-1].append((length - progress, progress, admitted))
    chosen = sorted(range(w.instances), key=lambda i: (-len(left[i]), i))[:targets]
    sources = set(range(w.instances)) - set(chosen)
    free = [moment if left[i] else max(runs[i].finish, default=0.0) for i in range(w.instances)]
    moved = sorted((s for i in sorted(sources) for s in left[i]), reverse=True)
    # Longest first onto the target with fewest samples, so long samples spread out.
    load = [(len(left[i]), i) for i in chosen]
    inbox: dict[int, list[tuple[int, int, bool]]] = {i: [] for i in chosen}
    for sample in moved:
        count, i = heapq.heappop(load)
        inbox[i].append(sample)
        heapq.heappush(load, (count + 1, i))
    for i in chosen:
        own = [s for s in left[i] if s[2]]
        waiting = [s for s in left[i] if not s[2]] + inbox[i]
        prefill = [0] * len(own) + [w.prompt_tokens + p for _, p, _ in waiting]
        run = _decode([r for r, _, _ in own + waiting], prefill, in_batch=len(own), start_s=moment,
                      max_batch=w.max_batch, step=w.step)
        done += run.finish
        free[i] = max(run.finish, default=moment)
    reprefill = sum(w.prompt_tokens + p for _, p, kv in moved if kv) * w.step.prefill_per_token_s
    done.sort()
    return Simulated(total_s=_infer(done, free, w), generation_s=done[-1], migrated_at_s=moment,
                     migrated=len(moved), reprefill_s=reprefill)


def choose_migration(w: GenerationWorkload) -> MigrationChoice:
    """RLHFuse's choice (§4.2): simulate thresholds from 5% to 95% of the batch in
    steps of 5%, and 0 (no migration), each with ``max(1, ceil(threshold /
    max_batch))`` targets so that no target's decode batch is over-full; return the
    fastest (the smaller threshold on a tie)."""
    n = len(w.lengths)
    thresholds = sorted({0} | {max(1, round(n * p / 100)) for p in range(5, 100, 5)})
    tried = []
    for threshold in thresholds:
        targets = min(w.instances, max(1, math.ceil(threshold / w.max_batch)))
        tried.append((threshold, targets, simulate_generation(w, "migrate", threshold=threshold, targets=targets).total_s))
    threshold, targets, best = min(tried, key=lambda x: x[2])
    batch_s = simulate_generation(w, "batch").total_s
    return MigrationChoice(threshold=threshold, targets=targets, predicted_s=best, batch_s=batch_s,
                           stream_s=tried[0][2], speedup=batch_s / best,
                           tried=tuple((t, s) for t, _, s in tried))


def predicted_speedups(lengths: Sequence[int], *, instances: Sequence[int], samples_per_instance: int,
                       step: StepCost, inference_s_per_sample: float, max_batch: int, seed: int = 0,
                       prompt_tokens: int = 0, micro_batch: int = 1) -> dict[int, MigrationChoice]:
    """For each instance count, draw (with replacement, seeded) ``count *
    samples_per_instance`` lengths from the observed ``lengths`` and choose the
    migration; the choices' ``speedup`` is batch time over best fused time."""
    _check(len(lengths) > 0, "lengths", lengths, "a non-empty sequence of observed lengths")
    _check(samples_per_instance >= 1, "samples_per_instance", samples_per_instance, "an int >= 1")
    observed = np.asarray(lengths, dtype=np.int64)
    choices = {}
    for count in instances:
        _check(count >= 1, "instances", instances, "instance counts >= 1")
        drawn = np.random.default_rng(seed).choice(observed, size=count * samples_per_instance)
        w = GenerationWorkload(lengths=tuple(int(x) for x in drawn), instances=count, max_batch=max_batch, step=step,
                     inference_s_per_sample=inference_s_per_sample, prompt_tokens=prompt_tokens,
                     micro_batch=micro_batch)
        choices[count] = choose_migration(w)
    return choices


def long_tail_lengths(n: int, *, median: int, p99_ratio: float, max_len: int, seed: int) -> list[int]:
    """``n`` lognormal response lengths with the given median whose 99th percentile is
    at least ``p99_ratio * median`` (unless ``max_len`` caps it), fixed by ``seed``.

    The draw is scaled so that its own median and 99th percentile land where asked
    (with a margin for rounding to whole tokens), not only the distribution's.
    """
    _check(n >= 2, "n", n, "an int >= 2")
    _check(median >= 1, "median", median, "an int >= 1")
    _check(p99_ratio >= 1, "p99_ratio", p99_ratio, "a number >= 1")
    _check(max_len >= median, "max_len", max_len, f"an int >= median ({median})")
    z = np.random.default_rng(seed).standard_normal(n)
    spread = float(np.percentile(z, 99) - np.median(z))
    goal = p99_ratio * (median + 1) + 1  # a token's rounding at either end
    sigma = math.log(goal / median) / spread if spread > 0 else 0.0
    lengths = np.rint(median * np.exp(sigma * (z - np.median(z))))
    return [int(x) for x in np.clip(lengths, 1, max_len)]
