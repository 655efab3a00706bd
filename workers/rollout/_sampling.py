"""Token sampling of the native engine, with one random stream per sample.

Sample ``i`` of a request draws from its own ``torch.Generator``, seeded from
``(seed, i)``, so results depend neither on the batch size nor on which samples
share a step; the generator's state travels with a migrated sample
(:func:`generator_state`, :func:`restore_generator`), so it continues the same stream
on another engine.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from channels import ConfigError

from ._types import SamplingParams

__all__ = ["generator_state", "restore_generator", "row_generator", "sample_tokens"]


def row_generator(seed: int, index: int, device: torch.device, *, skip: int = 0) -> torch.Generator:
    """The generator of sample ``index`` in a request seeded with ``seed``.

    Args:
        seed: The request's seed.
        index: The caller's id of the sample.
        device: Where sampling runs.
        skip: Tokens the sample already holds when it has no carried state (a sample
            migrated from an engine that cannot export its stream); non-zero values
            give a fresh stream rather than replaying the first draws.
    """
    mask = 0xFFFF_FFFF_FFFF_FFFF
    entropy = [seed & mask, index & mask] + ([skip] if skip else [])
    row_seed = int(np.random.SeedSequence(entropy).generate_state(1, np.uint64)[0])
    return torch.Generator(device=device).manual_seed(row_seed)


def generator_state(generator: torch.Generator) -> bytes:
    """The generator's state as bytes (for :class:`~._types.PartialSample`)."""
    return generator.get_state().numpy().tobytes()


def restore_generator(state: bytes, device: torch.device, *, index: int) -> torch.Generator:
    """A generator on ``device`` continuing from ``state``.

    Raises:
        ValueError: If ``state`` is not the state of a generator on ``device``'s kind.
    """
    generator = torch.Generator(device=device)
    try:
        generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
    except (RuntimeError, ValueError) as error:
        raise ConfigError(
            f"PartialSample index={index} carries an rng_state of {len(state)} bytes that is "
            f"not a {device.type} torch.Generator state ({error}); export it from a native "
            f"engine on the same kind of device, or set rng_state=None to re-seed it"
        ) from error
    return generator


@torch.no_grad()
def sample_tokens(
    logits: torch.Tensor,
    params: SamplingParams,
    generators: list[torch.Generator | None],
    *,
    lengths: list[int],
    early_banned: tuple[int, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row; return it and its raw log-prob (temperature 1, unfiltered).

    Args:
        logits: [rows, vocab] next-token logits.
        params: How to sample.
        generators: Each row's random stream (None when greedy).
        lengths: Each row's response length before this token.
        early_banned: Token ids that rows shorter than ``params.min_new_tokens``
            cannot sample (EOS ids). The log-probs stay those of the unmasked
            logits, as vLLM's raw log-probs are taken before its logits processors.
    """
    raw_logprobs = F.log_softmax(logits, dim=-1)
    if params.min_new_tokens and early_banned:
        short = torch.tensor([n < params.min_new_tokens for n in lengths], device=logits.device)
        if bool(short.any()):
            logits = logits.clone()
            rows = short.nonzero()[:, 0]
            logits[rows[:, None], torch.tensor(early_banned, device=logits.device)] = float("-inf")
    if params.greedy:
        tokens = logits.argmax(dim=-1)
    else:
        probs = _filtered_probs(logits, params)
        picks = []
        for row, generator in enumerate(generators):
            picks.append(torch.multinomial(probs[row], 1, generator=generator))
        tokens = torch.cat(picks)
    return tokens, raw_logprobs.gather(-1, tokens[:, None]).squeeze(-1)


def _filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Sampling distribution after temperature, then top-k, then top-p."""
    scores = logits / params.temperature
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
