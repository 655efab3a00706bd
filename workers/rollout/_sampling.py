"""Token sampling of the native engine, with one counter-based random stream per sample.

Sample ``i`` of a request has a 64-bit row seed derived from ``(seed, i)``
(:func:`row_seed`). The uniform it draws its response token ``k`` with is the
``k``-th output of a SplitMix64 generator seeded with its row seed, a pure function
of ``(row seed, k)`` that :func:`sample_tokens` computes for every row of a step at
once; each row then picks its token by inverse-CDF sampling. So a sample's tokens
depend neither on the batch size nor on which samples share a step, and its whole
stream is its row seed: a migrated sample carries those 8 bytes
(:func:`pack_row_seed`, :func:`unpack_row_seed`) and continues the same stream on
another engine, on any kind of device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from channels import ConfigError

from ._compiled import Compiled
from ._types import SamplingParams

__all__ = [
    "pack_row_seed", "row_seed", "sample_tokens", "signed_seeds", "splitmix64", "stream_uniforms", "uniform_dtype",
    "unpack_row_seed",
]

_MASK64 = (1 << 64) - 1
_ROW_SEED_BYTES = 8


def row_seed(seed: int, index: int, *, skip: int = 0) -> int:
    """The row seed (in ``[0, 2**64)``) of sample ``index`` in a request seeded with ``seed``.

    Args:
        seed: The request's seed.
        index: The caller's id of the sample.
        skip: Tokens the sample already holds when it has no carried row seed (a
            sample migrated from an engine that cannot export its stream); non-zero
            values give a fresh stream rather than replaying the first draws.
    """
    entropy = [seed & _MASK64, index & _MASK64] + ([skip] if skip else [])
    return int(np.random.SeedSequence(entropy).generate_state(1, np.uint64)[0])


def pack_row_seed(seed: int) -> bytes:
    """A row seed as the bytes of :attr:`~._types.PartialSample.rng_state`."""
    return seed.to_bytes(_ROW_SEED_BYTES, "little")


def unpack_row_seed(state: bytes, *, index: int) -> int:
    """The row seed that :func:`pack_row_seed` packed into ``state``.

    Raises:
        ConfigError: If ``state`` is not 8 bytes long (it names sample ``index``).
    """
    if len(state) != _ROW_SEED_BYTES:
        raise ConfigError(
            f"PartialSample index={index} carries an rng_state of {len(state)} bytes, not "
            f"the {_ROW_SEED_BYTES}-byte row seed a native engine exports; export it from "
            f"a native engine, or set rng_state=None to re-seed it"
        )
    return int.from_bytes(state, "little")


# SplitMix64's constants as the int64 values of their bits.
_GAMMA = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's ``>>`` is arithmetic on int64)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def splitmix64(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Output ``positions`` (0-based) of SplitMix64 generators seeded with ``seeds``.

    Args:
        seeds: int64 tensor of 64-bit seeds (unsigned values as their int64 bits).
        positions: int64 tensor, broadcastable with ``seeds``.

    Returns:
        The outputs' 64 bits as int64 (multiplication and addition wrap).
    """
    z = seeds + (positions + 1) * _GAMMA
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    return z ^ _shift_right(z, 31)


