"""Reading a run configuration: a ``.toml``, ``.yaml`` or ``.yml`` file plus
``--set`` overrides, decoded by msgspec into the :class:`RunConfig` of the
registered algorithms; unknown keys and wrong types are errors that name the key
(``$.actor.lr``), and :func:`~asyncflow.train._validate.validate` checks the rest,
all before any Ray or SFT work.
"""


from __future__ import annotations

import difflib
import enum
import json
import re
import types
import typing
from pathlib import Path
from typing import Any

import msgspec

from asyncflow.algos import (
    algorithms,
    get_algorithm,
)
from asyncflow.train._config import DEFAULT_ALGORITHM, RunConfig, run_config_type
from asyncflow.train._file import read_config_file
from asyncflow.train._user_modules import importable, module_dirs
from asyncflow.train._validate import validate
from channels import ConfigError
from workers.data import ArithmeticTaskConfig

__all__ = ["load_config"]


def load_config(path: str | Path, overrides: dict[str, object] | None = None) -> RunConfig:
    """Read and validate a ``.toml``, ``.yaml`` or ``.yml`` run configuration.

    Everything is checked here, before any Ray or SFT work: the keys and types, every
    value, the layouts against the pools and the model, and the reward functions
    (imported in this process).

    Args:
        path: the configuration file.
        overrides: dotted key -> value, applied over the file (``--set``).

    Returns:
        The validated configuration.

    Raises:
        ConfigError: one line naming the file and the key, what is wrong and the fix.
    """
    path = Path(path)
    data = read_config_file(path)
    try:
        file_algorithm = data.get("algorithm")
        if isinstance(file_algorithm, dict):
            file_algorithm = file_algorithm.get("name", DEFAULT_ALGORITHM)  # the table changes below
        for key, value in (overrides or {}).items():
            if key == "algorithm" and isinstance(value, str) and isinstance(data.get("algorithm"), dict):
                key = "algorithm.name"  # another algorithm, the file's other settings kept
            _set(data, key, value)
        _refuse_task_section(data)
        _algorithm_table(data)
        _check_switched_algorithm(data, file_algorithm)
        config = msgspec.convert(data, run_config_type())
        with importable(module_dirs(path)):  # where the run will import the config's modules from
            validate(config)
    except msgspec.ValidationError as e:
        message = _with_valid_keys(_name_the_key(str(e)), data)
        raise ConfigError(f"{_given_by(path, str(e), overrides or {})}: {message}") from e
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from e
    return config


def _refuse_task_section(data: dict[str, object]) -> None:
    """The old ``[task]`` section (the arithmetic problems) is ``[data.arithmetic]``
    now, one prompt source among the ``[data]`` ones: say where its keys go."""
    if "task" in data:
        keys = [f.name for f in msgspec.structs.fields(ArithmeticTaskConfig)]
        raise ConfigError(f"[task] is now [data.arithmetic] (with [data] source = \"arithmetic\", the default without "
                          f"data.train): move its keys {keys} there")


def _algorithm_table(data: dict[str, object]) -> None:
    """``algorithm = "ppo"`` is ``[algorithm] name = "ppo"``; a name must be a
    registered algorithm; the old per-algorithm sections and the old name of the
    sampling table (``[algorithm.rollout]``) get a pointer."""
    registered = algorithms()
    stale = sorted(k for k in data if k in registered)
    if stale:
        raise ConfigError(f"[{stale[0]}] is not a section: an algorithm's settings go in [algorithm], beside "
                          f"name = {stale[0]!r}")
    table = data.get("algorithm", {"name": DEFAULT_ALGORITHM})
    if isinstance(table, str):
        table = {"name": table}
    if not isinstance(table, dict):
        raise ConfigError(f"algorithm must be a table ([algorithm] name = ...) or a name, got {table!r}")
    table.setdefault("name", DEFAULT_ALGORITHM)
    algo = get_algorithm(str(table["name"]))  # an unknown name fails here, listing the registered ones
    if "rollout" in table and "rollout" not in algo.config.__struct_fields__:
        raise ConfigError("[algorithm.rollout] is now [algorithm.sampling] (the same keys): rename the table, "
                          "or write algorithm.sampling.<key> in --set")
    data["algorithm"] = table


def _check_switched_algorithm(data: dict[str, object], before: object) -> None:
    """After ``--set algorithm=NAME`` (or ``algorithm.name=NAME``) named another
    algorithm than the file's (``before``; None: the file has no ``[algorithm]``),
    the file's other ``[algorithm]`` keys stay; refuse, naming them, those the new
    algorithm does not accept."""
    table = data["algorithm"]
    assert isinstance(table, dict)  # _algorithm_table made it one
    name = str(table["name"])
    if before is None or name == before:
        return
    accepted = {f.name for f in msgspec.structs.fields(get_algorithm(name).config)}
    dropped = sorted(k for k in table if k != "name" and k not in accepted)
    if dropped:
        raise ConfigError(f"algorithm = {name!r} (--set) does not accept the [algorithm] keys {dropped} "
                          f"set for {before!r}; remove them, or switch the algorithm in the file")


