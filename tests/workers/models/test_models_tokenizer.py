"""CharTokenizer: id layout, fast encode/decode, and the HF files it saves."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from channels import ConfigError
from workers.models import CharTokenizer, CharTokenizerConfig
from workers.models._tokenizer import ARITHMETIC_SYMBOLS

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return CharTokenizer().save_pretrained(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def hf_tokenizer(saved: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(saved, local_files_only=True)


def test_ids_put_special_tokens_first() -> None:
    tokenizer = CharTokenizer()
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert tokenizer.vocab_size == 4 + len(ARITHMETIC_SYMBOLS)
    assert tokenizer.encode("0", add_bos=False) == [4]


def test_fast_encode_decode_round_trip() -> None:
    tokenizer = CharTokenizer()
    ids = tokenizer.encode("12 + 34=46")
    assert ids[0] == tokenizer.bos_token_id
    assert len(ids) == 1 + len("12 + 34=46")
    assert tokenizer.decode(ids) == "12 + 34=46"
    assert tokenizer.decode([*ids, tokenizer.eos_token_id, 0]) == "12 + 34=46"
    assert tokenizer.decode(ids[:2], skip_special_tokens=False) == "<bos>1"


def test_unknown_symbol_and_bad_id_are_rejected() -> None:
    tokenizer = CharTokenizer()
    with pytest.raises(ValueError, match=r"'x' at position 2"):
        tokenizer.encode("12x")
    with pytest.raises(ValueError, match="negative"):
        tokenizer.decode([-1])


def test_ids_of_a_padded_vocabulary_read_as_unknown(hf_tokenizer: PreTrainedTokenizerBase) -> None:
    """A model whose vocabulary is padded past the alphabet may sample those ids."""
    tokenizer = CharTokenizer()
    padded = [tokenizer.encode("1", add_bos=False)[0], tokenizer.vocab_size, tokenizer.vocab_size + 1000]
    assert tokenizer.decode(padded) == "1" == hf_tokenizer.decode(padded, skip_special_tokens=True)
    assert tokenizer.decode(padded, skip_special_tokens=False) == "1<unk><unk>"


@pytest.mark.parametrize(
    ("symbols", "match"),
    [
        (("1", "1"), "repeats"),
        (("1", "<eos>"), "special token"),
        ((), "non-empty"),
        (("1", ""), "non-empty string"),
    ],
)
def test_config_rejects_bad_alphabets(symbols: tuple[str, ...], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CharTokenizerConfig(symbols=symbols)


def test_auto_tokenizer_loads_saved_files(
    saved: Path, hf_tokenizer: PreTrainedTokenizerBase
) -> None:
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= {
        p.name for p in saved.iterdir()
    }
    ours = CharTokenizer()
    text = "7*8=56"
    assert hf_tokenizer(text).input_ids == ours.encode(text)
    assert hf_tokenizer.decode(ours.encode(text), skip_special_tokens=True) == text
    assert hf_tokenizer.pad_token_id == ours.pad_token_id
    assert hf_tokenizer.bos_token_id == ours.bos_token_id
    assert hf_tokenizer.eos_token_id == ours.eos_token_id
    assert len(hf_tokenizer) == ours.vocab_size


def test_auto_tokenizer_pads_on_the_left(hf_tokenizer: PreTrainedTokenizerBase) -> None:
    batch = hf_tokenizer(["1+2=", "12+34="], padding=True)
    assert batch.input_ids[0][:2] == [0, 0]
    assert batch.attention_mask[0] == [0, 0, 1, 1, 1, 1, 1]


def test_unknown_text_maps_to_unk_in_hf_tokenizer(hf_tokenizer: PreTrainedTokenizerBase) -> None:
    ids = hf_tokenizer("1a2").input_ids
    assert ids == [1, 5, CharTokenizer().unk_token_id, 6]


def test_multi_character_symbols_take_the_longest_match(tmp_path: Path) -> None:
    config = CharTokenizerConfig(symbols=("1", "0", "10", "+", "<sep>"), add_bos=False)
    tokenizer = CharTokenizer(config)
    ids = tokenizer.encode("101+0<sep>")
    assert [tokenizer.decode([i]) for i in ids] == ["10", "1", "+", "0", "<sep>"]
    hf = AutoTokenizer.from_pretrained(tokenizer.save_pretrained(tmp_path), local_files_only=True)
    assert hf("101+0<sep>").input_ids == ids
    assert CharTokenizer.from_pretrained(tmp_path).config == config


def test_from_pretrained_restores_the_config(saved: Path) -> None:
    assert CharTokenizer.from_pretrained(saved).config == CharTokenizerConfig()


def test_a_directory_without_the_tokenizer_is_named(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")  # a model's directory, saved without its tokenizer
    with pytest.raises(ConfigError, match=rf"^{tmp_path} holds no tokenizer.json: the character tokenizer"):
        CharTokenizer.from_pretrained(tmp_path)


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(ARITHMETIC_SYMBOLS), max_size=40))
def test_hf_and_fast_tokenizers_agree(hf_tokenizer: PreTrainedTokenizerBase, text: str) -> None:
    ours = CharTokenizer()
    ids = ours.encode(text)
    assert hf_tokenizer(text).input_ids == ids
    assert hf_tokenizer.decode(ids, skip_special_tokens=True) == ours.decode(ids) == text
