"""Types shared by every rollout engine (native and vLLM).

A rollout engine turns prompts (lists of token ids) into responses. All engines take
the same :class:`SamplingParams` and return the same :class:`RolloutOutput`, so the
actor role can swap engines without touching the algorithm.

Conventions (the training engine relies on them):

- prompts are left-padded to the batch's longest prompt, responses right-padded to
  ``max_new_tokens``; ``prompt_ids ++ response_ids`` is the training sequence;
- ``logprobs`` are the log-probabilities of the sampled tokens under the model's raw
  distribution (``log_softmax(logits)`` at temperature 1, before top-k/top-p), which
  is what the training engine recomputes; padding positions hold 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import torch

from channels import ConfigError


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How to sample responses."""

    max_new_tokens: int = 32
    """Most tokens generated per response (EOS included)."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1.0 disables it."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 disables it."""
    eos_token_id: int | None = None
    """A response ends after this token (it is kept and masked in)."""
    pad_token_id: int = 0
    """Token used to pad prompts (left) and responses (right)."""
    seed: int | None = None
    """Seed for sampling; None draws from the engine's generator."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ConfigError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"SamplingParams.top_k must be >= 0 (0 disables), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        """Whether sampling reduces to argmax."""
        return self.temperature == 0 or self.top_k == 1


@dataclass(frozen=True, kw_only=True)
class RolloutOutput:
    """A batch of finished responses, as padded tensors (row i answers prompt i).

    An in-process value (tensors never go inside wire Structs)."""

    prompt_ids: torch.Tensor
    """[B, P] int64, left-padded with ``pad_token_id``."""
    prompt_mask: torch.Tensor
    """[B, P] int64, 1 on real prompt tokens."""
    response_ids: torch.Tensor
    """[B, R] int64, right-padded with ``pad_token_id`` (R = max_new_tokens)."""
    response_mask: torch.Tensor
    """[B, R] int64, 1 on generated tokens (EOS included)."""
    logprobs: torch.Tensor
    """[B, R] float32, raw log-probs of the generated tokens, 0 on padding."""

    @property
    def response_lengths(self) -> torch.Tensor:
        """[B] number of generated tokens per row."""
        return self.response_mask.sum(dim=1)


class FinishedSample(msgspec.Struct, frozen=True, kw_only=True, array_like=True, gc=False):
    """One response, reported by an engine as soon as it completes (for streaming)."""

    index: int
    """Row of the prompt in the request."""
    response_ids: list[int]
    """Generated tokens (EOS included, no padding)."""
    logprobs: list[float]
    """Raw log-prob of each generated token."""
