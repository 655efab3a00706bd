"""Synthetic verifiable tasks: arithmetic problems, their batches, verifier and SFT warm start.

Everything is generated locally and deterministically from a seed (nothing is
downloaded): :func:`generate_splits` draws disjoint train and held-out problems,
:func:`prompt_batch` and :func:`sft_batch` tokenize them in the engines' conventions,
:func:`exact_match_reward` scores responses, :func:`evaluate_greedy` measures
held-out accuracy and :func:`sft_warm_start` trains the model RL starts from.
:data:`ARITHMETIC_RECIPE` holds the tuned settings of SFT then GRPO on a small CPU.
"""

from __future__ import annotations

from ._batches import (
    check_fits_context,
    decode_responses,
    iter_problem_batches,
    prompt_batch,
    sft_batch,
)
from ._evaluate import evaluate_greedy
from ._problems import (
    OPERATORS,
    ArithmeticProblem,
    ArithmeticTaskConfig,
    TaskSplits,
    generate_splits,
)
from ._recipe import ARITHMETIC_RECIPE, ArithmeticRecipe, GRPORecipe
from ._reward import EOS_TEXT, exact_match_reward, extract_answer
from ._sft import SFTConfig, sft_warm_start

__all__ = [
    "ARITHMETIC_RECIPE",
    "EOS_TEXT",
    "OPERATORS",
    "ArithmeticProblem",
    "ArithmeticRecipe",
    "ArithmeticTaskConfig",
    "GRPORecipe",
    "SFTConfig",
    "TaskSplits",
    "check_fits_context",
    "decode_responses",
    "evaluate_greedy",
    "exact_match_reward",
    "extract_answer",
    "generate_splits",
    "iter_problem_batches",
    "prompt_batch",
    "sft_batch",
    "sft_warm_start",
]
