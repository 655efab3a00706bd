"""Reading a run configuration file: :func:`read_config_file`, with msgspec and
nothing heavier, so that ``asyncflow train`` reports a missing file or a syntax
error before it imports torch and the roles (seconds)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import msgspec

from channels import ConfigError


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The table of keys in a ``.toml``, ``.yaml`` or ``.yml`` file, decoded but not
    checked (:func:`~asyncflow.train.load_config` checks it).

    Raises:
        ConfigError: one line naming the file: it does not exist, has another
            suffix, is not valid TOML or YAML, or holds something other than a table.
    """
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config {path} is a directory; name a .toml or .yaml file")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    if path.suffix not in (".toml", ".yaml", ".yml"):
        raise ConfigError(f"config {path} must end in .toml, .yaml or .yml")
    raw = path.read_bytes()
    try:
        data = msgspec.toml.decode(raw) if path.suffix == ".toml" else msgspec.yaml.decode(raw)
    except msgspec.DecodeError as e:
        kind = "TOML" if path.suffix == ".toml" else "YAML"
        raise ConfigError(f"{path}: not valid {kind}: {_one_line(str(e))}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the file must hold a table of keys, not a {type(data).__name__}")
    return data


def _one_line(message: str) -> str:
    """A decoder's message on one line. PyYAML's runs over several: what it was
    doing and where, then the problem and where, each place on a line of its own
    (``  in "<byte string>", line 2, column 5``); the problem and its place are kept."""
    said = [line for line in message.splitlines() if line.strip() and not line.startswith(" ")]
    problem = said[-1] if said else message.strip()
    places = re.findall(r"line (\d+), column (\d+)", message)
    if not places or re.search(r"line \d+, column \d+", problem):
        return problem
    return f"{problem} (line {places[-1][0]}, column {places[-1][1]})"
