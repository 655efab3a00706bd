"""Users' data files turned into generation batches for the policy.

- :func:`load_rows` reads the rows of a data file: JSON lines (``.jsonl``, or
  ``.json`` holding JSON lines or one list of objects), Parquet, CSV, or a
  directory written by ``datasets``' ``save_to_disk``. Errors name the config
  key, the file, and the line and field where the format has them.
- :func:`load_prompt_tokenizer` loads the policy's tokenizer from its model
  directory as a :class:`PromptTokenizer`: the repository's ``CharTokenizer`` or
  any local transformers tokenizer, encoding plain-text prompts with its special
  tokens and chat-message prompts through its chat template.
- :class:`PromptDataset` tokenizes the prompt field of every row once, drops (and
  counts) prompts over the length limit, and cuts batches by index: left-padded
  ``prompt_ids`` / ``prompt_mask``, ``uid``, and every other field of the row as a
  column that reaches the reward function under its own name
  (:func:`workers.rewards.row_columns` reads it back).

Everything reads local files only; nothing is downloaded.
"""

from __future__ import annotations

from workers.data._dataset import RESERVED_FIELDS, ColumnKind, PromptDataset
from workers.data._files import SUFFIXES, load_rows
from workers.data._tokenizer import PromptTokenizer, load_prompt_tokenizer

__all__ = [
    "RESERVED_FIELDS",
    "SUFFIXES",
    "ColumnKind",
    "PromptDataset",
    "PromptTokenizer",
    "load_prompt_tokenizer",
    "load_rows",
]