def _uniforms(
    seeds: Sequence[int | None] | torch.Tensor,
    lengths: Sequence[int] | torch.Tensor,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """Each row's uniform in ``[0, 1)`` for its token at position ``lengths[row]``."""
    if not isinstance(seeds, torch.Tensor):
        if any(seed is None for seed in seeds):
            raise ValueError("sampling needs every row's row seed (None is for greedy only)")
        seeds = torch.tensor(signed_seeds([s for s in seeds if s is not None]), dtype=torch.int64, device=device)
    if not isinstance(lengths, torch.Tensor):
        lengths = torch.tensor(list(lengths), dtype=torch.int64, device=device)
    return stream_uniforms(seeds, lengths, dtype)


def stream_uniforms(seeds: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The uniforms in ``[0, 1)`` that streams ``seeds`` (int64, :func:`signed_seeds`)
    draw their tokens at ``positions`` with (broadcast together), in ``dtype``
    (:func:`uniform_dtype`): what :func:`sample_tokens` computes from its ``seeds``
    and ``lengths``, and takes ready-made as ``uniforms``."""
    bits = splitmix64(seeds, positions)
    mantissa = 53 if dtype == torch.float64 else 24  # the bits a float in [0, 1) holds
    return _shift_right(bits, 64 - mantissa).to(dtype) * 2.0**-mantissa


def uniform_dtype(device: torch.device) -> torch.dtype:
    """The dtype the CDFs are taken in on ``device``: float64 where it has them (MPS has not)."""
    return torch.float32 if device.type == "mps" else torch.float64


def signed_seeds(seeds: Sequence[int]) -> list[int]:
    """Row seeds (in ``[0, 2**64)``) as the int64 values of their bits, for a tensor."""
    return [seed - (1 << 64) if seed >= 1 << 63 else seed for seed in seeds]


@torch.no_grad()
def sample_tokens(
    logits: torch.Tensor,
    params: SamplingParams,
    seeds: Sequence[int | None] | torch.Tensor | None,
    *,
    lengths: Sequence[int] | torch.Tensor,
    early_banned: tuple[int, ...] = (),
    compiled: bool = False,
    uniforms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row; return it and its raw log-prob (temperature 1, unfiltered).

    Row ``r`` samples by inverse CDF with the uniform of its stream at position
    ``lengths[r]`` (see the module docstring), so its token does not depend on the
    other rows. Tokens of probability 0 (after top-k and top-p) are never picked.

    Args:
        logits: [rows, vocab] next-token logits.
        params: How to sample.
        seeds: Each row's row seed (:func:`row_seed`; None when greedy), or an int64
            tensor of them (:func:`signed_seeds`) on ``logits``' device; None with
            ``uniforms`` or greedy.
        lengths: Each row's response length before this token (its stream position),
            or an int64 tensor of them on ``logits``' device: then nothing waits for
            the device (no value is read back), which a CUDA graph's step needs.
        early_banned: Token ids that rows shorter than ``params.min_new_tokens``
            cannot sample (EOS ids). The log-probs stay those of the unmasked
            logits, as vLLM's raw log-probs are taken before its logits processors.
        compiled: Sample from the model's own distribution (temperature 1, neither
            top-k nor top-p) with that path compiled by ``torch.compile``
            (:func:`_sample_raw`; on its first call, and uncompiled if that fails).
        uniforms: Each row's uniform for this token, already drawn from its stream
            (:func:`stream_uniforms` at ``lengths``, in :func:`uniform_dtype`), for a
            caller that drew a row's whole stream at once; ``seeds`` are then not read.
    """
    raw = logits
    if params.min_new_tokens and early_banned:
        logits = _ban_early(logits, params.min_new_tokens, early_banned, lengths)
    if params.greedy:
        tokens = logits.argmax(dim=-1)
        normaliser = torch.logsumexp(raw, dim=-1)
    else:
        if uniforms is None:
            if seeds is None:
                raise ValueError("sampling needs each row's row seed, or its uniform")
            uniforms = _uniforms(seeds, lengths, uniform_dtype(logits.device), logits.device)
        if logits is raw and _samples_raw(params, raw.shape[-1]):
            sample_raw = _COMPILED_SAMPLE_RAW if compiled else _sample_raw
            return sample_raw(raw, uniforms)  # type: ignore[no-any-return]
        tokens = _inverse_cdf(_filtered_probs(logits, params), uniforms)
        normaliser = torch.logsumexp(raw, dim=-1)
    # log_softmax at the picked tokens only (no [rows, vocab] tensor of log-probs).
    return tokens, raw.gather(-1, tokens[:, None]).squeeze(-1) - normaliser


def _sample_raw(raw: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sample_tokens` from the model's own distribution, ``softmax(raw)``.

    The unnormalised weights ``exp(raw - max)`` pick the token (:func:`_pick`) and
    their total is the log-probs' normaliser, so no softmax is taken. The weights
    are only summed per chunk, and the picked chunk's computed again from ``raw``:
    compiled, the maximum and the chunk sums are two reads of the logits, and no
    ``[rows, vocab]`` tensor is written (but for a vocabulary of one chunk, whose
    running total is taken from the weights)."""
    peak = raw.amax(dim=-1, keepdim=True)

    def weights_at(columns: torch.Tensor) -> torch.Tensor:
        return (raw.gather(-1, columns) - peak).exp()

    weights = (raw - peak).exp_()  # only summed: compiled, never written
    tokens, total = _pick(_chunk_sums(weights, uniforms.dtype), uniforms, weights, weights_at=weights_at)
    normaliser = peak.squeeze(-1) + total.log().to(raw.dtype)
    return tokens, raw.gather(-1, tokens[:, None]).squeeze(-1) - normaliser


_COMPILED_SAMPLE_RAW = Compiled(_sample_raw, "the sampler of the model's own distribution")


def _samples_raw(params: SamplingParams, vocab: int) -> bool:
    """Whether ``params`` sample from the model's own distribution (temperature 1,
    neither top-k nor top-p)."""
    return params.temperature == 1.0 and not 0 < params.top_k < vocab and params.top_p >= 1.0


def _ban_early(
    logits: torch.Tensor, min_new_tokens: int, banned: tuple[int, ...], lengths: Sequence[int] | torch.Tensor
) -> torch.Tensor:
    """``logits`` with ``banned`` masked out of the rows shorter than ``min_new_tokens``
    (a copy when any is). Lengths on the host are looked at there; a tensor of them is
    applied without reading it back."""
    columns = torch.tensor(banned, device=logits.device)
    if isinstance(lengths, torch.Tensor):
        logits = logits.clone()
        logits[:, columns] = logits[:, columns].masked_fill((lengths < min_new_tokens)[:, None], float("-inf"))
        return logits
    short = [row for row, n in enumerate(lengths) if n < min_new_tokens]
    if not short:
        return logits
    logits = logits.clone()
    logits[torch.tensor(short, device=logits.device)[:, None], columns] = float("-inf")
    return logits


_CHUNK = 256
"""Tokens per chunk of the two-level inverse CDF (:func:`_inverse_cdf`)."""


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Row ``r``'s token for ``uniforms[r]`` in ``[0, 1)``: the first whose CDF over
    ``probs`` ``[rows, vocab]`` exceeds it (:func:`_pick`)."""
    return _pick(_chunk_sums(probs, uniforms.dtype), uniforms, probs)[0]


def _pick(
    chunk_sums: torch.Tensor, uniforms: torch.Tensor, weights: torch.Tensor, *,
    weights_at: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row ``r``'s token for ``uniforms[r]`` in ``[0, 1)``: the first whose CDF exceeds
    it; and each row's total weight (in the uniforms' dtype).

    The CDF is taken in two levels, in the uniforms' dtype: the weights' sums over
    chunks of :data:`_CHUNK` tokens (``chunk_sums`` ``[rows, chunks]``,
    :func:`_chunk_sums` of ``weights`` ``[rows, vocab]``) and their running total
    pick the chunk the target falls in, and that chunk's own running total picks the
    token (``weights_at(columns)``: the weights at ``columns`` ``[rows, _CHUNK]``, all
    below ``vocab``; by default gathered from ``weights``), so no cumulative sum over
    the whole vocabulary is written. A vocabulary of one chunk skips the chunk
    level and takes the running total of ``weights`` itself. Weights need not sum
    to 1 (the target is scaled by their total). A token of weight 0 does not raise
    a running total, so it is never the first to exceed the target; where rounding
    puts the target at or past a total, the pick is the last token that raised it.
    """
    dtype, vocab = uniforms.dtype, weights.shape[-1]
    if vocab <= _CHUNK:  # one chunk: its running total is the CDF
        targets = uniforms[:, None] * chunk_sums
        return _first_above(weights.to(dtype).cumsum(dim=-1), targets).squeeze(-1), chunk_sums[:, 0]
    chunk_cdf = chunk_sums.cumsum(dim=-1)  # [rows, chunks]
    targets = uniforms[:, None] * chunk_cdf[:, -1:]
    chunk = _first_above(chunk_cdf, targets)  # [rows, 1]
    before = torch.where(chunk > 0, chunk_cdf.gather(-1, (chunk - 1).clamp(min=0)), 0.0)
    columns = chunk * _CHUNK + torch.arange(_CHUNK, device=chunk.device)
    at = (lambda c: weights.gather(-1, c)) if weights_at is None else weights_at
    inside = at(columns.clamp(max=vocab - 1)).to(dtype).masked_fill(columns >= vocab, 0.0)
    # The chunk's own running total from 0, so its small weights are not lost
    # against a large total before it.
    token = _first_above(inside.cumsum(dim=-1), targets - before)
    return (chunk * _CHUNK + token).squeeze(-1), chunk_cdf[:, -1]


def _chunk_sums(weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Each row's weight per chunk of :data:`_CHUNK` tokens (the last chunk may be
    shorter), summed in ``dtype``."""
    rows, vocab = weights.shape
    if vocab <= _CHUNK:
        return weights.sum(dim=-1, keepdim=True, dtype=dtype)
    whole = vocab // _CHUNK * _CHUNK
    sums = weights[:, :whole].reshape(rows, -1, _CHUNK).sum(dim=-1, dtype=dtype)
    if whole == vocab:
        return sums
    return torch.cat([sums, weights[:, whole:].sum(dim=-1, keepdim=True, dtype=dtype)], dim=-1)


def _first_above(cdf: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per row, the first index whose running total ``cdf`` exceeds ``targets`` ``[rows, 1]``,
    at most the last index that raised the total (where rounding leaves none above)."""
    first = torch.searchsorted(cdf, targets, right=True)
    last = torch.searchsorted(cdf, cdf[:, -1:].contiguous(), right=False)
    return torch.minimum(first, last)


def _filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Sampling distribution after temperature, then top-k, then top-p."""
    scores = logits / params.temperature if params.temperature != 1.0 else logits
    if 0 < params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Drop a token once the more likely ones already reach top_p; the first stays.
        drop_sorted = sorted_probs.cumsum(dim=-1) - sorted_probs >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs
