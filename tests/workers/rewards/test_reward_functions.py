"""Rule reward functions in-process (no Ray): the keyword (TRL) and positional call
forms, columns, weights, async functions, the built-in verifiers and every error."""

from __future__ import annotations

import asyncio
import math
import re
import threading
import time

import pytest
import torch

from channels import ConfigError, SchemaError
from workers.models import CharTokenizer
from workers.rewards import (
    FormatCheck,
    RewardFunctionError,
    RewardTimeoutError,
    RuleRewardConfig,
    RuleScorer,
    ScoreInputs,
    arithmetic_reward,
    exact_match,
    format_check,
    numeric_match,
    row_columns,
    text_column,
)
from workers.rewards._calling import call_style, function_labels
from workers.rewards._decode import UNKNOWN_TOKEN_TEXT, decode_rows
from workers.rewards._verifiers import extract_number

TOK = CharTokenizer()
PAD, EOS = TOK.pad_token_id, TOK.eos_token_id


def _left(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    return (torch.tensor([[PAD] * (width - len(r)) + r for r in rows]),
            torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows]))


def _right(rows: list[list[int]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor([r + [PAD] * (width - len(r)) for r in rows]),
            torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows]))


def make_inputs(prompts: list[str], completions: list[str], answers: list[str] | None = None,
                **columns: torch.Tensor) -> ScoreInputs:
    prompt_ids, prompt_mask = _left([TOK.encode(p) for p in prompts])
    response_ids, response_mask = _right([[*TOK.encode(c, add_bos=False), EOS] for c in completions], 10)
    answer_ids = None if answers is None else _right([TOK.encode(a, add_bos=False) for a in answers], 4)[0]
    return ScoreInputs(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                       response_mask=response_mask, answer_ids=answer_ids,
                       uids=torch.arange(100, 100 + len(prompts)), columns=columns)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(TOK.save_pretrained(tmp_path_factory.mktemp("tok")))


def _scorer(fn, tokenizer_dir: str, weights=None) -> RuleScorer:
    return RuleRewardConfig(fn=fn, tokenizer_dir=tokenizer_dir, weights=weights).build(torch.device("cpu"))


# ----- call forms and columns


def test_call_style_is_read_from_the_signature() -> None:
    def trl(prompts, completions, **kwargs): ...
    def named(completions, answer): ...
    def kwargs_only(**kwargs): ...
    def old(prompts, responses, answers): ...
    def old_with_kwargs(prompts, responses, answers, **kwargs): ...

    assert [call_style(f) for f in (trl, named, kwargs_only, exact_match, format_check)] == ["keyword"] * 5
    assert [call_style(f) for f in (old, old_with_kwargs, arithmetic_reward, len)] == ["positional"] * 4


def test_keyword_form_gets_prompts_completions_and_every_column(tokenizer_dir: str) -> None:
    seen = {}

    def fn(prompts, completions, **columns):
        seen.update(prompts=prompts, completions=completions, **columns)
        return [len(c) for c in completions]

    inputs = make_inputs(["1+2=", "7*3="], ["3", "22"], ["3", "21"],
                         difficulty=torch.tensor([0.5, 2.0]), level=torch.tensor([1, 3]),
                         ok=torch.tensor([True, False]), solution=text_column(["one plus two", "seven é 3"]),
                         hint_ids=_right([TOK.encode("1", add_bos=False), TOK.encode("2", add_bos=False)], 3)[0],
                         pair=torch.tensor([[1, 2], [3, 4]]))
    scores = _scorer(fn, tokenizer_dir)(inputs)
    assert scores.tolist() == [1.0, 2.0]
    assert seen == {"prompts": ["1+2=", "7*3="], "completions": ["3", "22"], "answer": ["3", "21"],
                    "difficulty": [0.5, 2.0], "level": [1, 3], "ok": [True, False],
                    "solution": ["one plus two", "seven é 3"], "hint": ["1", "2"], "pair": [[1, 2], [3, 4]]}
    assert type(seen["level"][0]) is int and type(seen["difficulty"][0]) is float


def test_a_keyword_fn_without_kwargs_gets_only_what_it_names(tokenizer_dir: str) -> None:
    def fn(completions, answer, scale=2.0):
        return [scale * (c == a) for c, a in zip(completions, answer, strict=True)]

    inputs = make_inputs(["1=", "2="], ["1", "3"], ["1", "2"], difficulty=torch.tensor([1.0, 2.0]))
    assert _scorer(fn, tokenizer_dir)(inputs).tolist() == [2.0, 0.0]


