"""A GGUF file's metadata (its key-value header) read without reading its tensors
or holding its vocabulary.

The ``gguf`` package's reader parses every field into numpy views, the tokenizer's
vocabulary too (tens of thousands of strings, seconds of CPU), before a caller can
ask for one key. A configuration check needs three scalars. This reader walks
the header once, keeps the scalar values and steps over the arrays.

The layout (GGUF versions 2 and 3, little-endian, as llama.cpp writes them): the
magic ``GGUF``, the version (uint32), the tensor count and the key-value count
(uint64 each), then per key its name (a string: uint64 length, UTF-8 bytes), its
value type (uint32) and its value; an array is its element type (uint32), its
length (uint64) and its elements.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Callable
from typing import Any

_SCALARS: dict[int, struct.Struct] = {
    0: struct.Struct("<B"), 1: struct.Struct("<b"), 2: struct.Struct("<H"), 3: struct.Struct("<h"),
    4: struct.Struct("<I"), 5: struct.Struct("<i"), 6: struct.Struct("<f"), 7: struct.Struct("<?"),
    10: struct.Struct("<Q"), 11: struct.Struct("<q"), 12: struct.Struct("<d"),
}
"""GGUF's fixed-size value types by their code."""
_STRING, _ARRAY = 8, 9
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")

Scalar = int | float | bool | str


class GgufHeaderError(ValueError):
    """The file is not a GGUF file this reader understands (version, byte order) or
    ends inside its header."""


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Scalar | None]:
    """The metadata of the GGUF file at ``path``: each key's value, or None for an
    array (whose elements are stepped over).

    Raises:
        GgufHeaderError: not GGUF version 2 or 3 little-endian, or cut short.
        OSError: the file cannot be read.
    """
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
        try:
            return _Header(data).metadata()
        except (struct.error, IndexError, UnicodeDecodeError) as e:
            raise GgufHeaderError(f"the header ends early or is malformed ({e})") from None


class _Header:
    def __init__(self, data: mmap.mmap) -> None:
        self._data, self._at = data, 0

    def metadata(self) -> dict[str, Scalar | None]:
        if self._data[:4] != b"GGUF":
            raise GgufHeaderError("not a GGUF file (its first bytes are not b'GGUF')")
        self._at = 4
        version = self._take(_U32)
        if version not in (2, 3):
            raise GgufHeaderError(f"GGUF version {version} (this reader knows versions 2 and 3, little-endian)")
        self._take(_U64)  # the tensor count
        count = self._take(_U64)
        out: dict[str, Scalar | None] = {}
        for _ in range(count):
            key = self._string()
            kind = self._take(_U32)
            if kind == _ARRAY:
                self._skip_array()
                out[key] = None
            else:
                out[key] = self._value(kind)
        return out

    def _unpack(self, fmt: struct.Struct) -> Any:
        (value,) = fmt.unpack_from(self._data, self._at)
        self._at += fmt.size
        return value

    def _take(self, fmt: struct.Struct) -> int:
        return int(self._unpack(fmt))

    def _string(self) -> str:
        n = self._take(_U64)
        end = self._at + n
        if end > len(self._data):
            raise GgufHeaderError("a string runs past the end of the file")
        text = self._data[self._at:end].decode("utf-8")
        self._at = end
        return text

    def _value(self, kind: int) -> Scalar:
        if kind == _STRING:
            return self._string()
        fmt = _SCALARS.get(kind)
        if fmt is None:
            raise GgufHeaderError(f"unknown value type {kind}")
        return self._unpack(fmt)

    def _skip_array(self) -> None:
        kind, n = self._take(_U32), self._take(_U64)
        fmt = _SCALARS.get(kind)
        if fmt is not None:
            self._at += n * fmt.size
        elif kind in (_STRING, _ARRAY):
            step: Callable[[], object] = self._skip_string if kind == _STRING else self._skip_array
            for _ in range(n):
                step()
        else:
            raise GgufHeaderError(f"unknown array element type {kind}")
        if self._at > len(self._data):
            raise GgufHeaderError("an array runs past the end of the file")

    def _skip_string(self) -> None:
        self._at += 8 + _U64.unpack_from(self._data, self._at)[0]
