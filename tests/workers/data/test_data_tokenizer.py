"""load_prompt_tokenizer and PromptTokenizer with real tokenizers: a tiny Hugging
Face BPE tokenizer built locally (tests/support_hf.py) and the repo's CharTokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from channels import ConfigError
from support_hf import save_tiny_hf_llama, save_tiny_hf_tokenizer
from workers.models import (
    CharTokenizer,
    PromptTokenizer,
    TinyModelConfig,
    load_prompt_tokenizer,
    save_tiny_model,
)

CHAT = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_hf_tokenizer(tmp_path_factory.mktemp("hf"))


def test_hf_text_keeps_the_tokenizers_own_special_tokens(hf_dir: Path) -> None:
    tokenizer = load_prompt_tokenizer(hf_dir)
    reference = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    ids = tokenizer.encode_text("What is 2 + 3?")
    assert ids == reference("What is 2 + 3?")["input_ids"]
    assert ids[0] == reference.bos_token_id and ids.count(reference.bos_token_id) == 1
    assert tokenizer.decode(ids) == "What is 2 + 3?"
    assert not tokenizer.is_char_tokenizer
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id) == (reference.pad_token_id, reference.eos_token_id)


def test_hf_chat_is_the_templates_ids_as_a_plain_list(hf_dir: Path) -> None:
    tokenizer = load_prompt_tokenizer(hf_dir)
    reference = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    ids = tokenizer.encode_chat(CHAT)
    assert type(ids) is list and all(type(i) is int for i in ids)
    assert ids == reference.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True,
                                                return_dict=False)
    text = reference.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<s><|im_start|>system") and text.endswith("<|im_start|>assistant\n")
    assert ids == reference(text, add_special_tokens=False)["input_ids"]
    assert ids.count(reference.bos_token_id) == 1, "the template's BOS, not a second one"


def test_hf_without_pad_token_pads_with_eos(tmp_path: Path) -> None:
    tokenizer = load_prompt_tokenizer(save_tiny_hf_tokenizer(tmp_path, pad_token=False))
    assert tokenizer.tokenizer.pad_token_id is None
    assert tokenizer.pad_token_id == tokenizer.eos_token_id


def test_hf_without_chat_template(tmp_path: Path) -> None:
    tokenizer = load_prompt_tokenizer(save_tiny_hf_tokenizer(tmp_path, chat_template=False))
    assert not tokenizer.has_chat_template
    assert tokenizer.encode_text("What is 2 + 3?")
    with pytest.raises(ConfigError, match=f"^the prompt holds chat messages but the model at {tmp_path} has no "
                                          "chat template"):
        tokenizer.encode_chat(CHAT)


def test_chat_template_that_rejects_the_messages(hf_dir: Path) -> None:
    tokenizer = load_prompt_tokenizer(hf_dir)
    tokenizer.tokenizer.chat_template = "{{ raise_exception('Conversation roles must alternate') }}"
    with pytest.raises(ConfigError, match=f"the chat template of the model at {hf_dir} failed on these "
                                          r"messages \(TemplateError: Conversation roles must alternate\)"):
        tokenizer.encode_chat(CHAT)


def test_char_tokenizer_directory(tmp_path: Path) -> None:
    save_tiny_model(tmp_path, TinyModelConfig())
    tokenizer = load_prompt_tokenizer(tmp_path)
    char = CharTokenizer()
    assert tokenizer.is_char_tokenizer and not tokenizer.has_chat_template
    assert tokenizer.encode_text("12+3=") == char.encode("12+3=")
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id) == (char.pad_token_id, char.eos_token_id)
    assert tokenizer.decode(char.encode("12+3=")) == "12+3="
    with pytest.raises(ConfigError, match="has no chat template"):
        tokenizer.encode_chat(CHAT)


def test_tiny_llama_directory_loads_its_hf_tokenizer(tmp_path: Path) -> None:
    from workers.models import check_supported_checkpoint

    path = save_tiny_hf_llama(tmp_path)
    tokenizer = load_prompt_tokenizer(path)
    assert tokenizer.has_chat_template
    config = check_supported_checkpoint(path)
    assert config.vocab_size == len(tokenizer.tokenizer)
    assert config.eos_token_id == tokenizer.eos_token_id


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=f"^the model directory {tmp_path / 'nope'} does not exist"):
        load_prompt_tokenizer(tmp_path / "nope")


def test_directory_without_tokenizer_files(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}", encoding="utf-8")
    with pytest.raises(ConfigError, match=f"^the model directory {tmp_path} holds no tokenizer files "
                                          r"\(one of tokenizer\.json, "):
        load_prompt_tokenizer(tmp_path)


def test_tokenizer_files_transformers_cannot_load(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("not json", encoding="utf-8")
    with pytest.raises(ConfigError, match=f"^the tokenizer files in {tmp_path} do not load with "
                                          r"transformers\.AutoTokenizer \(") as e:
        load_prompt_tokenizer(tmp_path)
    assert "\n" not in str(e.value)


def test_tokenizer_without_eos(hf_dir: Path) -> None:
    reference = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    reference.eos_token = None
    with pytest.raises(ConfigError, match="the tokenizer at here has no EOS token"):
        PromptTokenizer(reference, source="here")
