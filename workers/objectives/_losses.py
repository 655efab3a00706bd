"""Loss functions and estimators for RLHF training, as pure vectorised tensor functions.

Every function here takes padded ``[B, R]`` tensors over the response tokens and a
``mask`` (1 on real response tokens, 0 on padding) and never loops over tokens. They
hold no state and know nothing about parallelism, so the training engine, the
algorithms and the tests all call the same code.

Here: masked reductions, log-probs and entropy from logits, KL estimators, and
:class:`LossAggregation`. The per-token policy and value losses
(:mod:`workers.objectives._policy_losses`) return their unreduced terms; how the terms
become one scalar is a :class:`LossAggregation`, kept separate so that the engine can
split a batch into micro-batches and data-parallel shards and still reduce exactly as
one full-batch step would.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Mapping

import torch
from torch import Tensor

_LOG_RATIO_LIMIT = 20.0
"""Log-ratios are clamped to this magnitude before ``exp`` so that a stale sample cannot
overflow to ``inf`` (e^20 is far beyond any clip range)."""


# --------------------------------------------------------------------------- masked ops


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``values`` where ``mask`` is non-zero.

    Args:
        values: any shape.
        mask: broadcastable to ``values``; 1 keeps an entry, 0 drops it.
        dim: dimension to reduce; ``None`` reduces everything.

    Returns:
        The masked sum (a scalar when ``dim`` is None).
    """
    prod = values * mask
    return prod.sum() if dim is None else prod.sum(dim=dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``values`` over the entries where ``mask`` is non-zero.

    Args:
        values: any shape.
        mask: broadcastable to ``values``.
        dim: dimension to reduce; ``None`` reduces everything.

    Returns:
        The masked mean; 0 where the mask selects nothing.
    """
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_var(values: Tensor, mask: Tensor, *, unbiased: bool = True) -> Tensor:
    """Variance of the masked entries of ``values`` (a scalar).

    Args:
        values: any shape.
        mask: broadcastable to ``values``.
        unbiased: apply Bessel's correction (n / (n - 1)).

    Returns:
        The masked variance; 0 when fewer than two entries are selected.
    """
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = mask.sum()
        var = torch.where(count > 1, var * count / (count - 1).clamp(min=1), torch.zeros_like(var))
    return var


def masked_whiten(
    values: Tensor,
    mask: Tensor,
    *,
    shift_mean: bool = True,
    eps: float = 1e-8,
    sum_over_ranks: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """Normalise the masked entries of ``values`` to zero mean and unit variance.

    The mean and the (unbiased) variance are those of every selected entry of the
    whole batch: with ``sum_over_ranks`` this rank's rows are one share of a batch
    spread over ranks, and the statistics are computed from sums over all shares
    (two reductions: count and sum, then the squared deviations), so the result
    does not depend on how the rows are spread. Sums are taken in float64.

    Args:
        values: any shape, e.g. advantages ``[B, R]`` (``B`` may be 0).
        mask: broadcastable to ``values``.
        shift_mean: when False the mean is added back (only the scale changes).
        eps: added to the variance before the square root.
        sum_over_ranks: adds a float64 tensor of partial sums over the ranks that
            hold the batch's other rows (e.g. :func:`workers.roles.sum_over_call_rows`);
            None: these rows are the whole batch.

    Returns:
        Whitened values (``values``' dtype), 0 at masked-out entries.
    """
    total = sum_over_ranks if sum_over_ranks is not None else _identity
    keep = torch.broadcast_to(mask, values.shape).bool()
    wide = torch.where(keep, values.to(torch.float64), 0.0)
    count, summed = total(torch.stack([keep.sum().to(torch.float64), wide.sum()])).unbind()
    mean = summed / count.clamp(min=1)
    deviations = torch.where(keep, wide - mean, 0.0)
    squares = total(deviations.pow(2).sum().reshape(1))[0]
    var = torch.where(count > 1, squares / (count - 1).clamp(min=1), torch.zeros_like(squares))
    whitened = deviations * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return (whitened * keep).to(values.dtype)


def _identity(tensor: Tensor) -> Tensor:
    return tensor


# ------------------------------------------------------------------ log-probs, entropy


def _scaled_chunks(
    logits: Tensor, labels: Tensor, temperature: float, chunk_size: int | None
) -> Iterator[tuple[Tensor, Tensor]]:
    """``logits / temperature`` as float32 chunks of rows ``[n, V]`` (the leading dims
    flattened; ``chunk_size`` rows each, None or 0 for one chunk), with their labels ``[n]``."""
    vocab = logits.shape[-1]
    flat_logits, flat_labels = logits.reshape(-1, vocab), labels.reshape(-1)
    rows = flat_labels.shape[0]
    size = rows if not chunk_size or chunk_size <= 0 else chunk_size
    for lo in range(0, max(rows, 1), max(size, 1)):
        chunk = flat_logits[lo : lo + size].float()
        yield (chunk / temperature if temperature != 1.0 else chunk), flat_labels[lo : lo + size]


def logprobs_from_logits(
    logits: Tensor, labels: Tensor, *, temperature: float = 1.0, chunk_size: int | None = 1024
) -> Tensor:
    """Log-probabilities of ``labels`` under ``softmax(logits / temperature)``.

    Computed as ``logit[label] - logsumexp(logits)`` over chunks of rows, so the full
    ``[N, V]`` log-softmax is never materialised and only one chunk at a time is
    upcast to float32 (under autograd each chunk's float copy is kept for backward).

    Args:
        logits: ``[..., V]`` in any float dtype.
        labels: ``[...]`` integer token ids, the shape of ``logits`` without ``V``.
        temperature: divides the logits; 1.0 is the rollout engines' convention.
        chunk_size: rows (flattened leading dims) per chunk; None or 0 for one chunk.

    Returns:
        float32 ``[...]`` log-probabilities.
    """
    parts = [chunk.gather(-1, picked[:, None]).squeeze(-1) - torch.logsumexp(chunk, dim=-1)
             for chunk, picked in _scaled_chunks(logits, labels, temperature, chunk_size)]
    return torch.cat(parts).reshape(labels.shape)


def logprobs_and_entropy_from_logits(
    logits: Tensor, labels: Tensor, *, temperature: float = 1.0, chunk_size: int | None = 1024,
    entropy_grad: bool = True,
) -> tuple[Tensor, Tensor]:
    """Log-probabilities of ``labels`` (as :func:`logprobs_from_logits`) and the entropy
    of ``softmax(logits / temperature)`` at every position, in one pass per chunk.

    Each chunk of rows is upcast once and its ``logsumexp`` taken once for both: the
    entropy is ``lse - sum(p * z)`` with ``p = exp(z - lse)``.

    Args:
        logits: ``[..., V]`` in any float dtype.
        labels: ``[...]`` integer token ids, the shape of ``logits`` without ``V``.
        temperature: divides the logits.
        chunk_size: rows (flattened leading dims) per chunk; None or 0 for one chunk.
        entropy_grad: keep the entropy's autograd graph (an entropy bonus needs it);
            False computes it from detached logits.

    Returns:
        float32 ``[...]`` log-probabilities and float32 ``[...]`` entropies in nats.
    """
    logprobs, entropies = [], []
    for chunk, picked in _scaled_chunks(logits, labels, temperature, chunk_size):
        lse = torch.logsumexp(chunk, dim=-1)
        logprobs.append(chunk.gather(-1, picked[:, None]).squeeze(-1) - lse)
        z, z_lse = (chunk, lse) if entropy_grad else (chunk.detach(), lse.detach())
        entropies.append(z_lse - ((z - z_lse[:, None]).exp() * z).sum(dim=-1))
    return torch.cat(logprobs).reshape(labels.shape), torch.cat(entropies).reshape(labels.shape)


# -------------------------------------------------------------------- KL estimators


def kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k1 estimator of KL(pi || ref) per token: ``log pi - log ref`` (unbiased, high variance).

    Args:
        logprobs: log-probs of the sampled tokens under the policy (samples drawn from it).
        ref_logprobs: log-probs of the same tokens under the reference model.

    Returns:
        Per-token estimates, same shape as the inputs.
    """
    return logprobs - ref_logprobs


def kl_k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k2 estimator: ``0.5 * (log ref - log pi)^2`` (biased, low variance, always >= 0).

    Args:
        logprobs: policy log-probs of the sampled tokens.
        ref_logprobs: reference log-probs of the same tokens.

    Returns:
        Per-token estimates.
    """
    return 0.5 * (ref_logprobs - logprobs) ** 2


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k3 estimator: ``r - 1 - log r`` with ``r = ref / pi`` (unbiased, low variance, >= 0).

    The log-ratio is clamped to +-20 before ``exp`` to keep it finite.

    Args:
        logprobs: policy log-probs of the sampled tokens.
        ref_logprobs: reference log-probs of the same tokens.

    Returns:
        Per-token estimates.
    """
    log_ratio = (ref_logprobs - logprobs).clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
    return torch.exp(log_ratio) - 1.0 - log_ratio


def rollout_consistency_terms(logprobs: Tensor, batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Per-token comparisons of the training engine's log-probs of the sampled tokens
    with those ``batch`` carries: ``logprob_mismatch``, ``|rollout_logprobs -
    logprobs|`` (how far the rollout engine is from the training engine; a silent
    failure when large), and ``kl_to_ref``, the k3 estimate of KL(policy ||
    reference) from ``ref_logprobs``; each only where the batch has its column.

    Args:
        logprobs: the training engine's log-probs ``[b, R]``.
        batch: the rows' columns.

    Returns:
        The per-token quantities ``[b, R]`` by name.
    """
    terms: dict[str, Tensor] = {}
    if "rollout_logprobs" in batch:
        terms["logprob_mismatch"] = (batch["rollout_logprobs"] - logprobs).abs()
    if "ref_logprobs" in batch:
        terms["kl_to_ref"] = kl_k3(logprobs, batch["ref_logprobs"])
    return terms


class KLEstimator(enum.StrEnum):
    """Which per-token KL(pi || ref) estimator to use (Schulman, "Approximating KL divergence")."""

    K1 = "k1"
    K2 = "k2"
    K3 = "k3"

    def estimate(self, logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
        """Per-token KL estimate.

        Args:
            logprobs: policy log-probs of the sampled tokens.
            ref_logprobs: reference log-probs of the same tokens.

        Returns:
            Per-token estimates, same shape as the inputs.
        """
        return _KL_FUNCTIONS[self](logprobs, ref_logprobs)


_KL_FUNCTIONS: dict[KLEstimator, Callable[[Tensor, Tensor], Tensor]] = {
    KLEstimator.K1: kl_k1,
    KLEstimator.K2: kl_k2,
    KLEstimator.K3: kl_k3,
}


# ------------------------------------------------------------------------ aggregation


def _token_mean_parts(values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    return masked_sum(values, mask), mask.sum().to(values.dtype)


def _seq_mean_token_mean_parts(values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    lengths = mask.sum(dim=-1)
    seq_means = masked_sum(values, mask, dim=-1) / lengths.clamp(min=1)
    return seq_means.sum(), (lengths > 0).sum().to(values.dtype)


def _seq_mean_token_sum_parts(values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    lengths = mask.sum(dim=-1)
    return masked_sum(values, mask), (lengths > 0).sum().to(values.dtype)


class LossAggregation(enum.StrEnum):
    """How per-token loss terms become one scalar.

    Every mode is a sum of per-row contributions divided by a normaliser that is also
    a sum over rows, which is what lets micro-batches and data-parallel shards add
    their parts and divide once by the global normaliser.
    """

    TOKEN_MEAN = "token-mean"
    """Mean over all response tokens of the batch (long answers weigh more)."""
    SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"
    """Mean over sequences of each sequence's token mean (the GRPO paper's form)."""
    SEQ_MEAN_TOKEN_SUM = "seq-mean-token-sum"
    """Mean over sequences of each sequence's token sum."""

    def parts(self, values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """Numerator and normaliser of this aggregation over some rows.

        Args:
            values: ``[B, R]`` per-token terms.
            mask: ``[B, R]`` response mask.

        Returns:
            ``(numerator, normaliser)`` scalars; the loss is the sum of numerators over
            all rows divided by the sum of normalisers.
        """
        return _AGGREGATION_PARTS[self](values, mask)

    def reduce(self, values: Tensor, mask: Tensor) -> Tensor:
        """The aggregated scalar over exactly these rows.

        Args:
            values: ``[B, R]`` per-token terms.
            mask: ``[B, R]`` response mask.

        Returns:
            A scalar; 0 when the mask is empty.
        """
        numerator, normaliser = self.parts(values, mask)
        return numerator / normaliser.clamp(min=1)


_AGGREGATION_PARTS: dict[LossAggregation, Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]] = {
    LossAggregation.TOKEN_MEAN: _token_mean_parts,
    LossAggregation.SEQ_MEAN_TOKEN_MEAN: _seq_mean_token_mean_parts,
    LossAggregation.SEQ_MEAN_TOKEN_SUM: _seq_mean_token_sum_parts,
}
