"""Shared helpers of the training-engine tests: tiny models, synthetic batches, 2-rank runs."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from ranks import start_ranks
from torch import Tensor, nn
from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel

VOCAB = 32


def tiny_config(*, layers: int = 2, hidden: int = 64, max_positions: int = 128) -> LlamaConfig:
    """A Llama config with 2 heads (so tp=2 divides it); default 2 layers, 64 wide."""
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=hidden // 2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
    )


SMALL = {"layers": 1, "hidden": 32, "max_positions": 32}

# Adam's first update is g / (|g| + eps): with a tiny eps it is sign(g), which turns
# float-rounding noise in near-zero gradients into full-size updates. eps=1 keeps the
# update proportional to the gradient, so weights compare at float32 tolerance.
EXACT = {"lr": 1e-3, "eps": 1.0}
"""TrainingConfig settings whose updates compare gradients."""
"""The smallest shape (1 layer, 32 wide, 32 positions), for tests that spawn many ranks."""


def tiny_lm(seed: int = 0, **shape: int) -> LlamaForCausalLM:
    """The tiny causal LM with weights drawn from ``seed`` (same on every process)."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_config(**shape))


class TinyValueModel(nn.Module):
    """Llama backbone plus a scalar head: forward(input_ids, attention_mask, position_ids) -> [B, T]."""

    def __init__(self, seed: int = 0, **shape: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        config = tiny_config(**shape)
        self.backbone = LlamaModel(config)
        self.value_head = nn.Linear(config.hidden_size, 1)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
    ) -> Tensor:
        hidden = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
        ).last_hidden_state
        return self.value_head(hidden).squeeze(-1)


def make_batch(
    rows: int = 8, prompt: int = 6, response: int = 7, seed: int = 1
) -> dict[str, Tensor]:
    """Left-padded prompts, right-padded responses of varied lengths, plus RL fields."""
    gen = torch.Generator().manual_seed(seed)
    prompt_len = torch.randint(1, prompt + 1, (rows,), generator=gen)
    response_len = torch.randint(1, response + 1, (rows,), generator=gen)
    prompt_len[0], response_len[0] = 2, response  # make sure some columns are trimmable
    prompt_mask = (torch.arange(prompt)[None] >= prompt - prompt_len[:, None]).long()
    response_mask = (torch.arange(response)[None] < response_len[:, None]).long()
    return {
        "prompt_ids": torch.randint(1, VOCAB, (rows, prompt), generator=gen) * prompt_mask,
        "prompt_mask": prompt_mask,
        "response_ids": torch.randint(1, VOCAB, (rows, response), generator=gen) * response_mask,
        "response_mask": response_mask,
        "old_logprobs": (-2.0 - torch.rand(rows, response, generator=gen)) * response_mask,
        "ref_logprobs": (-2.0 - torch.rand(rows, response, generator=gen)) * response_mask,
        "advantages": torch.randn(rows, response, generator=gen) * response_mask,
        "old_values": torch.randn(rows, response, generator=gen) * response_mask,
        "returns": torch.randn(rows, response, generator=gen) * response_mask,
    }


def full_weights(engine: object) -> dict[str, Tensor]:
    """Gathered weights of an engine, cloned to the CPU (collective)."""
    return {name: t.detach().cpu().clone() for name, t in engine.named_full_weights()}  # type: ignore[attr-defined]


def _worker(
    rank: int, world: int, store_dir: str, fn: Callable[[int, Path], None], out: str
) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group(
        "gloo", init_method=f"file://{store_dir}/store", rank=rank, world_size=world
    )
    try:
        fn(rank, Path(out))
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, fn: Callable[[int, Path], None], tmp: Path) -> Path:
    """Run ``fn(rank, out_dir)`` on ``world`` new processes joined by a gloo group.

    ``fn`` must be a module-level function (it is pickled by name). Returns ``out_dir``.
    """
    out = tmp / "out"
    out.mkdir(exist_ok=True)
    start_ranks(_worker, (world, str(tmp), fn, str(out)), world)
    return out
