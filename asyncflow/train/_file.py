"""Reading a run configuration file: :func:`read_config_file`, with msgspec and
nothing heavier, so that ``asyncflow train`` reports a missing file or a syntax
error before it imports torch and the roles (seconds)."""

from __future__ import annotations

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
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    if path.suffix not in (".toml", ".yaml", ".yml"):
        raise ConfigError(f"config {path} must end in .toml, .yaml or .yml")
    raw = path.read_bytes()
    try:
        data = msgspec.toml.decode(raw) if path.suffix == ".toml" else msgspec.yaml.decode(raw)
    except msgspec.DecodeError as e:
        raise ConfigError(f"{path}: not valid {path.suffix[1:].upper()}: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the file must hold a table of keys, not a {type(data).__name__}")
    return data
