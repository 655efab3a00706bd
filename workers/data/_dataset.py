"""A user's rows with their prompts tokenized once, cut into generation batches.

A row's prompt field is plain text or a chat conversation (``[{"role": "user",
"content": "..."}]``, rendered with the tokenizer's chat template and the
assistant's turn opened). Every other field rides along with the prompt as a
column and reaches the reward function under its own name
(:func:`workers.rewards.row_columns` turns it back into one Python value per row):

- text -> a UTF-8 column (:func:`workers.rewards.text_column`) -> ``str``;
- booleans, integers, floats -> a ``[B]`` bool / int64 / float64 column; a field
  mixing integers and floats is float64 (its integers come back as floats);
- anything else (lists, objects, nulls, a field mixing kinds such as text and
  null) -> its JSON text, which the reward function reads with ``json.loads``.
  :meth:`PromptDataset.describe` names the fields carried this way.

The prompt itself is not carried: the reward function gets it decoded from
``prompt_ids``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal

import torch
from torch import Tensor

from channels import ConfigError
from workers.models import PromptTokenizer
from workers.rewards import text_column
from workers.roles import fields as F

__all__ = ["RESERVED_FIELDS", "ColumnKind", "PromptDataset"]

ColumnKind = Literal["bool", "int", "float", "text", "json"]
"""How a carried field travels (see the module docstring)."""

RESERVED_FIELDS: frozenset[str] = frozenset({
    F.PROMPT_IDS, F.PROMPT_MASK, F.UID, F.ANSWER_IDS, F.RESPONSE_IDS, F.RESPONSE_MASK, F.ROLLOUT_LOGPROBS,
    F.OLD_LOGPROBS, F.ENTROPY, F.REF_LOGPROBS, F.VALUES, F.SCORES, F.COSTS, F.ADVANTAGES, F.RETURNS,
    "prompts", "completions",
})
"""Names a data field may not take: the engines' columns, and the reward
function's own ``prompts`` and ``completions`` arguments. Names ending in
``_ids``, ``_mask`` or ``logprobs``, starting with ``_`` or holding ``/`` are
refused too (token columns, internal and per-function score columns)."""

_KIND_LABELS: dict[ColumnKind, str] = {"bool": "bool", "int": "int", "float": "float", "text": "text",
                                       "json": "JSON text"}
_INT64 = range(-(2**63), 2**63)


@dataclass(frozen=True, kw_only=True)
class PromptDataset:
    """Rows whose prompts are tokenized, ready to be cut into generation batches.

    Build with :meth:`from_rows`. ``len()`` counts the rows kept; indices
    ``0 .. len - 1`` address them in file order.
    """

    key: str
    """The config key of the file (``data.train``), for messages and the log."""
    source: str
    """The file the rows came from."""
    prompt_ids: list[list[int]]
    """Each kept row's prompt as token ids (special tokens included)."""
    prompts: list[str | list[dict[str, Any]]]
    """Each kept row's prompt field as written (text or chat messages)."""
    row_numbers: list[int]
    """Each kept row's 1-based position among the file's rows."""
    columns: dict[str, list[Any]]
    """The carried fields of the kept rows, text and JSON kinds already as text."""
    kinds: dict[str, ColumnKind]
    """How each carried field travels."""
    pad_token_id: int
    """The id prompts are left-padded with."""
    total_rows: int
    """Rows in the file, dropped ones included."""
    max_prompt_tokens: int
    """The length limit prompts were held to."""

    @classmethod
    def from_rows(cls, rows: Sequence[Mapping[str, Any]], tokenizer: PromptTokenizer, *, prompt_field: str,
                  max_prompt_tokens: int, key: str, source: str,
                  longer: str = "raise the prompt length limit or shorten the prompts") -> PromptDataset:
        """Tokenize the prompts of ``rows``, dropping (and counting) those longer than
        ``max_prompt_tokens``.

        Rows are numbered from 1 in file order in messages: row ``n`` of a JSONL
        file is its line ``n`` when the file has no blank lines, of a CSV file its
        line ``n + 1`` (after the header).

        Args:
            rows: the rows, as :func:`~workers.data.load_rows` returns them.
            tokenizer: the policy's tokenizer.
            prompt_field: the field holding the prompt.
            max_prompt_tokens: the longest prompt kept, in tokens (special tokens and
                the chat template included).
            key: the config key of the file (``data.train``), for messages.
            source: the file, for messages.
            longer: what to change when no prompt is within ``max_prompt_tokens``,
                in the caller's terms (its configuration's keys).

        Returns:
            The dataset.

        Raises:
            ConfigError: naming ``key``, ``source``, the row and the field: a row
                without the prompt field, a prompt that is neither text nor chat
                messages (or that the tokenizer cannot encode), a row whose fields
                differ from row 1's, a field named like an engine column, or no
                prompt within ``max_prompt_tokens``.
        """
        where = f"{key}: {source}"
        if max_prompt_tokens < 1:
            raise ConfigError(f"{key}: the prompt length limit must be >= 1 token, got {max_prompt_tokens}")
        if not rows:
            raise ConfigError(f"{where} holds no rows")
        fields = _carried_fields(rows[0], prompt_field, where)
        prompt_ids: list[list[int]] = []
        kept: list[int] = []
        shortest: int | None = None
        for number, row in enumerate(rows, start=1):
            _check_fields(row, number, rows[0], prompt_field, where)
            ids = _encode_prompt(row[prompt_field], tokenizer, f"{where}: row {number}, field {prompt_field!r}")
            shortest = len(ids) if shortest is None else min(shortest, len(ids))
            if len(ids) <= max_prompt_tokens:
                prompt_ids.append(ids)
                kept.append(number - 1)
        if not kept:
            raise ConfigError(f"{where}: all {len(rows)} prompts are longer than {max_prompt_tokens} tokens (the "
                              f"shortest has {shortest}); {longer}")
        kinds = {f: _kind([row[f] for row in rows]) for f in fields}
        columns = {f: _carried_values([rows[i][f] for i in kept], kinds[f], [i + 1 for i in kept], f, where)
                   for f in fields}
        return cls(key=key, source=source, prompt_ids=prompt_ids, prompts=[rows[i][prompt_field] for i in kept],
                   row_numbers=[i + 1 for i in kept], columns=columns, kinds=kinds,
                   pad_token_id=tokenizer.pad_token_id, total_rows=len(rows), max_prompt_tokens=max_prompt_tokens)

    def __len__(self) -> int:
        return len(self.prompt_ids)

    @property
    def dropped(self) -> int:
        """Rows dropped as longer than :attr:`max_prompt_tokens`."""
        return self.total_rows - len(self)

    @cached_property
    def longest_prompt(self) -> int:
        """Tokens in the longest kept prompt."""
        return max(len(ids) for ids in self.prompt_ids)

    @cached_property
    def text_widths(self) -> dict[str, int]:
        """Per carried field travelling as text (text and JSON kinds): its longest
        value's UTF-8 bytes (at least 1), the width of its column in every batch."""
        return {name: max(len(v.encode("utf-8")) for v in values) or 1
                for name, values in self.columns.items() if self.kinds[name] in ("text", "json")}

    def describe(self) -> str:
        """One line for the run's log: rows kept and dropped, the fields carried.

        Example: ``data.train: 7461 prompts from train.jsonl (12 of 7473 rows dropped
        as longer than 200 prompt tokens), longest 187 tokens; fields for the reward:
        answer (text), level (int)``.
        """
        line = f"{self.key}: {len(self)} prompts from {self.source}"
        if self.dropped:
            line += (f" ({self.dropped} of {self.total_rows} rows dropped as longer than "
                     f"{self.max_prompt_tokens} prompt tokens)")
        line += f", longest {self.longest_prompt} tokens"
        if not self.columns:
            return line + "; no fields for the reward besides the prompt"
        return line + "; fields for the reward: " + ", ".join(
            f"{name} ({_KIND_LABELS[self.kinds[name]]})" for name in self.columns)

    def batch(self, indices: Sequence[int], *, first_uid: int) -> dict[str, Tensor]:
        """A generation batch of the rows ``indices``.

        Args:
            indices: rows of this dataset (``0 .. len - 1``), in batch order.
            first_uid: the uid of the batch's first row.

        Every batch of the dataset has the same columns of the same widths, so a
        run's batches can be joined (partial rollouts finish one batch's samples
        with the next batch's, DAPO concatenates the batches it samples).

        Returns:
            ``prompt_ids`` and ``prompt_mask``: int64 ``[B, P]``, left-padded with the
            pad id (``P``: :attr:`longest_prompt`, the dataset's longest prompt; the
            engines drop columns that are padding in every row); ``uid``: int64
            ``[B]``, ``first_uid + i``; and one column per carried field (see the
            module docstring; text as wide as :attr:`text_widths` says).

        Raises:
            IndexError: an index is outside the dataset.
            ValueError: ``indices`` is empty.
        """
        if len(indices) == 0:
            raise ValueError(f"{self.key}: a batch needs at least one row index")
        for i in indices:
            if not 0 <= i < len(self):
                raise IndexError(f"{self.key}: row index {i} is outside [0, {len(self)})")
        rows = [self.prompt_ids[i] for i in indices]
        width = self.longest_prompt
        prompt_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.int64)
        prompt_mask = torch.zeros((len(rows), width), dtype=torch.int64)
        for r, ids in enumerate(rows):
            if ids:
                prompt_ids[r, width - len(ids):] = torch.tensor(ids, dtype=torch.int64)
                prompt_mask[r, width - len(ids):] = 1
        out = {F.PROMPT_IDS: prompt_ids, F.PROMPT_MASK: prompt_mask,
               F.UID: torch.arange(first_uid, first_uid + len(rows), dtype=torch.int64)}
        for name, values in self.columns.items():
            out[name] = _column([values[i] for i in indices], self.kinds[name], self.text_widths.get(name))
        return out


