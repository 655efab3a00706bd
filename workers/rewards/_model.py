"""Model-based rewards and costs: a :class:`~workers.models.ValueModel` read at the
last response token.

The score of a sample is the value model's output at the position of its last
response token (the EOS when one was generated), i.e. after the model has read the
whole prompt and response. A sample with an empty response is scored at its last
prompt token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from channels import ConfigError
from workers.engines import build_inputs, resolve_precision
from workers.models import ValueModel, load_model
from workers.rewards._inputs import ScoreInputs


@dataclass(frozen=True, kw_only=True)
class ModelRewardConfig:
    """A reward (or cost) model."""

    model_dir: str
    """A value-model directory (``ValueModel.save_pretrained``), or a causal-LM directory
    whose backbone gets a fresh head seeded by ``head_seed`` (for tests and examples)."""
    micro_batch_size: int = 16
    """Samples per forward pass."""
    head_seed: int = 0
    """Seed of a fresh value head (ignored when the directory has one)."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """The model's inference precision: ``"bf16"`` stores its weights in bfloat16
    (scores are float32 either way), ``"fp32"`` in float32, ``"auto"``: bf16 on a GPU,
    fp32 on the CPU (``workers.engines.resolve_precision``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.model_dir, str) or not self.model_dir:
            raise ConfigError(
                f"ModelRewardConfig.model_dir must be a directory path string, got {self.model_dir!r}"
            )
        if not isinstance(self.micro_batch_size, int) or self.micro_batch_size < 1:
            raise ConfigError(
                f"ModelRewardConfig.micro_batch_size must be an int >= 1, got {self.micro_batch_size!r}"
            )
        if self.precision not in ("auto", "fp32", "bf16"):
            raise ConfigError(f"ModelRewardConfig.precision must be 'auto', 'fp32' or 'bf16', got {self.precision!r}")

    def build(self, device: torch.device) -> ModelScorer:
        """Load the model onto ``device``.

        Args:
            device: where the model runs.

        Returns:
            A :class:`ModelScorer`.
        """
        model = load_model(self.model_dir, kind="value", head_seed=self.head_seed)
        if resolve_precision(self.precision, device) == "bf16":  # cast on the host: no float32 copy on the device
            model = model.to(torch.bfloat16)
        return ModelScorer(model.to(device), micro_batch_size=self.micro_batch_size)


class ModelScorer:
    """Scores samples with a value model at their last response token.

    Args:
        model: the reward or cost model.
        micro_batch_size: samples per forward pass.
    """

    def __init__(self, model: ValueModel, *, micro_batch_size: int = 16) -> None:
        self.model = model.eval()
        self.micro_batch_size = micro_batch_size
        self.device = next(model.parameters()).device

    @torch.no_grad()
    def __call__(self, inputs: ScoreInputs) -> Tensor:
        """Score every sample.

        Args:
            inputs: the samples.

        Returns:
            ``[B]`` float32 scores (on the CPU).
        """
        scores = []
        for start in range(0, inputs.num_rows, self.micro_batch_size):
            rows = slice(start, start + self.micro_batch_size)
            micro = {
                "prompt_ids": inputs.prompt_ids[rows], "prompt_mask": inputs.prompt_mask[rows],
                "response_ids": inputs.response_ids[rows], "response_mask": inputs.response_mask[rows],
            }
            scores.append(self._score(micro))
        if not scores:
            return torch.zeros(0, dtype=torch.float32)
        return torch.cat(scores)

    def _score(self, micro: dict[str, Tensor]) -> Tensor:
        seq = build_inputs({k: v.to(self.device) for k, v in micro.items()})
        values = self.model(seq.input_ids, attention_mask=seq.attention_mask,
                            position_ids=seq.position_ids)
        lengths = micro["response_mask"].sum(dim=1).to(self.device)
        # The last response token sits at prompt_width + length - 1 in the trimmed
        # sequence; an empty response falls back to the last prompt token.
        last = (seq.prompt_width + lengths - 1).clamp(min=0)
        return values.gather(1, last[:, None]).squeeze(1).float().cpu()