def test_no_answer_ids_needed_when_the_fn_does_not_take_answers(tokenizer_dir: str) -> None:
    def length(prompts, completions, **kwargs):
        assert "answer" not in kwargs
        return [float(len(c)) for c in completions]

    assert _scorer(length, tokenizer_dir)(make_inputs(["1="], ["123"])).tolist() == [3.0]


def test_a_missing_named_column_says_which_and_how_to_add_it(tokenizer_dir: str) -> None:
    def fn(completions, solution):
        return [0.0] * len(completions)

    with pytest.raises(SchemaError, match=r"takes 'solution', but the rows have no such column .*'solution_ids'"):
        _scorer(fn, tokenizer_dir)(make_inputs(["1="], ["1"], ["1"]))


def test_positional_form_still_needs_answer_ids(tokenizer_dir: str) -> None:
    with pytest.raises(SchemaError, match="answer_ids"):
        _scorer(arithmetic_reward, tokenizer_dir)(make_inputs(["1="], ["1"]))


def test_an_explicit_text_column_wins_over_decoding_its_ids() -> None:
    ids = _right([TOK.encode("1", add_bos=False)], 2)[0]
    assert row_columns({"answer_ids": ids, "answer": text_column(["one"])}, TOK) == {"answer": ["one"]}
    with pytest.raises(SchemaError, match="'x_ids' must hold int64"):
        row_columns({"x_ids": torch.zeros(1, 2)}, TOK)
    with pytest.raises(SchemaError, match="NUL"):
        text_column(["a\0b"])


def test_a_text_column_of_a_given_width() -> None:
    column = text_column(["é", "ab"], width=5)  # "é" takes two bytes
    assert column.shape == (2, 5)
    assert row_columns({"answer": column}, TOK) == {"answer": ["é", "ab"]}
    assert text_column(["abc"]).shape == (1, 3) and text_column([""]).shape == (1, 1)
    with pytest.raises(SchemaError, match="text 1 takes 3 bytes in UTF-8, more than the column's width of 2"):
        text_column(["a", "abc"], width=2)


def test_ids_outside_the_tokenizer_decode_as_replacement_characters(tokenizer_dir: str) -> None:
    big = TOK.vocab_size + 4  # a model vocabulary padded past the tokenizer's alphabet
    one, two = TOK.encode("1", add_bos=False)[0], TOK.encode("2", add_bos=False)[0]
    assert decode_rows(TOK, [[one, big, two, -1]]) == [f"1{UNKNOWN_TOKEN_TEXT}2{UNKNOWN_TOKEN_TEXT}"]
    inputs = make_inputs(["1="], ["1"], ["1"])
    response = inputs.response_ids.clone()
    response[0, 1] = big  # in place of EOS
    odd = ScoreInputs(prompt_ids=inputs.prompt_ids, prompt_mask=inputs.prompt_mask, response_ids=response,
                      response_mask=inputs.response_mask, answer_ids=inputs.answer_ids)
    scorer = _scorer(exact_match, tokenizer_dir)
    assert scorer.batch(odd).completions == [f"1{UNKNOWN_TOKEN_TEXT}"]
    assert scorer(odd).tolist() == [0.0]


# ----- weights, async


def test_weighted_functions_sum_and_keep_each_score(tokenizer_dir: str) -> None:
    spaced = FormatCheck(r"^\s", name="spaced")
    scorer = _scorer(["workers.rewards:exact_match", spaced, exact_match], tokenizer_dir, weights=[1.0, 0.5, -2])
    inputs = make_inputs(["1=", "2=", "3="], ["3", " 4", "9"], ["3", "4", "5"])
    total, parts = scorer.score(inputs)
    assert list(parts) == ["exact_match", "spaced", "exact_match_2"]
    assert parts["exact_match"].tolist() == [1.0, 1.0, 0.0]
    assert parts["spaced"].tolist() == [0.0, 1.0, 0.0]
    assert total.tolist() == [-1.0, -0.5, 0.0]
    assert RuleRewardConfig(tokenizer_dir="t", fn=["m:f", "n:f", "o:g"]).labels == ("f", "f_2", "g")


def test_async_functions_are_awaited(tokenizer_dir: str) -> None:
    async def judge(prompts, completions, answer, **kwargs):
        await asyncio.sleep(0)
        return [float(c == a) for c, a in zip(completions, answer, strict=True)]

    scorer = _scorer([judge, "workers.rewards:exact_match"], tokenizer_dir, weights=[2.0, 1.0])
    inputs = make_inputs(["1=", "2="], ["1", "3"], ["1", "2"])
    assert scorer(inputs).tolist() == [3.0, 0.0]

    async def inside_a_loop() -> list[float]:  # an in-process caller running its own event loop
        return scorer(inputs).tolist()

    assert asyncio.run(inside_a_loop()) == [3.0, 0.0]


