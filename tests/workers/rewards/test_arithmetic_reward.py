"""The arithmetic source's verifier: exact match up to ``<eos>``."""

from __future__ import annotations

import pytest

from channels import ConfigError
from workers.rewards import arithmetic_reward
from workers.rewards._arithmetic import extract_answer


@pytest.mark.parametrize(
    ("response", "answer", "reward"),
    [
        ("46<eos>", "46", 1.0),
        ("46", "46", 1.0),  # cut off before EOS, nothing extra
        (" 46 <eos>", "46", 1.0),  # stripped
        ("46<eos>7<eos>garbage", "46", 1.0),  # whatever follows EOS is ignored
        ("46<eos><pad><pad>", "46", 1.0),
        ("467<eos>", "46", 0.0),
        ("4<eos>6", "46", 0.0),
        ("", "46", 0.0),
        ("<eos>", "46", 0.0),
        ("<eos>46", "46", 0.0),
        ("-14<eos>", "-14", 1.0),
        ("14<eos>", "-14", 0.0),
    ],
)
def test_exact_match(response: str, answer: str, reward: float) -> None:
    assert arithmetic_reward(["p="], [response], [answer]) == [reward]


def test_batched_and_length_checked() -> None:
    assert arithmetic_reward(["a", "b"], ["1<eos>", "3<eos>"], ["1", "2"]) == [1.0, 0.0]
    assert arithmetic_reward([], [], []) == []
    with pytest.raises(ConfigError, match="one prompt, response and answer per row"):
        arithmetic_reward(["a"], ["1", "2"], ["1"])


def test_extract_answer() -> None:
    assert extract_answer(" 12 <eos>99") == "12"
    assert extract_answer("") == ""
