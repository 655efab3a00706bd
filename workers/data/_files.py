"""Rows of a user's data file as plain dicts: JSON lines (or a JSON list), Parquet,
CSV, or a directory written by ``datasets``' ``save_to_disk``.

JSON and CSV are parsed here, not by ``datasets``, so that a bad row is reported
with its line number. Every error is one :class:`~channels.ConfigError` line that
names the config key (``data.train``), the file and, where the format has them,
the line and the field.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from channels import ConfigError

__all__ = ["SUFFIXES", "load_rows"]

SUFFIXES: tuple[str, ...] = (".jsonl", ".json", ".parquet", ".csv")
"""File suffixes :func:`load_rows` reads (besides ``save_to_disk`` directories)."""

Row = dict[str, Any]


def load_rows(path: str | Path, *, key: str) -> list[Row]:
    """Read every row of a data file, in file order.

    Formats, by suffix:

    - ``.jsonl``: one JSON object a line (blank lines skipped);
    - ``.json``: the same, or one top-level list of objects;
    - ``.parquet``: read with pyarrow (nested columns become lists and dicts);
    - ``.csv``: a header line, then one row a record (UTF-8, a leading BOM
      ignored). Values stay strings, numbers included: columns are not guessed,
      so an answer ``007`` or ``1e3`` reaches the reward function as written
      (verifiers compare text; convert in the reward function where needed);
    - a directory: one written by ``datasets.Dataset.save_to_disk`` (or a
      ``DatasetDict`` with a single split).

    Args:
        path: the file or directory.
        key: the config key that names it (``"data.train"``), for messages.

    Returns:
        The rows, each a dict of field name to value.

    Raises:
        ConfigError: the file is missing, of an unsupported kind, holds no rows, or
            is malformed (naming the line, and for CSV the fields, where it can).
    """
    p = Path(path)
    if not p.exists():
        hint = "" if p.is_absolute() else f" (relative to {Path.cwd()})"
        raise ConfigError(f"{key}: {p} does not exist{hint}")
    if p.is_dir():
        rows = _dataset_dir_rows(p, key)
    elif p.suffix in (".jsonl", ".json"):
        rows = _json_rows(p, key)
    elif p.suffix == ".parquet":
        rows = _parquet_rows(p, key)
    elif p.suffix == ".csv":
        rows = _csv_rows(p, key)
    else:
        raise ConfigError(f"{key}: {p} has the unsupported suffix {p.suffix or '(none)'!r}; supported are "
                          f"{', '.join(SUFFIXES)} and directories written by datasets' save_to_disk")
    if not rows:
        raise ConfigError(f"{key}: {p} holds no rows")
    return rows


def _read_text(p: Path, key: str) -> str:
    try:
        # utf-8-sig: files saved by some editors (and Excel) start with a BOM.
        return p.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{key}: {p} is not UTF-8 text (byte {e.start} is {e.object[e.start]:#04x}); "
                          "save it as UTF-8") from None


def _json_rows(p: Path, key: str) -> list[Row]:
    text = _read_text(p, key)
    if p.suffix == ".json" and text.lstrip().startswith("["):
        return _json_list_rows(text, p, key)
    rows: list[Row] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if p.suffix == ".json" and len(rows) == 0 and _is_one_object(text):
                raise ConfigError(f"{key}: {p} holds one JSON object over several lines; write a list of "
                                  "row objects, or one row object a line (JSON lines)") from None
            raise ConfigError(f"{key}: {p}: line {number}: not valid JSON: {e.msg} (column {e.colno}); "
                              "each line must hold one JSON object") from None
        if not isinstance(row, dict):
            raise ConfigError(f"{key}: {p}: line {number} holds a JSON {_json_type(row)}, not an object "
                              'of fields like {"prompt": "...", "answer": "..."}')
        rows.append(row)
    return rows


def _json_list_rows(text: str, p: Path, key: str) -> list[Row]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{key}: {p}: line {e.lineno}: not valid JSON: {e.msg} (column {e.colno})") from None
    for i, row in enumerate(data):
        if not isinstance(row, dict):
            raise ConfigError(f"{key}: {p}: item {i} of the list holds a JSON {_json_type(row)}, not an "
                              'object of fields like {"prompt": "...", "answer": "..."}')
    return list(data)


def _is_one_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


def _json_type(value: object) -> str:
    names = {list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _csv_rows(p: Path, key: str) -> list[Row]:
    text = _read_text(p, key)
    reader = csv.reader(text.splitlines(keepends=True))
    try:
        header = next(reader, None)
        if header is None:
            return []
        _check_header(header, p, key)
        rows: list[Row] = []
        for record in reader:
            if not record:
                continue  # a blank line
            if len(record) != len(header):
                raise ConfigError(f"{key}: {p}: line {reader.line_num} has {len(record)} fields, the header "
                                  f"{len(header)} ({', '.join(header)}); quote values that hold commas")
            rows.append(dict(zip(header, record, strict=True)))
    except csv.Error as e:
        raise ConfigError(f"{key}: {p}: line {reader.line_num}: not valid CSV: {e}") from None
    return rows


def _check_header(header: list[str], p: Path, key: str) -> None:
    for i, name in enumerate(header):
        if not name.strip():
            raise ConfigError(f"{key}: {p}: line 1 (the header) has an empty name for column {i + 1}; "
                              "name every column")
        if header.index(name) != i:
            raise ConfigError(f"{key}: {p}: line 1 (the header) names the column {name!r} twice; "
                              "name each column once")


def _parquet_rows(p: Path, key: str) -> list[Row]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(p)
    except (pa.ArrowException, OSError) as e:
        raise ConfigError(f"{key}: {p} is not a readable Parquet file: {e}") from None
    return list(table.to_pylist())


def _dataset_dir_rows(p: Path, key: str) -> list[Row]:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(p))
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"{key}: {p} is a directory, but not one written by datasets' save_to_disk "
                          f"({type(e).__name__}: {e}); give a file ({', '.join(SUFFIXES)}) or such a "
                          "directory") from None
    if isinstance(loaded, datasets.DatasetDict):
        if len(loaded) != 1:
            raise ConfigError(f"{key}: {p} holds the splits {', '.join(sorted(loaded))}; point {key} at one "
                              f"split's directory, e.g. {p / sorted(loaded)[0]}")
        loaded = next(iter(loaded.values()))
    return list(loaded.to_list())