def _carried_fields(first: Mapping[str, Any], prompt_field: str, where: str) -> list[str]:
    """The fields of row 1 besides the prompt, checked against the reserved names."""
    if prompt_field not in first:
        raise ConfigError(f"{where}: row 1 has no prompt field {prompt_field!r}; its fields are "
                          f"{', '.join(map(repr, first))}: name one of them as the prompt field")
    fields = [f for f in first if f != prompt_field]
    for name in fields:
        reason = _reserved_reason(name)
        if reason is not None:
            raise ConfigError(f"{where}: the field {name!r} {reason}, so it cannot reach the reward function "
                              "under that name; rename it in the file")
    return fields


def _reserved_reason(name: str) -> str | None:
    if name in ("prompts", "completions"):
        return "is an argument the reward function already gets"
    if name in RESERVED_FIELDS:
        return "is a column of the engines' batches"
    if name.endswith(("_ids", "_mask", "logprobs")):
        return "ends like the engines' token columns (_ids, _mask, logprobs)"
    if name.startswith("_") or "/" in name or not name:
        return "is empty, starts with '_' or holds '/' (names kept for internal columns)"
    return None


def _check_fields(row: Mapping[str, Any], number: int, first: Mapping[str, Any], prompt_field: str,
                  where: str) -> None:
    if not isinstance(row, Mapping):
        raise ConfigError(f"{where}: row {number} is a {type(row).__name__}, not a mapping of fields")
    if prompt_field not in row:
        raise ConfigError(f"{where}: row {number} has no prompt field {prompt_field!r}; its fields are "
                          f"{', '.join(map(repr, row))}")
    missing = [f for f in first if f not in row]
    if missing:
        raise ConfigError(f"{where}: row {number} lacks the field {missing[0]!r} that row 1 has; every row "
                          "needs the same fields")
    extra = [f for f in row if f not in first]
    if extra:
        raise ConfigError(f"{where}: row {number} has the field {extra[0]!r} that row 1 lacks; every row "
                          "needs the same fields")


