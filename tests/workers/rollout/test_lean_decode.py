"""The lean decode step gives transformers' logits bit for bit, through padding,
dropped and merged rows, grouped-query attention and q/k/v biases; models it does
not reproduce exactly keep the transformers path. Repeated prompts prefill once."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from workers.rollout._kv_batch import KVBatch, decode, prefill
from workers.rollout._lean_decode import lean_decoder

SIZES = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 50, "max_position_embeddings": 64}


def _model(kind: str) -> PreTrainedModel:
    torch.manual_seed(0)
    model: PreTrainedModel
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**SIZES, attn_implementation="sdpa"))
    else:  # Qwen2: biases on q, k and v
        model = Qwen2ForCausalLM(Qwen2Config(**SIZES, attn_implementation="sdpa"))
    return model.eval()


def _steps(model: PreTrainedModel, lean: bool, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Prefill, decode 3 steps, drop rows 1 and 3, merge a fresh batch, decode 3 more."""
    decoder = lean_decoder(model) if lean else None
    batch, logits = prefill(model, prompts, list(range(len(prompts))), pad_token_id=0)
    seen = [logits]

    def step(b: KVBatch, last: torch.Tensor) -> torch.Tensor:
        b.next_tokens = last.argmax(dim=-1)
        return decode(model, b, decoder)

    for _ in range(3):
        logits = step(batch, logits)
        seen.append(logits)
    batch.keep([0, 2, 4])
    logits = logits[[0, 2, 4]]
    fresh, fresh_logits = prefill(model, [[7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18]], [10, 11], pad_token_id=0)
    fresh.next_tokens = fresh_logits.argmax(dim=-1)
    batch.next_tokens = logits.argmax(dim=-1)
    batch.extend(fresh)
    logits = decode(model, batch, decoder)
    seen.append(logits)
    for _ in range(2):
        logits = step(batch, logits)
        seen.append(logits)
    return seen


RAGGED = [[3, 4, 5], [6], [7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]
EVEN = [[3, 4, 5], [6, 7, 8], [9, 10, 11], [12, 13, 14], [15, 16, 17]]
"""Prompts of one length: no padding until the merged batch brings some (the steps
before attend without a mask)."""


@pytest.mark.parametrize("prompts", [RAGGED, EVEN], ids=["ragged", "even"])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_lean_steps_equal_transformers_bit_for_bit(kind: str, prompts: list[list[int]]) -> None:
    model = _model(kind)
    assert lean_decoder(model) is not None
    for ours, theirs in zip(_steps(model, True, prompts), _steps(model, False, prompts), strict=True):
        assert torch.equal(ours, theirs)


def test_a_batch_knows_when_its_rows_carry_padding() -> None:
    model = _model("llama")
    batch, _ = prefill(model, EVEN, list(range(5)), pad_token_id=0)
    assert not batch.padded
    batch.keep([0, 2])
    assert not batch.padded
    batch.extend(prefill(model, [[7, 8, 9, 10]], [9], pad_token_id=0)[0])
    assert batch.padded and not bool(batch.mask.all())
    batch.keep([2])  # the longest row alone: its cache has no padding left
    assert not batch.padded and bool(batch.mask.all())
    ragged, _ = prefill(model, RAGGED, list(range(5)), pad_token_id=0)
    assert ragged.padded


def test_repeated_sequences_are_prefilled_once_and_decode_as_if_alone() -> None:
    """A prompt's n samples (GRPO) share one prefill: the model sees each distinct
    sequence once, every row gets its copy of the cache, and the rows decode what
    each sequence decodes alone (up to float rounding: batches of other sizes)."""
    model = _model("llama")
    prompts = [[3, 4, 5], [6], [3, 4, 5], [7, 8, 9, 10, 11], [6], [3, 4, 5]]
    fed: list[int] = []
    hook = model.model.embed_tokens.register_forward_hook(lambda _m, args, _out: fed.append(args[0].shape[0]))
    try:
        batch, logits = prefill(model, prompts, [10, 11, 12, 13, 14, 15], pad_token_id=0)
    finally:
        hook.remove()
    assert fed == [3]  # [3, 4, 5], [6] and the long one
    assert batch.indices == [10, 11, 12, 13, 14, 15] and len(batch) == 6 and batch.padded
    for first, again in ((0, 2), (0, 5), (1, 4)):
        assert torch.equal(logits[first], logits[again])
        assert torch.equal(batch.mask[first], batch.mask[again])
    decoder = lean_decoder(model)
    seen = [logits]
    for _ in range(3):
        batch.next_tokens = seen[-1].argmax(dim=-1)
        seen.append(decode(model, batch, decoder))
    for row, prompt in enumerate(prompts):
        alone, alone_logits = prefill(model, [prompt], [0], pad_token_id=0)
        mine = [alone_logits]
        for _ in range(3):
            alone.next_tokens = mine[-1].argmax(dim=-1)
            mine.append(decode(model, alone, decoder))
        for batched, single in zip(seen, mine, strict=True):
            torch.testing.assert_close(batched[row], single[0], rtol=1e-5, atol=1e-5)


def test_models_it_cannot_reproduce_keep_the_transformers_path() -> None:
    scaled = LlamaForCausalLM(LlamaConfig(**SIZES, rope_scaling={"rope_type": "linear", "factor": 2.0}))
    assert lean_decoder(scaled) is None
    assert lean_decoder(LlamaForCausalLM(LlamaConfig(**SIZES, attn_implementation="eager"))) is None