_UNKNOWN_FIELD = re.compile(r"Object contains unknown field `(?P<field>[^`]+)`(?: - at `\$(?P<path>[\w.\[\]'\"-]*)`)?")
_BAD_CHOICE = re.compile(r"Invalid enum value (?P<value>.+) - at `\$(?P<path>[\w.]+)`")


def _with_valid_keys(message: str, data: dict[str, object]) -> str:
    """An unknown key's message with the keys its section accepts, and a refused
    choice's with the values the key takes; either with the closest one first, when
    one is close (a typo)."""
    if (m := _UNKNOWN_FIELD.fullmatch(message)) is not None:
        section = _type_at(m["path"] or "", data)
        if not _is_struct(section):
            return message
        keys = [f.name for f in msgspec.structs.fields(section)]
        where = "there" if m["path"] else "at the top level (sections and keys)"
        return f"{message}{_did_you_mean(m['field'], keys)}; valid keys {where}: {keys}"
    if (m := _BAD_CHOICE.fullmatch(message)) is not None:
        choices = _choices(_type_at(m["path"], data))
        if not choices:
            return message
        given = m["value"].strip("'\"")
        return f"{message}{_did_you_mean(given, [str(c) for c in choices])}; valid values: {choices}"
    return message


def _type_at(path: str, data: dict[str, object]) -> Any:
    """The type of the value at msgspec's ``path`` (``".actor.lr"``; ``""``: the
    whole configuration); None where it cannot be told (an entry of a table)."""
    t: Any = RunConfig
    if path.startswith(".algorithm"):
        algo = data.get("algorithm")
        t = get_algorithm(str(algo.get("name"))).config if isinstance(algo, dict) else None
        path = path[len(".algorithm"):]
    for part in filter(None, path.split(".")):
        fields = msgspec.structs.fields(t) if _is_struct(t) else ()
        field = next((f for f in fields if f.name == part), None)
        t = field.type if field is not None else None
    return t


def _choices(t: Any) -> list[Any]:
    """The values a ``Literal`` (or an optional one) or an ``Enum`` type takes."""
    if isinstance(t, type) and issubclass(t, enum.Enum):
        return [m.value for m in t]
    if typing.get_origin(t) is typing.Literal:
        return list(typing.get_args(t))
    if typing.get_origin(t) in (typing.Union, types.UnionType):
        return [c for arg in typing.get_args(t) for c in _choices(arg)]
    return []


def _did_you_mean(given: str, names: list[str]) -> str:
    close = difflib.get_close_matches(given, names, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _is_struct(t: object) -> bool:
    return isinstance(t, type) and issubclass(t, msgspec.Struct)


_AT_SECTION = re.compile(r"(?s)[A-Za-z_]\w*\.(?P<field>\w+)(?P<rest>.*) - at `\$\.(?P<section>[\w.]+)`")


def _name_the_key(message: str) -> str:
    """msgspec reports a ``__post_init__``'s ``"ActorSection.lr must be ..."`` as
    ``"... - at `$.actor`"``; say ``"actor.lr must be ..."``, the key as the user
    wrote it (``"sampling.n ..." - at `$.algorithm.sampling``` becomes ``"algorithm.sampling.n ..."``).
    Other messages, and sections inside a table (``$.pools[...]``), stay as they are."""
    m = _AT_SECTION.fullmatch(message)
    return f"{m['section']}.{m['field']}{m['rest']}" if m else message


def _given_by(path: Path, message: str, overrides: dict[str, object]) -> str:
    """Where the value msgspec refused (``- at `$.actor.lr```) came from: the
    ``--set`` that gave it (its value as typed, and a note where a value that is
    not JSON was read as a string), else the file."""
    at = re.search(r"at `\$\.([^`]+)`", message)
    if at is None:
        return str(path)
    where = re.escape(at[1]).replace(re.escape("[...]"), r"\.[^.]+")  # a table's entry: any name
    for key, value in overrides.items():
        if re.fullmatch(where, key) or at[1].startswith((f"{key}.", f"{key}[")):
            if not isinstance(value, str):
                return f"--set {key}={json.dumps(value)}"
            note = " (not JSON: read as a string)" if "got `str`" in message else ""
            return f"--set {key}={value}{note}"
    return str(path)


def _set(data: dict[str, object], dotted: str, value: object) -> None:
    node = data
    *parents, leaf = dotted.split(".")
    for p in parents:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted}: {p} is not a table")
        node = child
    node[leaf] = value
