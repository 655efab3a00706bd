"""GGUF files written with the gguf package's own writer, for the tests of reading them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


def write_gguf(path: Path, architecture: str, add: Callable[[Any], None] = lambda writer: None) -> Path:
    """A header-only GGUF file (no tensors) declaring ``architecture``, with the
    fields ``add(writer)`` adds (skips the test without the gguf package)."""
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(path, arch=architecture)
    add(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
