"""PromptDataset with real tokenizers: batches (left-padded prompts, uids, carried
fields read back by workers.rewards.row_columns), chat prompts through the chat
template, long prompts dropped and counted, and every error."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from channels import ConfigError
from support_hf import save_tiny_hf_tokenizer
from workers.data import PromptDataset, load_rows
from workers.models import PromptTokenizer, TinyModelConfig, load_prompt_tokenizer, save_tiny_model
from workers.rewards import row_columns

ENGINE_COLUMNS = ("prompt_ids", "prompt_mask", "uid")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_hf_tokenizer(tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="module")
def tokenizer(hf_dir: Path) -> PromptTokenizer:
    return load_prompt_tokenizer(hf_dir)


def _dataset(rows: list[dict[str, Any]], tokenizer: PromptTokenizer, *, limit: int = 100,
             field: str = "question") -> PromptDataset:
    return PromptDataset.from_rows(rows, tokenizer, prompt_field=field, max_prompt_tokens=limit,
                                   key="data.train", source="train.jsonl")


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_batch_from_a_jsonl_file(tmp_path: Path, tokenizer: PromptTokenizer) -> None:
    rows = [{"question": "Hi", "answer": "1"}, {"question": "What is 12 + 7? Think.", "answer": "19"},
            {"question": "Hello world", "answer": "x"}]
    path = _write_jsonl(tmp_path / "train.jsonl", rows)
    data = PromptDataset.from_rows(load_rows(path, key="data.train"), tokenizer, prompt_field="question",
                                   max_prompt_tokens=100, key="data.train", source=str(path))
    assert len(data) == 3 and data.dropped == 0
    batch = data.batch([1, 0], first_uid=40)
    assert set(batch) == {*ENGINE_COLUMNS, "answer"}
    ids = [tokenizer.encode_text(rows[i]["question"]) for i in (1, 0)]
    width = max(map(len, ids))
    assert batch["prompt_ids"].dtype == batch["prompt_mask"].dtype == batch["uid"].dtype == torch.int64
    assert batch["prompt_ids"].shape == batch["prompt_mask"].shape == (2, width)
    for r, row_ids in enumerate(ids):  # left-padded with the pad id
        pad = width - len(row_ids)
        assert batch["prompt_ids"][r].tolist() == [tokenizer.pad_token_id] * pad + row_ids
        assert batch["prompt_mask"][r].tolist() == [0] * pad + [1] * len(row_ids)
    assert batch["uid"].tolist() == [40, 41]
    decoded = [tokenizer.decode(r) for r in batch["prompt_ids"].tolist()]
    assert decoded == ["What is 12 + 7? Think.", "Hi"]
    assert data.prompts == [r["question"] for r in rows] and data.row_numbers == [1, 2, 3]


def test_carried_fields_reach_row_columns_as_written(tokenizer: PromptTokenizer) -> None:
    rows = [
        {"question": "Hi", "answer": "5", "level": 1, "exact": True, "weight": 0.5, "mixed": 2,
         "tags": ["add", "easy"], "meta": {"src": "gsm", "n": 1}, "note": None, "text_or_null": "ünï 🙂"},
        {"question": "Hello", "answer": "#### 24", "level": -3, "exact": False, "weight": 1e-3, "mixed": 2.5,
         "tags": [], "meta": {}, "note": None, "text_or_null": None},
    ]
    data = _dataset(rows, tokenizer)
    assert data.kinds == {"answer": "text", "level": "int", "exact": "bool", "weight": "float", "mixed": "float",
                          "tags": "json", "meta": "json", "note": "json", "text_or_null": "json"}
    batch = data.batch([0, 1], first_uid=0)
    assert batch["level"].dtype == torch.int64 and batch["exact"].dtype == torch.bool
    assert batch["weight"].dtype == torch.float64 and batch["answer"].dtype == torch.uint8
    carried = {k: v for k, v in batch.items() if k not in ENGINE_COLUMNS}
    columns = row_columns(carried, tokenizer)
    for name in ("answer", "level", "exact", "weight", "mixed"):
        assert columns[name] == [r[name] for r in rows], name
    assert type(columns["level"][0]) is int and type(columns["exact"][0]) is bool
    for name in ("tags", "meta", "note", "text_or_null"):  # JSON text, read back with json.loads
        assert [json.loads(v) for v in columns[name]] == [r[name] for r in rows], name
    assert "question" not in columns, "the prompt reaches the reward decoded from prompt_ids"
    assert data.describe().endswith("; fields for the reward: answer (text), level (int), exact (bool), "
                                    "weight (float), mixed (float), tags (JSON text), meta (JSON text), "
                                    "note (JSON text), text_or_null (JSON text)")


def test_every_file_kind_gives_the_same_batch(tmp_path: Path, tokenizer: PromptTokenizer) -> None:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"question": "What is 2 + 3?", "answer": "5"}, {"question": "Hello world", "answer": "hi"}]
    _write_jsonl(tmp_path / "a.jsonl", rows)
    (tmp_path / "b.json").write_text(json.dumps(rows), encoding="utf-8")
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "c.parquet")
    (tmp_path / "d.csv").write_text("question,answer\nWhat is 2 + 3?,5\nHello world,hi\n", encoding="utf-8")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "e"))
    batches = []
    for name in ("a.jsonl", "b.json", "c.parquet", "d.csv", "e"):
        loaded = load_rows(tmp_path / name, key="data.train")
        batches.append(_dataset(loaded, tokenizer).batch([0, 1], first_uid=0))
    for batch in batches[1:]:
        assert batch.keys() == batches[0].keys()
        for name, column in batch.items():
            assert torch.equal(column, batches[0][name]), name


def test_chat_prompts_go_through_the_chat_template(hf_dir: Path, tokenizer: PromptTokenizer) -> None:
    chats = [[{"role": "user", "content": "What is 2 + 3?"}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]]
    data = _dataset([{"question": chat, "answer": str(i)} for i, chat in enumerate(chats)], tokenizer)
    reference = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    expected = [reference.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False)
                for c in chats]
    assert data.prompt_ids == expected
    batch = data.batch([0, 1], first_uid=0)
    for r, ids in enumerate(expected):
        real = batch["prompt_mask"][r].bool()
        assert batch["prompt_ids"][r][real].tolist() == ids


def test_long_prompts_are_dropped_and_counted(tokenizer: PromptTokenizer) -> None:
    rows = [{"question": q, "answer": str(i)} for i, q in
            enumerate(["Hi", "Hello world, how are you today? Fine, thanks! " * 3, "Hello", "What is " * 20])]
    limit = max(len(tokenizer.encode_text(q)) for q in ("Hi", "Hello"))
    data = _dataset(rows, tokenizer, limit=limit)
    assert len(data) == 2 and data.dropped == 2 and data.total_rows == 4
    assert data.row_numbers == [1, 3] and data.longest_prompt <= limit
    assert row_columns({"answer": data.batch([0, 1], first_uid=0)["answer"]}, tokenizer) == {"answer": ["0", "2"]}
    assert data.describe() == (f"data.train: 2 prompts from train.jsonl (2 of 4 rows dropped as longer than "
                               f"{limit} prompt tokens), longest {data.longest_prompt} tokens; fields for the "
                               "reward: answer (text)")


def test_char_tokenizer_prompts(tmp_path: Path) -> None:
    tokenizer = load_prompt_tokenizer(save_tiny_model(tmp_path, TinyModelConfig()))
    data = _dataset([{"question": "12+3=", "answer": "15"}, {"question": "4*5=", "answer": "20"}], tokenizer)
    assert data.prompt_ids == [tokenizer.encode_text("12+3="), tokenizer.encode_text("4*5=")]
    batch = data.batch([1, 0], first_uid=0)
    assert batch["prompt_ids"][0, 0].item() == tokenizer.pad_token_id == 0
    assert data.describe().startswith("data.train: 2 prompts from train.jsonl, longest 6 tokens")


def test_no_carried_fields(tokenizer: PromptTokenizer) -> None:
    data = _dataset([{"question": "Hi"}], tokenizer)
    assert set(data.batch([0], first_uid=0)) == set(ENGINE_COLUMNS)
    assert data.describe().endswith("; no fields for the reward besides the prompt")


# ----- errors


def test_row_without_the_prompt_field_names_its_row(tmp_path: Path, tokenizer: PromptTokenizer) -> None:
    rows = [{"question": "Hi", "answer": "1"}] * 2 + [{"prompt": "Hi", "answer": "1"}]
    path = _write_jsonl(tmp_path / "train.jsonl", rows)
    with pytest.raises(ConfigError, match=f"^data.train: {path}: row 3 has no prompt field 'question'; its "
                                          "fields are 'prompt', 'answer'$"):
        PromptDataset.from_rows(load_rows(path, key="data.train"), tokenizer, prompt_field="question",
                                max_prompt_tokens=50, key="data.train", source=str(path))


def test_prompt_field_absent_from_the_first_row(tokenizer: PromptTokenizer) -> None:
    with pytest.raises(ConfigError, match="row 1 has no prompt field 'prompt'; its fields are 'question', "
                                          "'answer': name one of them as the prompt field"):
        _dataset([{"question": "Hi", "answer": "1"}], tokenizer, field="prompt")


@pytest.mark.parametrize("prompt, problem", [
    (7, " holds a number; a prompt is text or a list of chat messages"),
    (None, " holds null; a prompt is text"),
    ({"role": "user", "content": "Hi"}, " holds an object; a prompt is text"),
    (["Hi", "there"], ": message 0 is a str, not an object; chat messages are"),
    ([{"role": "user"}], ": message 0 has no text 'content'; chat messages are"),
    ([], ": the chat message list is empty"),
    ("   ", ": the prompt is empty"),
])
def test_wrong_prompt_names_row_and_field(tokenizer: PromptTokenizer, prompt: Any, problem: str) -> None:
    rows = [{"question": "Hi"}, {"question": prompt}]
    with pytest.raises(ConfigError, match=r"^data\.train: train\.jsonl: row 2, field 'question'" + problem):
        _dataset(rows, tokenizer)


@pytest.mark.parametrize("name", ["prompt_ids", "uid", "response_mask", "scores", "advantages", "answer_ids",
                                  "label_mask", "ref_logprobs", "prompts", "completions", "_hidden", "a/b"])
def test_field_named_like_an_engine_column(tokenizer: PromptTokenizer, name: str) -> None:
    with pytest.raises(ConfigError, match=f"^data.train: train.jsonl: the field '{name}' .*; rename it in the "
                                          "file$"):
        _dataset([{"question": "Hi", name: 1}], tokenizer)


def test_rows_with_different_fields(tokenizer: PromptTokenizer) -> None:
    rows = [{"question": "Hi", "answer": "1"}, {"question": "Hello", "answer": "2"}, {"question": "Hey"}]
    with pytest.raises(ConfigError, match="row 3 lacks the field 'answer' that row 1 has; every row needs"):
        _dataset(rows, tokenizer)
    rows = [{"question": "Hi"}, {"question": "Hello", "answer": "2"}]
    with pytest.raises(ConfigError, match="row 2 has the field 'answer' that row 1 lacks"):
        _dataset(rows, tokenizer)


def test_every_prompt_too_long(tokenizer: PromptTokenizer) -> None:
    rows = [{"question": "Hello world"}, {"question": "What is 2 + 3?"}]
    shortest = len(tokenizer.encode_text("Hello world"))
    with pytest.raises(ConfigError, match=f"^data.train: train.jsonl: all 2 prompts are longer than 2 tokens "
                                          f"\\(the shortest has {shortest}\\); raise the prompt length limit"):
        _dataset(rows, tokenizer, limit=2)


def test_chat_prompt_with_a_tokenizer_without_template(tmp_path: Path) -> None:
    tokenizer = load_prompt_tokenizer(save_tiny_hf_tokenizer(tmp_path, chat_template=False))
    rows = [{"question": "Hi"}, {"question": [{"role": "user", "content": "Hi"}]}]
    with pytest.raises(ConfigError, match=f"^data.train: train.jsonl: row 2, field 'question': the prompt "
                                          f"holds chat messages but the model at {tmp_path} has no chat template"):
        _dataset(rows, tokenizer)


def test_char_tokenizer_text_outside_its_alphabet(tmp_path: Path) -> None:
    tokenizer = load_prompt_tokenizer(save_tiny_model(tmp_path, TinyModelConfig()))
    with pytest.raises(ConfigError, match=r"^data\.train: train\.jsonl: row 2, field 'question': text '1\+x=' "
                                          r"holds 'x' at position 2"):
        _dataset([{"question": "1+1="}, {"question": "1+x="}], tokenizer)


def test_text_field_with_nul(tokenizer: PromptTokenizer) -> None:
    with pytest.raises(ConfigError, match="row 2, field 'answer' holds a NUL character"):
        _dataset([{"question": "Hi", "answer": "1"}, {"question": "Hello", "answer": "a\0b"}], tokenizer)


def test_bad_limit_and_no_rows(tokenizer: PromptTokenizer) -> None:
    with pytest.raises(ConfigError, match="the prompt length limit must be >= 1 token, got 0"):
        _dataset([{"question": "Hi"}], tokenizer, limit=0)
    with pytest.raises(ConfigError, match=r"^data\.train: train\.jsonl holds no rows$"):
        _dataset([], tokenizer)


def test_every_batch_of_a_dataset_has_the_same_widths(tokenizer: PromptTokenizer) -> None:
    """A run's batches can be joined (partial rollouts, DAPO's concatenation): the
    prompts are as wide as the dataset's longest, text fields as its longest text."""
    rows = [{"question": "Hi", "answer": "1", "tags": []},
            {"question": "What is 12 + 7? Think.", "answer": "nineteen", "tags": ["add", "two digits"]},
            {"question": "Hello world", "answer": "é", "tags": ["x"]}]
    data = _dataset(rows, tokenizer)
    longest = max(len(tokenizer.encode_text(r["question"])) for r in rows)
    assert data.longest_prompt == longest and data.text_widths == {"answer": 8, "tags": 21}
    batches = [data.batch([i], first_uid=i) for i in range(3)]
    for name in batches[0]:
        assert {tuple(b[name].shape) for b in batches} == {tuple(batches[0][name].shape)}, name
    assert batches[0]["prompt_ids"].shape == (1, longest)
    for i, batch in enumerate(batches):
        assert tokenizer.decode(batch["prompt_ids"][0].tolist()) == rows[i]["question"]
        columns = row_columns({k: v for k, v in batch.items() if k not in ENGINE_COLUMNS}, tokenizer)
        assert columns["answer"] == [rows[i]["answer"]]
        assert [json.loads(t) for t in columns["tags"]] == [rows[i]["tags"]]


def test_batch_indices(tokenizer: PromptTokenizer) -> None:
    data = _dataset([{"question": "Hi"}], tokenizer)
    with pytest.raises(IndexError, match=r"data\.train: row index 1 is outside \[0, 1\)"):
        data.batch([0, 1], first_uid=0)
    with pytest.raises(ValueError, match="a batch needs at least one row index"):
        data.batch([], first_uid=0)
