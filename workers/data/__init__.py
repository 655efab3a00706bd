"""Prompt sources turned into generation batches for the policy: the user's data
files (``[data] source = "files"``) or the built-in arithmetic problems
(``source = "arithmetic"``).

- :func:`load_rows` reads the rows of a data file: JSON lines (``.jsonl``, or
  ``.json`` holding JSON lines or one list of objects), Parquet, CSV, or a
  directory written by ``datasets``' ``save_to_disk``. Errors name the config
  key, the file, and the line and field where the format has them.
- The policy's tokenizer (``workers.models.load_prompt_tokenizer``): the
  repository's ``CharTokenizer`` or any local transformers tokenizer, encoding
  plain-text prompts with its special tokens and chat-message prompts through its
  chat template.
- :class:`PromptDataset` tokenizes the prompt field of every row once, drops (and
  counts) prompts over the length limit, and cuts batches by index: left-padded
  ``prompt_ids`` / ``prompt_mask``, ``uid``, and every other field of the row as a
  column that reaches the reward function under its own name
  (:func:`workers.rewards.row_columns` reads it back).

- The arithmetic source: :class:`ArithmeticTaskConfig` names a problem family and
  the sizes of its splits, :func:`generate_splits` draws them from a seed,
  :func:`prompt_batch` and :func:`sft_batch` tokenize problems with the character
  tokenizer (:func:`batch_widths`: the widths that give all of a run's batches one
  shape), :func:`decode_responses` turns generated ids back into text for the
  verifier (``workers.rewards.arithmetic_reward``).
- :func:`iter_problem_batches`: the seeded order in which a run draws training
  prompts (any source), a function of the seed and of the number of batches drawn.

Everything reads local files or generates from a seed; nothing is downloaded.
"""

from __future__ import annotations

from workers.data._arithmetic import (
    ArithmeticProblem,
    ArithmeticTaskConfig,
    TaskSplits,
    generate_splits,
)
from workers.data._arithmetic_batches import (
    batch_widths,
    check_fits_context,
    decode_responses,
    iter_problem_batches,
    prompt_batch,
    sft_batch,
)
from workers.data._dataset import ColumnKind, PromptDataset
from workers.data._files import load_rows

__all__ = [
    "ArithmeticProblem",
    "ArithmeticTaskConfig",
    "ColumnKind",
    "PromptDataset",
    "TaskSplits",
    "batch_widths",
    "check_fits_context",
    "decode_responses",
    "generate_splits",
    "iter_problem_batches",
    "load_rows",
    "prompt_batch",
    "sft_batch",
]
