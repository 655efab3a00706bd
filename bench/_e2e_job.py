"""The end-to-end GRPO workload ``bench.e2e`` runs through asyncflow and TRL.

On the CPU (:meth:`E2EJob.on` ``"cpu"``): a random-initialised tiny Llama (hidden
128, MLP 256, 2 layers, 2 heads of 64, a 64-symbol vocabulary), 16 prompts x 4
samples per step, exactly 32 new tokens each. On one GPU (``"cuda"``): a random
Llama of Qwen2.5-0.5B's shape (``bench._shapes``), 64 prompts of 128 tokens x 8
samples of exactly 256 tokens, trained in bf16 in micro-batches of 16. Both: temperature 1.0, KL
to a frozen reference (coefficient 0.04), one optimizer step per batch at lr 1e-4,
and a rule reward over the decoded text. Both frameworks get the same model
directory, prompts, reward function and sizes; nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from bench._shapes import SHAPES
from workers.models import TinyModelConfig, save_tiny_model


@dataclass(frozen=True, kw_only=True)
class E2EJob:
    """The workload's sizes."""

    prompts: int = 16
    """Prompts per step."""
    n: int = 4
    """Samples per prompt (GRPO's group)."""
    new_tokens: int = 32
    """Tokens per response, exactly (EOS is ignored)."""
    prompt_len: int = 8
    vocab_size: int = 64
    kl_coef: float = 0.04
    lr: float = 1e-4
    seed: int = 0
    device: str = "cpu"
    """Where both frameworks run: ``"cpu"``, or ``"cuda"`` (one GPU, bf16)."""
    micro_batch: int = 64
    """Sequences per forward/backward pass of an update (gradients accumulate over the batch)."""

    @classmethod
    def on(cls, device: str) -> E2EJob:
        """The workload's sizes for ``device`` (see the module docstring)."""
        if device == "cuda":
            return cls(prompts=64, n=8, new_tokens=256, prompt_len=128, vocab_size=151936, device="cuda",
                       micro_batch=16)
        return cls()

    @property
    def rows(self) -> int:
        """Responses per step."""
        return self.prompts * self.n

    @property
    def tokens_per_step(self) -> int:
        """Generated tokens per step."""
        return self.rows * self.new_tokens

    def model(self) -> TinyModelConfig:
        """The policy's (and reference's) shape."""
        if self.device == "cuda":
            return replace(SHAPES["qwen2.5-0.5b"], max_position_embeddings=self.prompt_len + self.new_tokens + 8)
        return TinyModelConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                               num_key_value_heads=2, head_dim=64, vocab_size=self.vocab_size,
                               max_position_embeddings=self.prompt_len + self.new_tokens + 8)

    def save_model(self, directory: Path) -> str:
        """Write the model (and its tokenizer) to ``directory``; its path."""
        return str(save_tiny_model(directory, self.model(), seed=self.seed))

    @contextlib.contextmanager
    def model_dir(self, given: str | None) -> Iterator[str]:
        """The model's directory: ``given`` (``bench.e2e`` saves it once and every run
        loads it, as a user's checkpoint), else the model saved into a temporary
        directory for this run alone (a run started by hand)."""
        if given is not None:
            yield given
            return
        with tempfile.TemporaryDirectory(prefix="e2e-model-") as tmp:
            yield self.save_model(Path(tmp) / "policy")

    def prompt_ids(self) -> torch.Tensor:
        """``[prompts, prompt_len]`` token ids of the alphabet's symbols, fixed by the seed."""
        g = torch.Generator().manual_seed(self.seed)
        return torch.randint(3, 16, (self.prompts, self.prompt_len), generator=g)

    def as_dict(self) -> dict[str, Any]:
        """The sizes, for the record."""
        return asdict(self) | {"rows": self.rows, "tokens_per_step": self.tokens_per_step}


def digit_reward(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    """The rule reward: the fraction of a completion's characters that are digits
    (TRL's reward-function form; asyncflow calls it the same way)."""
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]
