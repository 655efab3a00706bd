"""Rule rewards in-process: the function contract, decoding, and the error messages."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from channels import ConfigError, SchemaError
from workers.models import CharTokenizer
from workers.rewards import (
    DEFAULT_REWARD_FN,
    RewardFunctionError,
    RuleRewardConfig,
    RuleScorer,
    ScoreInputs,
    arithmetic_reward,
    load_reward_fn,
    masked_token_lists,
)
from workers.rewards._decode import load_decoder

TOK = CharTokenizer()
PAD, EOS = TOK.pad_token_id, TOK.eos_token_id


def _left(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.tensor([[PAD] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def _right(rows: list[list[int]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor([r + [PAD] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    return ids, mask


def make_inputs(prompts: list[str], responses: list[str], answers: list[str],
                *, eos: bool = True) -> ScoreInputs:
    """Samples as the roles see them: left-padded prompts, right-padded responses
    ending in EOS, right-padded answers, uids 100, 101, ..."""
    prompt_ids, prompt_mask = _left([TOK.encode(p) for p in prompts])
    resp = [TOK.encode(r, add_bos=False) + ([EOS] if eos else []) for r in responses]
    response_ids, response_mask = _right(resp, 8)
    answer_ids, _ = _right([TOK.encode(a, add_bos=False) for a in answers], 4)
    return ScoreInputs(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                       response_mask=response_mask, answer_ids=answer_ids,
                       uids=torch.arange(100, 100 + len(prompts)))


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(TOK.save_pretrained(tmp_path_factory.mktemp("tok")))


def _scorer(fn, tokenizer_dir: str) -> RuleScorer:
    return RuleRewardConfig(fn=fn, tokenizer_dir=tokenizer_dir).build(torch.device("cpu"))


def test_arithmetic_reward_is_exact_match_after_strip() -> None:
    assert arithmetic_reward(["1+2="] * 4, ["3", " 3 ", "33", ""], ["3", "3", "3", "3"]) == [1.0, 1.0, 0.0, 0.0]


def test_default_rule_scores_decoded_text_up_to_eos(tokenizer_dir: str) -> None:
    scorer = _scorer(DEFAULT_REWARD_FN, tokenizer_dir)
    inputs = make_inputs(["1+2=", "10+5=", "7*3="], ["3", "16", "21"], ["3", "15", "21"])
    scores = scorer(inputs)
    assert scores.dtype == torch.float32 and scores.tolist() == [1.0, 0.0, 1.0]
    prompts, responses, answers = scorer.texts(inputs)
    assert prompts == ["1+2=", "10+5=", "7*3="]  # no <bos>, no padding
    assert responses == ["3", "16", "21"]  # no <eos>, no padding
    assert answers == ["3", "15", "21"]


def test_fn_gets_the_documented_arguments_and_may_return_arrays(tokenizer_dir: str) -> None:
    seen = {}

    def fn(prompts, responses, answers):
        seen.update(prompts=prompts, responses=responses, answers=answers)
        return np.array([len(r) for r in responses], dtype=np.int64)

    scores = _scorer(fn, tokenizer_dir)(make_inputs(["1=", "2="], ["12 ", "3"], ["1", "2"], eos=False))
    assert seen == {"prompts": ["1=", "2="], "responses": ["12 ", "3"], "answers": ["1", "2"]}
    assert scores.tolist() == [3.0, 1.0]


def _raises_on_seven(prompts, responses, answers):
    return [1.0 / (r != "7") for r in responses]


def _exits_on_seven(prompts, responses, answers):
    if "7" in responses:
        sys.exit("seven")
    return [1.0] * len(responses)


def test_a_fn_that_exits_is_named_like_one_that_raises(tokenizer_dir: str) -> None:
    inputs = make_inputs(["1=", "2=", "3=", "4="], ["1", "2", "7", "7"], ["1", "2", "3", "4"])
    with pytest.raises(RewardFunctionError, match=r"_exits_on_seven raised on sample 2 of the 4 on this rank \(uid 102\): "
                                                  r"SystemExit: seven; "):
        _scorer(_exits_on_seven, tokenizer_dir)(inputs)


def test_a_raising_fn_names_itself_and_the_first_failing_sample(tokenizer_dir: str) -> None:
    inputs = make_inputs(["1=", "2=", "3=", "4="], ["1", "2", "7", "7"], ["1", "2", "3", "4"])
    with pytest.raises(RewardFunctionError) as info:
        _scorer(_raises_on_seven, tokenizer_dir)(inputs)
    msg = str(info.value)
    assert "test_rule_rewards:_raises_on_seven" in msg
    assert "sample 2 of the 4" in msg and "(uid 102)" in msg
    assert "ZeroDivisionError" in msg and "response='7'" in msg
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_a_fn_failing_only_on_the_whole_batch_is_reported_as_such(tokenizer_dir: str) -> None:
    def needs_small_batches(prompts, responses, answers):
        if len(prompts) > 1:
            raise RuntimeError("batch too big")
        return [0.0]

    with pytest.raises(RewardFunctionError, match="on none of them alone"):
        _scorer(needs_small_batches, tokenizer_dir)(make_inputs(["1=", "2="], ["1", "2"], ["1", "2"]))


@pytest.mark.parametrize("result, match", [
    ([1.0], "returned 1 scores for 2 samples"),
    ([1.0, "a"], r"returned 'a' \(str\) as score 1"),
    ([1.0, float("nan")], "finite real number"),
    ("ab", "returned a str"),
    (None, "returned a NoneType"),
])
def test_wrong_results_name_the_problem(tokenizer_dir: str, result, match: str) -> None:
    scorer = _scorer(lambda p, r, a: result, tokenizer_dir)
    with pytest.raises(RewardFunctionError, match=match):
        scorer(make_inputs(["1=", "2="], ["1", "2"], ["1", "2"]))


def test_missing_answers_name_the_field(tokenizer_dir: str) -> None:
    inputs = make_inputs(["1="], ["1"], ["1"])
    bare = ScoreInputs(prompt_ids=inputs.prompt_ids, prompt_mask=inputs.prompt_mask,
                       response_ids=inputs.response_ids, response_mask=inputs.response_mask)
    with pytest.raises(SchemaError, match="answer_ids"):
        _scorer(DEFAULT_REWARD_FN, tokenizer_dir)(bare)


def test_empty_batch_gives_no_scores_without_calling_fn(tokenizer_dir: str) -> None:
    def never(*args):
        raise AssertionError("called")

    empty = ScoreInputs(prompt_ids=torch.zeros(0, 3, dtype=torch.int64),
                        prompt_mask=torch.zeros(0, 3, dtype=torch.int64),
                        response_ids=torch.zeros(0, 4, dtype=torch.int64),
                        response_mask=torch.zeros(0, 4, dtype=torch.int64),
                        answer_ids=torch.zeros(0, 2, dtype=torch.int64))
    assert _scorer(never, tokenizer_dir)(empty).shape == (0,)


def test_load_reward_fn_by_import_path_and_its_errors() -> None:
    assert load_reward_fn(DEFAULT_REWARD_FN) is arithmetic_reward
    assert load_reward_fn("os.path:join") is __import__("os").path.join
    assert load_reward_fn("workers.rewards:RuleScorer.texts") is RuleScorer.texts  # dotted
    with pytest.raises(ConfigError, match="'module:function'"):
        load_reward_fn("workers.rewards.arithmetic_reward")
    with pytest.raises(ConfigError, match="cannot import module 'no_such_module_xyz'"):
        load_reward_fn("no_such_module_xyz:f")
    with pytest.raises(ConfigError, match="has no attribute 'nope'"):
        load_reward_fn("workers.rewards:nope")
    with pytest.raises(ConfigError, match="not a function"):
        load_reward_fn("workers.rewards:DEFAULT_REWARD_FN")


@pytest.mark.parametrize(("source", "fix"), [
    ("import af_not_installed_xyz\n",
     r"ModuleNotFoundError: No module named 'af_not_installed_xyz'; the module was found, but it imports "
     r"'af_not_installed_xyz', which is not installed \({module}:1\); install it$"),
    ("x = 1\nraise RuntimeError('no classifier')\n",
     r"RuntimeError: no classifier; the module was found, but running it failed \({module}:2\); fix it$"),
    ("def f(:\n", r"SyntaxError: .*; the module was found, but {module}:1 is not valid Python; fix it$"),
])
def test_a_module_that_fails_to_import_is_told_apart_from_one_not_found(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, fix: str) -> None:
    module = tmp_path / "af_failing_reward.py"
    module.write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"^RuleRewardConfig.fn = 'af_failing_reward:f': cannot import module "
                                          r"'af_failing_reward': " + fix.format(module=module)):
        load_reward_fn("af_failing_reward:f")
    with pytest.raises(ConfigError, match=r"No module named 'af_absent_reward'; put the module beside the config "
                                          r"file or in the working directory, or on PYTHONPATH$"):
        load_reward_fn("af_absent_reward:f")


def test_config_checks_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"RuleRewardConfig\.fn"):
        RuleRewardConfig(fn="no_colon", tokenizer_dir="x")
    with pytest.raises(ConfigError, match=r"RuleRewardConfig\.tokenizer_dir"):
        RuleRewardConfig(tokenizer_dir="")
    with pytest.raises(ConfigError, match=r"tokenizer_dir .* holds no tokenizer"):
        load_decoder(tmp_path)


def test_masked_token_lists_keep_each_rows_real_tokens_in_order() -> None:
    ids = torch.tensor([[0, 0, 7, 8], [5, 6, 9, 0], [1, 2, 3, 4], [4, 4, 4, 4]])
    left = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    assert masked_token_lists(ids, left) == [[7, 8], [5, 6, 9], [1, 2, 3, 4], []]
    # a mask of any dtype: bool, float (0.0 drops), and a view of a wider tensor
    right = torch.tensor([[1.0, 0.0, 1.0, 0.0]] * 4)
    assert masked_token_lists(ids, right.bool()) == masked_token_lists(ids, right) == [[0, 7], [5, 9], [1, 3], [4, 4]]
    wide = torch.arange(24).view(4, 6)
    assert masked_token_lists(wide[:, 1:5], left) == [[3, 4], [7, 8, 9], [13, 14, 15, 16], []]
    assert masked_token_lists(ids[:0], left[:0]) == []