def test_weight_and_fn_checks_name_the_field() -> None:
    with pytest.raises(ConfigError, match=r"weights must be a list of 2 numbers"):
        RuleRewardConfig(tokenizer_dir="t", fn=["a:b", "c:d"], weights=[1.0])
    with pytest.raises(ConfigError, match=r"weights\[1\] must be a finite number"):
        RuleRewardConfig(tokenizer_dir="t", fn=["a:b", "c:d"], weights=[1.0, math.inf])
    with pytest.raises(ConfigError, match=r"fn\[1\] must be a 'module:function' string"):
        RuleRewardConfig(tokenizer_dir="t", fn=["a:b", "nocolon"])
    with pytest.raises(ConfigError, match=r"non-empty list"):
        RuleRewardConfig(tokenizer_dir="t", fn=[])
    assert function_labels([lambda: 0, lambda: 0]) == ("lambda", "lambda_2")


# ----- errors


def _raises_on_seven(prompts, completions, **columns):
    return [1.0 / (c != "7") for c in completions]


def test_a_raising_keyword_fn_names_itself_the_row_and_an_excerpt(tokenizer_dir: str) -> None:
    inputs = make_inputs(["1=", "2=", "3=" * 40], ["1", "2", "7"])
    with pytest.raises(RewardFunctionError) as info:
        _scorer(["workers.rewards:format_check", _raises_on_seven], tokenizer_dir)(inputs)
    msg = str(info.value)
    assert "test_reward_functions:_raises_on_seven raised on sample 2 of the 3" in msg and "(uid 102)" in msg
    assert "ZeroDivisionError" in msg and "completion='7'" in msg and "prompt='3=3=3=" in msg
    assert "...'" in msg and "\n" not in msg  # the long prompt is cut; one line


@pytest.mark.parametrize("result, match", [
    ([1.0], "returned 1 scores for 2 samples"),
    ([1.0, float("nan")], r"returned nan \(float\) as score 1"),
    ([float("inf"), 1.0], r"returned inf \(float\) as score 0"),
    ({"a": 1}, "returned a dict"),
])
def test_bad_results_name_the_function_and_what_came_back(tokenizer_dir: str, result, match: str) -> None:
    def bad(prompts, completions, **kw):
        return result

    with pytest.raises(RewardFunctionError, match=rf"reward function .*bad {match}"):
        _scorer([exact_match, bad], tokenizer_dir)(make_inputs(["1=", "2="], ["1", "2"], ["1", "2"]))


def test_an_async_fn_that_raises_is_located_too(tokenizer_dir: str) -> None:
    async def picky(prompts, completions, **kw):
        if "2" in completions:
            raise ValueError("no twos")
        return [0.0] * len(completions)

    with pytest.raises(RewardFunctionError, match=r"picky raised on sample 1 of the 2 .*ValueError: no twos"):
        _scorer(picky, tokenizer_dir)(make_inputs(["1=", "2="], ["1", "2"]))


# ----- timeouts


@pytest.fixture
def release():
    """Set at the end of the test: what a stuck function waits for (its thread runs
    on past its timeout, and ends then)."""
    event = threading.Event()
    yield event
    event.set()


def _timed(fn, tokenizer_dir: str, timeout_s: float | None) -> RuleScorer:
    return RuleRewardConfig(fn=fn, tokenizer_dir=tokenizer_dir, timeout_s=timeout_s).build(torch.device("cpu"))


@pytest.mark.parametrize("form", ["sync", "async"])
def test_a_fn_past_its_timeout_fails_naming_it_and_the_samples(tokenizer_dir: str, release, form: str) -> None:
    def stuck(prompts, completions, **kw):
        release.wait(60)
        return [0.0] * len(completions)

    async def stuck_async(prompts, completions, **kw):
        while not release.is_set():
            await asyncio.sleep(0.01)
        return [0.0] * len(completions)

    began = time.monotonic()
    with pytest.raises(RewardTimeoutError) as info:
        _timed(stuck if form == "sync" else stuck_async, tokenizer_dir, 0.3)(make_inputs(["1=", "2="], ["1", "2"]))
    assert time.monotonic() - began < 30  # failed at its timeout, not when the function gave up
    name = "stuck" if form == "sync" else "stuck_async"
    assert re.search(rf"reward function \S+{name} did not return within its timeout_s of 0.3 s on the 2 samples on "
                     r"this rank \(uids 100, 101\); .*raise timeout_s \(\[reward\] timeout_s", str(info.value)), info.value
    assert isinstance(info.value, RewardFunctionError)  # caught as any reward function's error


