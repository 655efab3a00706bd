"""load_rows on real files of every supported kind (written with the real json,
csv, pyarrow and datasets libraries) and every error it reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from channels import ConfigError
from workers.data import load_rows
from workers.data._files import SUFFIXES

ROWS = [
    {"question": "What is 2 + 3?", "answer": "5", "level": 1, "hard": False, "score": 0.5,
     "tags": ["add"], "meta": {"src": "gsm"}},
    {"question": "What is 4 * 6?", "answer": "24", "level": 2, "hard": True, "score": 1.5,
     "tags": ["mul", "easy"], "meta": {"src": "mine"}},
]


def _write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_jsonl_rows_in_order_skipping_blank_lines(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "train.jsonl", [json.dumps(ROWS[0]), "", json.dumps(ROWS[1])])
    assert load_rows(path, key="data.train") == ROWS


def test_json_list_and_json_lines(tmp_path: Path) -> None:
    listed = tmp_path / "list.json"
    listed.write_text(json.dumps(ROWS, indent=2), encoding="utf-8")
    assert load_rows(listed, key="data.eval") == ROWS
    lines = _write_jsonl(tmp_path / "lines.json", [json.dumps(r) for r in ROWS])
    assert load_rows(lines, key="data.eval") == ROWS


def test_json_lines_with_a_byte_order_mark(tmp_path: Path) -> None:
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(ROWS[0]).encode() + b"\n")
    assert load_rows(path, key="data.train") == ROWS[:1]


def test_parquet_keeps_types_and_nesting(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    assert load_rows(path, key="data.train") == ROWS


def test_csv_values_stay_text(tmp_path: Path) -> None:
    path = tmp_path / "train.csv"
    path.write_text('question,answer,level\n"What is 2, plus 3?",5,1\n\nWhat is 4 * 6?,024,2\n',
                    encoding="utf-8")
    assert load_rows(path, key="data.train") == [
        {"question": "What is 2, plus 3?", "answer": "5", "level": "1"},
        {"question": "What is 4 * 6?", "answer": "024", "level": "2"},
    ]


def test_save_to_disk_directory_and_single_split_dict(tmp_path: Path) -> None:
    import datasets

    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "ds"))
    assert load_rows(tmp_path / "ds", key="data.train") == ROWS
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "dd"))
    assert load_rows(tmp_path / "dd", key="data.train") == ROWS


def test_dataset_dict_with_several_splits_names_them(tmp_path: Path) -> None:
    import datasets

    splits = {"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS[:1])}
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ConfigError, match=r"^data\.train: .*dd holds the splits test, train; point data\.train "
                                          r"at one split's directory, e\.g\. .*dd/test$"):
        load_rows(tmp_path / "dd", key="data.train")
    assert load_rows(tmp_path / "dd" / "test", key="data.train") == ROWS[:1]


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    with pytest.raises(ConfigError, match=f"^data.train: {path} does not exist$"):
        load_rows(path, key="data.train")


def test_relative_missing_file_says_where_it_looked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=f"^data.eval: eval.jsonl does not exist \\(relative to {tmp_path}\\)$"):
        load_rows("eval.jsonl", key="data.eval")


def test_unsupported_suffix_lists_the_supported_ones(tmp_path: Path) -> None:
    path = tmp_path / "train.txt"
    path.write_text("What is 2 + 3?\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"unsupported suffix '\.txt'; supported are \.jsonl, \.json, "
                                          r"\.parquet, \.csv and directories") as e:
        load_rows(path, key="data.train")
    assert str(e.value).startswith(f"data.train: {path} ") and "\n" not in str(e.value)
    assert SUFFIXES == (".jsonl", ".json", ".parquet", ".csv")


@pytest.mark.parametrize("name, content", [("empty.jsonl", ""), ("blank.jsonl", "\n\n"), ("empty.json", "[]"),
                                           ("header.csv", "question,answer\n"), ("empty.csv", "")])
def test_file_without_rows(tmp_path: Path, name: str, content: str) -> None:
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ConfigError, match=f"^data.train: {path} holds no rows$"):
        load_rows(path, key="data.train")


def test_empty_parquet(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"question": pa.array([], pa.string())}), path)
    with pytest.raises(ConfigError, match="holds no rows"):
        load_rows(path, key="data.train")


def test_malformed_json_line_names_its_line(tmp_path: Path) -> None:
    lines = [json.dumps(ROWS[0])] * 6 + ['{"question": "What is 1 + 1?", "answer": 2']
    path = _write_jsonl(tmp_path / "train.jsonl", lines)
    with pytest.raises(ConfigError, match=f"^data.train: {path}: line 7: not valid JSON: Expecting ',' "
                                          "delimiter \\(column 43\\)"):
        load_rows(path, key="data.train")


def test_malformed_json_list_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "train.json"
    path.write_text('[\n  {"question": "a"},\n  {"question": }\n]', encoding="utf-8")
    with pytest.raises(ConfigError, match=r"train\.json: line 3: not valid JSON: Expecting value"):
        load_rows(path, key="data.train")


def test_json_object_over_several_lines(tmp_path: Path) -> None:
    path = tmp_path / "train.json"
    path.write_text(json.dumps({"data": ROWS}, indent=2), encoding="utf-8")
    with pytest.raises(ConfigError, match="holds one JSON object over several lines; write a list"):
        load_rows(path, key="data.train")


@pytest.mark.parametrize("line, kind", [('["What is 2 + 3?", "5"]', "array"), ('"What is 2 + 3?"', "string"),
                                        ("null", "null"), ("7", "number")])
def test_json_line_that_is_not_an_object(tmp_path: Path, line: str, kind: str) -> None:
    path = _write_jsonl(tmp_path / "train.jsonl", [json.dumps(ROWS[0]), line])
    with pytest.raises(ConfigError, match=f"^data.train: {path}: line 2 holds a JSON {kind}, not an object"):
        load_rows(path, key="data.train")


def test_json_list_item_that_is_not_an_object(tmp_path: Path) -> None:
    path = tmp_path / "train.json"
    path.write_text(json.dumps([ROWS[0], "oops"]), encoding="utf-8")
    with pytest.raises(ConfigError, match="item 1 of the list holds a JSON string, not an object"):
        load_rows(path, key="data.train")


def test_non_utf8_file(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_bytes(b'{"question": "caf\xe9"}\n')
    with pytest.raises(ConfigError, match=r"is not UTF-8 text \(byte 17 is 0xe9\); save it as UTF-8"):
        load_rows(path, key="data.train")


def test_csv_row_with_wrong_number_of_fields(tmp_path: Path) -> None:
    path = tmp_path / "train.csv"
    path.write_text("question,answer\nWhat is 2 + 3?,5\nWhat is 2, plus 3?,5\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=f"^data.train: {path}: line 3 has 3 fields, the header 2 "
                                          r"\(question, answer\); quote values that hold commas$"):
        load_rows(path, key="data.train")


@pytest.mark.parametrize("header, problem", [("question,,answer", "has an empty name for column 2"),
                                             ("question,answer,answer", "names the column 'answer' twice")])
def test_csv_bad_header(tmp_path: Path, header: str, problem: str) -> None:
    path = tmp_path / "train.csv"
    path.write_text(f"{header}\na,b,c\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=f"line 1 \\(the header\\) {problem}"):
        load_rows(path, key="data.train")


def test_unreadable_parquet(tmp_path: Path) -> None:
    path = tmp_path / "train.parquet"
    path.write_text("not parquet", encoding="utf-8")
    with pytest.raises(ConfigError, match=f"^data.train: {path} is not a readable Parquet file: "):
        load_rows(path, key="data.train")


def test_directory_that_is_no_dataset(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    with pytest.raises(ConfigError, match="is a directory, but not one written by datasets' save_to_disk"):
        load_rows(tmp_path / "data", key="data.train")
