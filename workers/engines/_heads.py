"""Model heads: how a model's forward becomes per-response-token outputs.

A causal LM yields log-probs (and entropy) of the response tokens; a value model
yields one value per response position. The engine is the same for both roles; the
head is the strategy that differs. Whatever dtype the model computes in (bf16 under
mixed precision), the heads return float32: logits are upcast chunk by chunk with
autocast switched off, values are cast.
"""

from __future__ import annotations

import inspect
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn

from workers.engines._batch import SequenceInputs
from workers.engines._errors import EngineConfigError
from workers.objectives import ModelOutputs, logprobs_and_entropy_from_logits, logprobs_from_logits


class ModelHead(Protocol):
    """Runs the model on some rows and extracts the outputs over their response tokens."""

    def __call__(
        self, model: nn.Module, inputs: SequenceInputs, *, entropy_grad: bool
    ) -> ModelOutputs:
        """Outputs ``[b, R']`` over ``inputs``' response columns.

        Args:
            model: the (possibly parallelised) model.
            inputs: the trimmed sequence inputs.
            entropy_grad: keep the entropy's autograd graph (an entropy bonus needs it).

        Returns:
            The outputs this head produces.
        """
        ...


def _accepted_kwargs(model: nn.Module) -> set[str]:
    return set(inspect.signature(model.forward).parameters)


def _float32_math(tensor: Tensor) -> AbstractContextManager[None]:
    """Autocast off on ``tensor``'s device: the log-softmax math stays float32 even when
    the engine runs the model's forward under ``torch.autocast``."""
    return torch.autocast(tensor.device.type, enabled=False)


@dataclass(frozen=True, kw_only=True)
class CausalLMHead:
    """Log-probs and entropy of the response tokens from a causal LM's logits.

    The log-prob of response token j comes from the logits at position ``P' + j - 1``.
    Models that accept ``logits_to_keep`` (Hugging Face) compute only the ``R' + 1``
    last positions' logits, and, where no row has padding (``SequenceInputs.dense``),
    get one row of position ids for all the rows: they broadcast it, so their rotary
    embedding's angles are computed once instead of once per row (the same results;
    measured in ``docs/benchmarks.md``).
    """

    temperature: float = 1.0
    """Divides the logits; 1.0 matches the rollout engines' raw log-probs."""
    with_entropy: bool = True
    """Also compute the entropy (without a graph unless the loss needs it)."""
    chunk_size: int | None = 1024
    """Token rows per chunk of the log-softmax computation (bounds the float32 copy)."""

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise EngineConfigError(
                f"CausalLMHead.temperature must be > 0 (1.0 = raw log-probs), got {self.temperature}"
            )

    def __call__(
        self, model: nn.Module, inputs: SequenceInputs, *, entropy_grad: bool
    ) -> ModelOutputs:
        """See :meth:`ModelHead.__call__`."""
        width = inputs.response_width
        accepted = _accepted_kwargs(model)
        extra: dict[str, object] = {}
        positions = inputs.position_ids
        if "logits_to_keep" in accepted:
            extra["logits_to_keep"] = width + 1
            if inputs.dense:
                positions = positions[:1]
        if "use_cache" in accepted:
            extra["use_cache"] = False
        out = model(
            input_ids=inputs.input_ids,
            attention_mask=inputs.attention_mask,
            position_ids=positions,
            **extra,
        )
        logits = out.logits if hasattr(out, "logits") else out
        logits = logits[:, -(width + 1) : -1]
        with _float32_math(logits):
            if not self.with_entropy:
                logprobs = logprobs_from_logits(
                    logits, inputs.response_ids, temperature=self.temperature, chunk_size=self.chunk_size
                )
                return ModelOutputs(logprobs=logprobs)
            logprobs, entropy = logprobs_and_entropy_from_logits(
                logits, inputs.response_ids, temperature=self.temperature, chunk_size=self.chunk_size,
                entropy_grad=entropy_grad,
            )
        return ModelOutputs(logprobs=logprobs, entropy=entropy)


@dataclass(frozen=True, kw_only=True)
class ValueHead:
    """Values of the response positions from a value model returning ``[b, T]``.

    The value of response token j is read at position ``P' + j - 1`` (the state in
    which token j was chosen), as verl's critic does.
    """

    def __call__(
        self, model: nn.Module, inputs: SequenceInputs, *, entropy_grad: bool
    ) -> ModelOutputs:
        """See :meth:`ModelHead.__call__`."""
        out = model(
            inputs.input_ids,
            attention_mask=inputs.attention_mask,
            position_ids=inputs.position_ids,
        )
        if not isinstance(out, Tensor) or out.shape != inputs.input_ids.shape:
            shape = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
            raise EngineConfigError(
                f"ValueHead needs a model returning values [B, T] = "
                f"{tuple(inputs.input_ids.shape)}, got {shape}; use a value model or CausalLMHead"
            )
        start = inputs.prompt_width - 1
        values = out[:, start : start + inputs.response_width]
        return ModelOutputs(values=values.to(torch.float32))
