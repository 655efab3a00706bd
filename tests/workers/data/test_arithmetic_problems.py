"""Arithmetic problems: deterministic generation, disjoint splits, answers, config errors."""

from __future__ import annotations

import re

import msgspec
import pytest

from channels import ConfigError
from workers.data import ArithmeticProblem, ArithmeticTaskConfig, generate_splits

SMALL = ArithmeticTaskConfig(train_size=300, eval_size=100, seed=3)


def _mirror(problem: ArithmeticProblem) -> ArithmeticProblem:
    return ArithmeticProblem(left=problem.right, operator=problem.operator, right=problem.left)


def test_equal_configs_give_equal_splits_and_seeds_change_them() -> None:
    first, again = (
        generate_splits(SMALL),
        generate_splits(ArithmeticTaskConfig(train_size=300, eval_size=100, seed=3)),
    )
    assert first == again
    other = generate_splits(msgspec.structs.replace(SMALL, seed=4))
    assert other.train != first.train and other.eval != first.eval


def test_splits_have_their_sizes_and_share_no_problem_nor_mirror_image() -> None:
    splits = generate_splits(ArithmeticTaskConfig(train_size=7000, eval_size=1000))
    assert len(splits.train) == 7000 and len(splits.eval) == 1000
    assert len(set(splits.train)) == 7000 and len(set(splits.eval)) == 1000
    held_out = set(splits.eval) | {_mirror(problem) for problem in splits.eval}
    assert not held_out & set(splits.train)


def test_mirror_images_of_a_non_commutative_operator_stay_apart_only_if_equal() -> None:
    config = ArithmeticTaskConfig(digits=1, operators=("-",), train_size=60, eval_size=20)
    splits = generate_splits(config)
    assert not set(splits.eval) & set(splits.train)
    assert len(splits.train) + len(splits.eval) <= config.num_distinct_problems
    # 7-3 and 3-7 are different problems, so the train split may hold a held-out
    # mirror, and the eval split may hold both (with seed 0 both happen).
    train, held_out = set(splits.train), set(splits.eval)
    mirrored = [p for p in splits.eval if p.left != p.right]
    assert any(_mirror(p) in train for p in mirrored)
    assert any(_mirror(p) in held_out for p in mirrored)
    # A commutative operator's mirror stays out of both (a-a is its own mirror).
    added = generate_splits(msgspec.structs.replace(config, operators=("+",)))
    assert not {_mirror(p) for p in added.eval} & set(added.train)
    assert all(_mirror(p) not in set(added.eval) for p in added.eval if p.left != p.right)


def test_growing_the_train_split_keeps_the_eval_split() -> None:
    small = generate_splits(SMALL)
    large = generate_splits(msgspec.structs.replace(SMALL, train_size=600))
    assert large.eval == small.eval
    assert large.train[:300] == small.train


def test_operands_respect_digits_and_operators_are_all_drawn() -> None:
    config = ArithmeticTaskConfig(digits=3, operators=("+", "-", "*"), train_size=600, eval_size=60)
    splits = generate_splits(config)
    problems = splits.train + splits.eval
    assert all(0 <= p.left < 1000 and 0 <= p.right < 1000 for p in problems)
    assert {p.operator for p in problems} == {"+", "-", "*"}
    assert max(len(p.prompt) for p in problems) <= config.max_prompt_chars
    assert max(len(p.answer) for p in problems) <= config.max_answer_chars


@pytest.mark.parametrize(
    ("left", "operator", "right", "prompt", "answer"),
    [
        (12, "+", 34, "12+34=", "46"),
        (95, "+", 7, "95+7=", "102"),
        (3, "-", 17, "3-17=", "-14"),
        (12, "*", 11, "12*11=", "132"),
        (0, "*", 9, "0*9=", "0"),
    ],
)
def test_prompt_and_answer_text(
    left: int, operator: str, right: int, prompt: str, answer: str
) -> None:
    problem = ArithmeticProblem(left=left, operator=operator, right=right)
    assert (problem.prompt, problem.answer) == (prompt, answer)


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"train_size": 0}, "train_size"),
        ({"eval_size": 0}, "eval_size"),
        ({"digits": 0}, "digits"),
        ({"operators": ()}, "operators"),
        ({"operators": ("/",)}, "operators"),
        ({"operators": ("+", "+")}, "operators"),
        ({"digits": 1, "train_size": 90, "eval_size": 10}, "train_size + 2 * eval_size"),
    ],
)
def test_invalid_configs_raise_config_errors_naming_the_setting(
    settings: dict[str, object], named: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(named)):
        ArithmeticTaskConfig(**settings)  # type: ignore[arg-type]


def test_decoding_rejects_unknown_keys_and_wrong_types() -> None:
    decoded = msgspec.json.decode(b'{"digits": 3, "train_size": 50}', type=ArithmeticTaskConfig)
    assert decoded.digits == 3
    with pytest.raises(msgspec.ValidationError, match="trian_size"):
        msgspec.json.decode(b'{"trian_size": 5}', type=ArithmeticTaskConfig)
    with pytest.raises(msgspec.ValidationError, match="digits"):
        msgspec.json.decode(b'{"digits": "2"}', type=ArithmeticTaskConfig)
    with pytest.raises(msgspec.ValidationError, match="train_size"):
        msgspec.json.decode(b'{"train_size": 0}', type=ArithmeticTaskConfig)
