"""Token batches of arithmetic problems, in the conventions of the rollout and
training engines; and the seeded order in which a run draws its training prompts.

- :func:`prompt_batch`: what a generation stage consumes, ``prompt_ids``/``prompt_mask``
  left-padded, a ``uid`` per prompt (GRPO groups samples by it) and the reference
  ``answer_ids`` right-padded, all int64.
- :func:`sft_batch`: supervised examples for :class:`workers.objectives.NLLLoss`, the
  prompt as ``prompt_ids``/``prompt_mask`` and ``answer + <eos>`` as
  ``response_ids``/``response_mask``, so the loss covers the answer and EOS only.
- :func:`decode_responses`: generated ids back to text for the verifier, EOS kept as
  ``"<eos>"`` so that whatever follows it is recognisably not part of the answer.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TypeVar

import torch
from torch import Tensor

from channels import ConfigError
from workers.data._arithmetic import ArithmeticProblem
from workers.models import CharTokenizer

T = TypeVar("T")



def prompt_batch(
    problems: Sequence[ArithmeticProblem], tokenizer: CharTokenizer, *, first_uid: int = 0,
    widths: tuple[int, int] | None = None,
) -> dict[str, Tensor]:
    """Tokenize problems into a generation batch.

    Args:
        problems: The prompts' problems (at least one).
        tokenizer: The model's tokenizer; prompts start with ``<bos>`` when it adds one.
        first_uid: ``uid`` of the first row; row ``i`` gets ``first_uid + i`` (give each
            step its own range so that groups of different steps never share an id).
        widths: ``(P, A)``; by default the batch's longest prompt and answer. A run
            gives :func:`batch_widths` of all its problems, so that its batches can be
            joined (partial rollouts finish one batch's samples with the next's).

    Returns:
        ``prompt_ids``, ``prompt_mask`` ``[B, P]`` left-padded; ``uid`` ``[B]``;
        ``answer_ids`` ``[B, A]`` right-padded with ``<pad>`` (no ``<bos>``/``<eos>``).

    Raises:
        ConfigError: If ``problems`` is empty, or a prompt or answer is longer than ``widths``.
    """
    require_problems(problems, "prompt_batch")
    prompts = [tokenizer.encode(problem.prompt) for problem in problems]
    answers = [tokenizer.encode(problem.answer, add_bos=False) for problem in problems]
    prompt_width, answer_width = widths if widths is not None else (None, None)
    prompt_ids, prompt_mask = _pad(prompts, tokenizer.pad_token_id, left=True, width=prompt_width)
    answer_ids, _ = _pad(answers, tokenizer.pad_token_id, left=False, width=answer_width)
    uid = torch.arange(first_uid, first_uid + len(problems), dtype=torch.int64)
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "uid": uid,
        "answer_ids": answer_ids,
    }


def sft_batch(problems: Sequence[ArithmeticProblem], tokenizer: CharTokenizer) -> dict[str, Tensor]:
    """Tokenize problems into supervised examples ``prompt -> answer <eos>``.

    Args:
        problems: The examples (at least one).
        tokenizer: The model's tokenizer.

    Returns:
        ``prompt_ids``, ``prompt_mask`` ``[B, P]`` left-padded and ``response_ids``,
        ``response_mask`` ``[B, R]`` right-padded (the answer then ``<eos>``), int64:
        the batch :class:`workers.engines.TrainingEngine` trains on with ``NLLLoss``.

    Raises:
        ConfigError: If ``problems`` is empty.
    """
    require_problems(problems, "sft_batch")
    prompts = [tokenizer.encode(problem.prompt) for problem in problems]
    responses = [
        [*tokenizer.encode(problem.answer, add_bos=False), tokenizer.eos_token_id]
        for problem in problems
    ]
    prompt_ids, prompt_mask = _pad(prompts, tokenizer.pad_token_id, left=True)
    response_ids, response_mask = _pad(responses, tokenizer.pad_token_id, left=False)
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "response_ids": response_ids,
        "response_mask": response_mask,
    }


def decode_responses(
    response_ids: Tensor, response_mask: Tensor, tokenizer: CharTokenizer
) -> list[str]:
    """Decode generated responses for the verifier, keeping ``<eos>`` as text.

    Args:
        response_ids: ``[B, R]`` generated ids, right-padded.
        response_mask: ``[B, R]`` 1 on generated tokens.
        tokenizer: The model's tokenizer.

    Returns:
        One string per row, e.g. ``"46<eos>"``; padding is dropped.
    """
    rows = []
    for ids, mask in zip(response_ids.tolist(), response_mask.tolist(), strict=True):
        kept = [token for token, keep in zip(ids, mask, strict=True) if keep]
        rows.append(tokenizer.decode(kept, skip_special_tokens=False))
    return rows


def iter_problem_batches(problems: Sequence[T], batch_size: int, *, seed: int) -> Iterator[list[T]]:
    """Endless batches of problems (or of any items, e.g. row indices): each epoch a
    fresh shuffle, cut into full batches.

    Args:
        problems: The split to draw from (at least ``batch_size`` problems).
        batch_size: Problems per batch.
        seed: Seed of the shuffles; equal seeds give equal batches.

    Yields:
        Lists of ``batch_size`` problems; a problem recurs only in a later epoch.

    Raises:
        ConfigError: If ``batch_size < 1`` or the split holds fewer than ``batch_size``
            problems.
    """
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
    if len(problems) < batch_size:
        raise ConfigError(
            f"the split holds {len(problems)} problems, fewer than batch_size={batch_size}; "
            "raise ArithmeticTaskConfig.train_size or lower the batch size"
        )
    return _endless(list(problems), batch_size, seed)


def _endless(problems: list[T], batch_size: int, seed: int) -> Iterator[list[T]]:
    generator = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(problems), generator=generator).tolist()
        for start in range(0, len(order) - batch_size + 1, batch_size):
            yield [problems[i] for i in order[start : start + batch_size]]


def check_fits_context(
    problems: Sequence[ArithmeticProblem],
    tokenizer: CharTokenizer,
    *,
    max_new_tokens: int,
    max_positions: int,
    fix: str = "raise TinyModelConfig.max_position_embeddings or lower ArithmeticTaskConfig.digits",
) -> None:
    """Check that every prompt plus ``max_new_tokens`` fits the model's context.

    Args:
        problems: The problems to check.
        tokenizer: The model's tokenizer.
        max_new_tokens: Tokens generated (or trained on) after the prompt.
        max_positions: The model's ``max_position_embeddings``.
        fix: What to change, in the caller's terms (its configuration's keys).

    Raises:
        ConfigError: Naming the longest prompt and ``fix``.
    """
    longest = max(problems, key=lambda problem: len(problem.prompt), default=None)
    if longest is None:
        return
    length = len(tokenizer.encode(longest.prompt))
    if length + max_new_tokens > max_positions:
        raise ConfigError(
            f"prompt {longest.prompt!r} has {length} tokens; with {max_new_tokens} answer tokens "
            f"that is {length + max_new_tokens} > the model's max_position_embeddings="
            f"{max_positions}; {fix}"
        )


def require_problems(problems: Sequence[ArithmeticProblem], where: str) -> None:
    """Raise :class:`ConfigError` when ``problems`` is empty (``where`` names the caller)."""
    if not problems:
        raise ConfigError(f"{where} got no problems; the split is empty")


def batch_widths(problems: Sequence[ArithmeticProblem], tokenizer: CharTokenizer) -> tuple[int, int]:
    """The longest prompt and answer of ``problems`` in tokens: the ``widths`` of
    :func:`prompt_batch` that fit every batch of them."""
    require_problems(problems, "batch_widths")
    return (max(len(tokenizer.encode(p.prompt)) for p in problems),
            max(len(tokenizer.encode(p.answer, add_bos=False)) for p in problems))


def _pad(rows: list[list[int]], pad: int, *, left: bool, width: int | None = None) -> tuple[Tensor, Tensor]:
    longest = max(len(row) for row in rows)
    if width is None:
        width = longest
    elif longest > width:
        raise ConfigError(f"prompt_batch: a row of {longest} tokens does not fit the width of {width}")
    ids = torch.full((len(rows), width), pad, dtype=torch.int64)
    mask = torch.zeros((len(rows), width), dtype=torch.int64)
    for index, row in enumerate(rows):
        columns = slice(width - len(row), width) if left else slice(0, len(row))
        ids[index, columns] = torch.tensor(row, dtype=torch.int64)
        mask[index, columns] = 1
    return ids, mask
