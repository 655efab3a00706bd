"""Shared helpers of the role tests: a tiny model shape, arithmetic prompts, contexts,
random training rows and a runner for real gloo process groups."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from ranks import start_ranks

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


def random_rows(rows: int, *, prompt: int = 5, response: int = 6, seed: int = 0) -> dict[str, torch.Tensor]:
    """Left-padded prompts and right-padded responses of varied lengths, with the fields
    the actor's update and ``rollout_consistency`` read (token ids below 32)."""
    gen = torch.Generator().manual_seed(seed)
    prompt_mask = (torch.arange(prompt)[None] >= prompt - torch.randint(1, prompt + 1, (rows, 1), generator=gen)).long()
    response_mask = (torch.arange(response)[None] < torch.randint(1, response + 1, (rows, 1), generator=gen)).long()
    def logprobs() -> torch.Tensor:
        return (-1.0 - torch.rand(rows, response, generator=gen)) * response_mask
    return {
        "prompt_ids": torch.randint(1, 32, (rows, prompt), generator=gen) * prompt_mask,
        "prompt_mask": prompt_mask,
        "response_ids": torch.randint(1, 32, (rows, response), generator=gen) * response_mask,
        "response_mask": response_mask,
        "old_logprobs": logprobs(), "ref_logprobs": logprobs(), "rollout_logprobs": logprobs(),
        "advantages": torch.randn(rows, response, generator=gen) * response_mask,
    }


def small_lm(seed: int = 0) -> torch.nn.Module:
    """A 1-layer, 32-wide Llama over 32 token ids, drawn from ``seed``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, head_dim=16, max_position_embeddings=32))


def _rank_main(rank: int, world: int, store: str, fn: Callable[[int, Path], None], out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}/store", rank=rank, world_size=world)
    try:
        fn(rank, Path(out))
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, fn: Callable[[int, Path], None], tmp: Path) -> Path:
    """Run the module-level ``fn(rank, out_dir)`` on ``world`` new processes joined by a
    gloo group (forked from a server that imported torch and the roles once); returns
    ``out_dir``."""
    out = tmp / "out"
    out.mkdir(exist_ok=True)
    start_ranks(_rank_main, (world, str(tmp), fn, str(out)), world)
    return out