def test_a_sample_that_hangs_alone_is_named_when_the_batch_raised(tokenizer_dir: str, release) -> None:
    def odd(prompts, completions, **kw):
        if len(completions) > 1:
            raise ValueError("a batch")
        if completions[0] == "2":
            release.wait(60)
        return [0.0]

    with pytest.raises(RewardTimeoutError, match=r"odd did not return within its timeout_s of 0.3 s on sample 1 of "
                                                 r"the 3 on this rank \(uid 101\), alone: prompt='2=' completion='2'"):
        _timed(odd, tokenizer_dir, 0.3)(make_inputs(["1=", "2=", "3="], ["1", "2", "3"]))


def test_after_a_call_past_its_timeout_the_next_one_is_served(tokenizer_dir: str, release) -> None:
    calls = []

    def stuck_once(prompts, completions, **kw):
        calls.append(len(completions))
        if len(calls) == 1:
            release.wait(60)  # the first call's thread stays here: the next call needs another
        return [1.0] * len(completions)

    scorer, inputs = _timed(stuck_once, tokenizer_dir, 0.3), make_inputs(["1=", "2="], ["1", "2"])
    with pytest.raises(RewardTimeoutError):
        scorer(inputs)
    assert scorer(inputs).tolist() == [1.0, 1.0] and calls == [2, 2]


def test_a_fn_within_its_timeout_scores_as_without_one(tokenizer_dir: str) -> None:
    inputs = make_inputs(["1=", "2="], ["1", "3"], ["1", "2"])
    for timeout_s in (None, 60.0):
        assert _timed(exact_match, tokenizer_dir, timeout_s)(inputs).tolist() == [1.0, 0.0]
    with pytest.raises(RewardFunctionError, match=r"_raises_on_seven raised on sample 0 of the 1"):
        _timed(_raises_on_seven, tokenizer_dir, 60.0)(make_inputs(["7="], ["7"]))


@pytest.mark.parametrize("timeout_s", [0, -1.0, True, "60"])
def test_a_bad_timeout_is_refused(timeout_s) -> None:
    with pytest.raises(ConfigError, match=r"RuleRewardConfig.timeout_s must be a number of seconds > 0 or None"):
        RuleRewardConfig(tokenizer_dir="t", fn="a:b", timeout_s=timeout_s)


# ----- built-in verifiers


def test_exact_match_strips_and_compares() -> None:
    assert exact_match(prompts=["p"] * 3, completions=[" 3 ", "33", "x"], answer=["3", "3", "x"]) == [1.0, 0.0, 1.0]


@pytest.mark.parametrize("text, number", [
    ("so the total is 12, then #### 42", 42.0), ("#### 1,234.5", 1234.5), (r"thus \boxed{-7} done 9", -7.0),
    ("3 apples and 5 pears", 5.0), ("#### $18", 18.0), ("no number", None), ("#### 3 then \\boxed{4}", 3.0),
])
def test_extract_number_prefers_hashes_then_boxed_then_the_last_number(text: str, number: float | None) -> None:
    assert extract_number(text) == number


def test_numeric_match_compares_numbers_with_the_answer_column() -> None:
    completions = ["... #### 72", r"\boxed{72.0}", "it is 71", "none", "#### 1,000"]
    answers = ["72", "Natalia sold 48 + 24 = 72\n#### 72", "72", "72", "1000"]
    assert numeric_match(prompts=[""] * 5, completions=completions, answer=answers) == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert numeric_match(prompts=[""], completions=["#### 3"], answer=[3]) == [1.0]
    with pytest.raises(ValueError, match="holds no number"):
        numeric_match(prompts=[""], completions=["1"], answer=["n/a"])


def test_format_check_default_and_custom_patterns() -> None:
    assert format_check(prompts=["", ""], completions=["work\n#### 12", "12"]) == [1.0, 0.0]
    think = FormatCheck(r"^<think>.*?</think>\s*<answer>.*?</answer>$", name="think_answer")
    assert think(prompts=[""] * 2, completions=["<think>a\nb</think> <answer>1</answer>", "<answer>1</answer>"]) \
        == [1.0, 0.0]
    assert function_labels([think, format_check]) == ("think_answer", "format_check")
    with pytest.raises(re.error, match=r"unterminated|missing"):
        FormatCheck("(")
