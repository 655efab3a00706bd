"""Shared helpers of the role tests: a tiny model shape, arithmetic prompts, contexts."""

from __future__ import annotations

import torch

from channels import Layout
from workers import WorkerContext
from workers.models import CharTokenizer, TinyModelConfig

TINY = TinyModelConfig(hidden_size=64, intermediate_size=128, num_attention_heads=1,
                       num_key_value_heads=1, head_dim=64, num_hidden_layers=2)
"""A 2-layer, 64-wide Llama (fast on two shared cores)."""

TOK = CharTokenizer()
PROBLEMS = [("1+2=", "3"), ("12+30=", "42"), ("7*6=", "42"), ("99-9=", "90"), ("5+5=", "10")]


def prompt_columns(problems: list[tuple[str, str]] = PROBLEMS) -> dict[str, torch.Tensor]:
    """The driver's prompt fields for ``problems``: left-padded prompts, uids 10, 11, ...,
    right-padded answers."""
    ids = [TOK.encode(p) for p, _ in problems]
    width = max(len(x) for x in ids)
    answers = [TOK.encode(a, add_bos=False) for _, a in problems]
    answer_width = max(len(a) for a in answers)
    pad = TOK.pad_token_id
    return {
        "prompt_ids": torch.tensor([[pad] * (width - len(x)) + x for x in ids]),
        "prompt_mask": torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids]),
        "uid": torch.arange(10, 10 + len(problems)),
        "answer_ids": torch.tensor([a + [pad] * (answer_width - len(a)) for a in answers]),
    }


def local_ctx(role: str) -> WorkerContext:
    """A one-rank context without a process group (a role built in this process)."""
    return WorkerContext(role=role, pool="local", rank=0, world_size=1, global_rank=0,
                         layout=Layout(), device=torch.device("cpu"), process_group=None, mesh=None)


def advantages_for(rows: dict[str, torch.Tensor], seed: int = 0) -> torch.Tensor:
    """Random per-sequence advantages spread over the response tokens."""
    gen = torch.Generator().manual_seed(seed)
    mask = rows["response_mask"]
    return torch.randn(mask.shape[0], 1, generator=gen).expand_as(mask) * mask
