"""ToolEnv: tool calls in the chat (Hermes) and text formats; every mistake in a call
is answered as an observation; a turn without a call is the answer."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from channels import ConfigError
from workers.episodes import ToolEnv, parse_tool_calls


def mul(a: int, b: int) -> int:
    return a * b


async def slow_add(a: int, b: int) -> int:
    await asyncio.sleep(0)
    return a + b


def broken(x: str) -> str:
    raise KeyError(x)


def _step(env: ToolEnv, action: str) -> tuple[Any, float, bool]:
    return asyncio.run(env.step(action))


def test_text_calls_parse_literal_arguments() -> None:
    (call,) = parse_tool_calls("mul(12, 3)", "text")
    assert (call.name, call.args, call.kwargs, call.error) == ("mul", (12, 3), {}, "")
    (call,) = parse_tool_calls(" mul(a=2, b='x') ", "text")
    assert call.kwargs == {"a": 2, "b": "x"}
    assert parse_tool_calls("36", "text") == []  # no call: an answer
    assert "not valid" in parse_tool_calls("mul(12, 3", "text")[0].error
    assert "literals" in parse_tool_calls("mul(12*3, 1)", "text")[0].error


def test_chat_calls_parse_json_between_tags() -> None:
    text = ('I will call it.<tool_call>{"name": "mul", "arguments": {"a": 2, "b": 5}}</tool_call>'
            '<tool_call>\n{"name": "slow_add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}\n</tool_call>')
    calls = parse_tool_calls(text, "chat")
    assert [(c.name, c.kwargs) for c in calls] == [("mul", {"a": 2, "b": 5}), ("slow_add", {"a": 1, "b": 2})]
    assert "not valid JSON" in parse_tool_calls('<tool_call>{"name": "mul", </tool_call>', "chat")[0].error
    assert "not valid JSON" in parse_tool_calls('<tool_call>{"name": "mul"', "chat")[0].error  # cut off
    assert parse_tool_calls("The answer is 10.", "chat") == []


def test_tools_run_and_every_mistake_is_answered_not_raised() -> None:
    env = ToolEnv(tools=[mul, slow_add, broken], format="text")
    asyncio.run(env.reset({"answer": "36"}))
    assert _step(env, "mul(12, 3)") == ("36", 0.0, False)
    assert _step(env, "slow_add(1, 2)") == ("3", 0.0, False)
    observation, reward, done = _step(env, "div(1, 2)")
    assert observation.startswith("error: no tool named 'div'") and not done and reward == 0
    assert _step(env, "mul(1)")[0].startswith("error: mul: missing a required argument")
    assert _step(env, "broken('k')")[0] == "error: broken: KeyError: 'k'"
    assert _step(env, "mul(12, 3")[0].startswith("error: the tool call is not valid")
    assert _step(env, "36") == (None, 1.0, True)  # the answer, rewarded by exact match


def test_the_chat_format_answers_each_call_on_a_line() -> None:
    env = ToolEnv(tools=[mul, slow_add], format="chat")
    asyncio.run(env.reset({"answer": "7"}))
    action = ('<tool_call>{"name": "mul", "arguments": {"a": 2, "b": 5}}</tool_call>'
              '<tool_call>{"name": "slow_add", "arguments": {"a": 1, "b": 2}}</tool_call>')
    assert _step(env, action) == ("10\n3", 0.0, False)
    assert _step(env, "6") == (None, 0.0, True)


def test_tools_and_formats_are_checked_at_construction() -> None:
    with pytest.raises(ConfigError, match="two tools are named 'mul'"):
        ToolEnv(tools=[mul, mul])
    with pytest.raises(ConfigError, match="'chat' or 'text'"):
        ToolEnv(tools=[mul], format="xml")
    with pytest.raises(ConfigError, match="tools\\[0\\]"):
        ToolEnv(tools=["no_such_module_here:f"])
    assert ToolEnv(tools=["workers.episodes:exact_answer"]).tools.keys() == {"exact_answer"}


def test_numeric_answer_reads_the_last_number() -> None:
    from workers.episodes import numeric_answer

    assert numeric_answer("The product is 56,088.", {"answer": "56088"}) == 1.0
    assert numeric_answer("56088 or 56089", {"answer": "56088"}) == 0.0
    assert numeric_answer("no idea", {"answer": "56088"}) == 0.0


def test_a_call_reward_pays_turns_whose_calls_ran() -> None:
    env = ToolEnv(tools=[mul], format="text", call_reward=0.25)
    asyncio.run(env.reset({"answer": "36"}))
    assert _step(env, "mul(12, 3)") == ("36", 0.25, False)
    assert _step(env, "mul(12)")[1] == 0.0
    assert _step(env, "36") == (None, 1.0, True)
