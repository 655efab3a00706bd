"""The verifier of the arithmetic prompt source: exact match, as a batched reward function.

A response is judged on its text up to the first ``<eos>`` (whatever follows is
ignored), stripped of surrounding whitespace: it earns 1.0 when that equals the
reference answer, else 0.0.
"""

from __future__ import annotations

from collections.abc import Sequence

from channels import ConfigError
from workers.models import SPECIAL_TOKENS

EOS_TEXT = SPECIAL_TOKENS[2]
"""How ``<eos>`` reads in decoded text (see ``workers.data.decode_responses``)."""


def extract_answer(response: str) -> str:
    """The part of a response the verifier judges: up to ``<eos>``, stripped.

    Args:
        response: Decoded response text.

    Returns:
        The candidate answer (empty when the response starts with ``<eos>``).
    """
    return response.split(EOS_TEXT, 1)[0].strip()


def arithmetic_reward(
    prompts: Sequence[str], responses: Sequence[str], answers: Sequence[str]
) -> list[float]:
    """Score responses by exact match with the reference answers.

    Args:
        prompts: The prompts (unused by this verifier; part of the reward-function
            signature ``fn(prompts, responses, answers)``).
        responses: Decoded responses, ``<eos>`` kept as text.
        answers: Reference answers.

    Returns:
        1.0 where the response up to ``<eos>``, stripped, equals the answer, else 0.0.

    Raises:
        ConfigError: If the three sequences differ in length.
    """
    if not len(prompts) == len(responses) == len(answers):
        raise ConfigError(
            f"arithmetic_reward needs one prompt, response and answer per row, got "
            f"{len(prompts)} prompts, {len(responses)} responses, {len(answers)} answers"
        )
    return [
        1.0 if extract_answer(response) == answer.strip() else 0.0
        for response, answer in zip(responses, answers, strict=True)
    ]
