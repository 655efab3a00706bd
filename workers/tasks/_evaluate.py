"""Greedy held-out accuracy of a policy on an arithmetic split."""

from __future__ import annotations

from collections.abc import Sequence

from workers.models import CharTokenizer
from workers.rollout import NativeRolloutEngine, SamplingParams

from ._batches import check_fits_context, decode_responses, require_problems
from ._problems import ArithmeticProblem
from ._reward import exact_match_reward

__all__ = ["evaluate_greedy"]


def evaluate_greedy(
    engine: NativeRolloutEngine,
    problems: Sequence[ArithmeticProblem],
    tokenizer: CharTokenizer,
    *,
    max_new_tokens: int,
) -> dict[str, float]:
    """Greedy-decode every problem once and score it with :func:`exact_match_reward`.

    Args:
        engine: The policy's rollout engine (its ``max_batch_size`` sets the batch).
        problems: The split to evaluate, usually the held-out eval split.
        tokenizer: The model's tokenizer.
        max_new_tokens: Generation limit; the longest answer plus one (for ``<eos>``)
            suffices.

    Returns:
        ``accuracy`` (fraction exactly right), ``num_problems`` and
        ``mean_response_tokens``.

    Raises:
        ConfigError: If ``problems`` is empty or a prompt does not fit the context.
    """
    require_problems(problems, "evaluate_greedy")
    check_fits_context(
        problems,
        tokenizer,
        max_new_tokens=max_new_tokens,
        max_positions=int(engine.model.config.max_position_embeddings),
    )
    params = SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=0.0,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    output = engine.generate([tokenizer.encode(p.prompt) for p in problems], params)
    responses = decode_responses(output.response_ids, output.response_mask, tokenizer)
    scores = exact_match_reward(
        [p.prompt for p in problems], responses, [p.answer for p in problems]
    )
    return {
        "accuracy": sum(scores) / len(scores),
        "num_problems": float(len(scores)),
        "mean_response_tokens": float(output.response_lengths.float().mean()),
    }
