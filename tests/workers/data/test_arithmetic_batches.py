"""Token batches of the arithmetic task: prompt batches, SFT examples, decoding, batching."""

from __future__ import annotations

import itertools

import pytest
import torch

from channels import ConfigError
from workers.data import (
    ArithmeticProblem,
    batch_widths,
    check_fits_context,
    decode_responses,
    iter_problem_batches,
    prompt_batch,
    sft_batch,
)
from workers.models import CharTokenizer

TOKENIZER = CharTokenizer()
PROBLEMS = [
    ArithmeticProblem(left=95, operator="+", right=7),  # prompt 5 chars, answer 3
    ArithmeticProblem(left=12, operator="+", right=34),  # prompt 6 chars, answer 2
    ArithmeticProblem(left=3, operator="+", right=4),  # prompt 4 chars, answer 1
]


def _ids(text: str, *, bos: bool) -> list[int]:
    return TOKENIZER.encode(text, add_bos=bos)


def test_prompt_batch_is_left_padded_with_uids_and_right_padded_answers() -> None:
    batch = prompt_batch(PROBLEMS, TOKENIZER, first_uid=40)
    assert set(batch) == {"prompt_ids", "prompt_mask", "uid", "answer_ids"}
    assert all(t.dtype == torch.int64 for t in batch.values())
    assert batch["prompt_ids"].shape == batch["prompt_mask"].shape == (3, 7)  # <bos> + 6
    pad = TOKENIZER.pad_token_id
    assert batch["prompt_ids"][0].tolist() == [pad, *_ids("95+7=", bos=True)]
    assert batch["prompt_mask"][0].tolist() == [0, 1, 1, 1, 1, 1, 1]
    assert batch["prompt_ids"][1].tolist() == _ids("12+34=", bos=True)
    assert batch["prompt_mask"][2].tolist() == [0, 0, 1, 1, 1, 1, 1]
    assert batch["uid"].tolist() == [40, 41, 42]
    assert batch["answer_ids"].tolist() == [
        _ids("102", bos=False),
        [*_ids("46", bos=False), pad],
        [*_ids("7", bos=False), pad, pad],
    ]


def test_sft_batch_trains_on_answer_and_eos_only() -> None:
    batch = sft_batch(PROBLEMS, TOKENIZER)
    assert set(batch) == {"prompt_ids", "prompt_mask", "response_ids", "response_mask"}
    assert all(t.dtype == torch.int64 for t in batch.values())
    assert torch.equal(batch["prompt_ids"], prompt_batch(PROBLEMS, TOKENIZER)["prompt_ids"])
    eos, pad = TOKENIZER.eos_token_id, TOKENIZER.pad_token_id
    assert batch["response_ids"].tolist() == [
        [*_ids("102", bos=False), eos],
        [*_ids("46", bos=False), eos, pad],
        [*_ids("7", bos=False), eos, pad, pad],
    ]
    assert batch["response_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]]


def test_decode_responses_keeps_eos_and_drops_padding() -> None:
    eos = TOKENIZER.eos_token_id
    six = _ids("6", bos=False)[0]
    ids = torch.tensor([[*_ids("46", bos=False), eos, 0], [*_ids("1", bos=False), eos, six, six]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    assert decode_responses(ids, mask, TOKENIZER) == ["46<eos>", "1<eos>66"]


def test_batches_of_a_runs_widths_have_one_shape() -> None:
    widths = batch_widths(PROBLEMS, TOKENIZER)
    assert widths == (7, 3)
    batches = [prompt_batch([p], TOKENIZER, first_uid=i, widths=widths) for i, p in enumerate(PROBLEMS)]
    assert {b["prompt_ids"].shape for b in batches} == {b["prompt_mask"].shape for b in batches} == {(1, 7)}
    assert {b["answer_ids"].shape for b in batches} == {(1, 3)}
    alone = prompt_batch(PROBLEMS, TOKENIZER)
    for i, batch in enumerate(batches):  # the rows are the whole list's own rows
        for name in ("prompt_ids", "prompt_mask", "answer_ids"):
            assert torch.equal(batch[name][0], alone[name][i]), name
    assert prompt_batch([PROBLEMS[2]], TOKENIZER)["answer_ids"].shape == (1, 1)  # by default the batch's own
    with pytest.raises(ConfigError, match="a row of 7 tokens does not fit the width of 6"):
        prompt_batch(PROBLEMS, TOKENIZER, widths=(6, 3))


def test_empty_problem_lists_raise_config_errors() -> None:
    with pytest.raises(ConfigError, match="no problems"):
        prompt_batch([], TOKENIZER)
    with pytest.raises(ConfigError, match="no problems"):
        sft_batch([], TOKENIZER)


def test_problem_batches_are_seeded_epochs_of_full_batches() -> None:
    problems = [ArithmeticProblem(left=i, operator="+", right=0) for i in range(10)]
    batches = list(itertools.islice(iter_problem_batches(problems, 3, seed=1), 6))
    assert all(len(batch) == 3 for batch in batches)
    first_epoch = [p for batch in batches[:3] for p in batch]
    assert len(set(first_epoch)) == 9  # one epoch: 3 full batches, no repeats
    again = list(itertools.islice(iter_problem_batches(problems, 3, seed=1), 6))
    assert again == batches
    with pytest.raises(ConfigError, match="train_size"):
        iter_problem_batches(problems, 11, seed=0)
    with pytest.raises(ConfigError, match="batch_size"):
        iter_problem_batches(problems, 0, seed=0)


def test_check_fits_context_names_the_settings() -> None:
    check_fits_context(PROBLEMS, TOKENIZER, max_new_tokens=4, max_positions=11)
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        check_fits_context(PROBLEMS, TOKENIZER, max_new_tokens=4, max_positions=10)