def _encode_prompt(prompt: Any, tokenizer: PromptTokenizer, where: str) -> list[int]:
    if isinstance(prompt, str) and not prompt.strip():
        raise ConfigError(f"{where}: the prompt is empty")
    if isinstance(prompt, list):
        problem = _chat_problem(prompt)
        if problem is not None:
            raise ConfigError(f'{where}: {problem}; chat messages are [{{"role": "user", "content": "..."}}, ...]')
    elif not isinstance(prompt, str):
        raise ConfigError(f'{where} holds {_what(prompt)}; a prompt is text or a list of chat messages '
                          '[{"role": "user", "content": "..."}]')
    try:
        return tokenizer.encode_text(prompt) if isinstance(prompt, str) else tokenizer.encode_chat(prompt)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def _what(value: Any) -> str:
    """``value``'s kind in the words of JSON (files are mostly JSON lines)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, Mapping):
        return "an object"
    return f"a {type(value).__name__}"


def _chat_problem(messages: list[Any]) -> str | None:
    """What makes ``messages`` no chat conversation, or None."""
    if not messages:
        return "the chat message list is empty"
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            return f"message {i} is {_what(message)}, not an object"
        for part in ("role", "content"):
            if not isinstance(message.get(part), str):
                return f"message {i} has no text {part!r}"
    return None


def _kind(values: list[Any]) -> ColumnKind:
    if all(isinstance(v, bool) for v in values):
        return "bool"
    if all(isinstance(v, int) and not isinstance(v, bool) and v in _INT64 for v in values):
        return "int"
    if all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        return "float"
    if all(isinstance(v, str) for v in values):
        return "text"
    return "json"


def _carried_values(values: list[Any], kind: ColumnKind, numbers: list[int], name: str,
                    where: str) -> list[Any]:
    """``values`` as the column stores them: JSON kinds as their text."""
    if kind == "json":
        return [json.dumps(v, ensure_ascii=False, default=str) for v in values]
    if kind == "text":
        for v, number in zip(values, numbers, strict=True):
            if "\0" in v:
                raise ConfigError(f"{where}: row {number}, field {name!r} holds a NUL character, which the "
                                  "reward side reads as padding; remove it")
    return values


def _column(values: list[Any], kind: ColumnKind, width: int | None) -> Tensor:
    if kind == "bool":
        return torch.tensor(values, dtype=torch.bool)
    if kind == "int":
        return torch.tensor(values, dtype=torch.int64)
    if kind == "float":
        return torch.tensor(values, dtype=torch.float64)
    return text_column(values, width=width)
