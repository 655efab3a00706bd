"""A built-in environment that turns plain Python functions into tools.

``[env] class = "workers.episodes:ToolEnv"`` with ``tools = ["my_tools:calc", ...]``
(functions, ``async`` or not). Each turn of the model either calls tools or answers:

- ``format = "chat"`` (models with a chat template): the Hermes/Qwen tool-call
  format, ``<tool_call>{"name": "calc", "arguments": {"expression": "2+3"}}</tool_call>``
  (one or more in a turn); the results go back as one observation, one line each.
- ``format = "text"`` (models without one): the turn is a Python-style call,
  ``calc("2+3")`` or ``mul(12, 34)``, with literal arguments; the observation is
  the result.

A call that cannot be parsed, names no tool, has arguments that do not fit, or
whose tool raises, is answered with an observation that says so (``error: ...``):
the model sees its mistake, the episode goes on. A turn that calls no tool is the
answer: the episode ends, rewarded by ``reward`` (:func:`exact_answer` with the
row's ``answer`` by default; :func:`numeric_answer`; or ``"module:function"``
called as ``fn(answer, row)``).
"""

from __future__ import annotations

import ast
import asyncio
import functools
import inspect
import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, cast

from channels import ConfigError
from workers.rewards import load_reward_fn

__all__ = ["ToolCall", "ToolEnv", "exact_answer", "numeric_answer", "parse_tool_calls"]

_CHAT_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_TEXT_CALL = re.compile(r"^\s*[A-Za-z_]\w*\s*\(")
"""A text-format turn that starts like a call is one (and an error when malformed)."""


class ToolCall:
    """One parsed call, or why it could not be parsed (``error``)."""

    def __init__(self, name: str = "", args: tuple[Any, ...] = (), kwargs: Mapping[str, Any] | None = None,
                 error: str = "") -> None:
        self.name, self.args, self.kwargs, self.error = name, args, dict(kwargs or {}), error

    def __repr__(self) -> str:
        return f"ToolCall({self.name!r}, {self.args!r}, {self.kwargs!r}, error={self.error!r})"


def parse_tool_calls(text: str, format: Literal["chat", "text"]) -> list[ToolCall]:
    """The tool calls in a turn's text ([] when it calls none: it answers)."""
    if format == "chat":
        return [_chat_call(body) for body in _CHAT_CALL.findall(text)]
    if _TEXT_CALL.match(text) is None:
        return []
    return [_text_call(text.strip())]


def _chat_call(body: str) -> ToolCall:
    try:
        call = json.loads(body.strip())
    except json.JSONDecodeError as e:
        return ToolCall(error=f"the tool call is not valid JSON ({e.msg} at char {e.pos})")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolCall(error='a tool call is {"name": ..., "arguments": {...}}')
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return ToolCall(name=call["name"], error="the arguments are not valid JSON")
    if not isinstance(arguments, dict):
        return ToolCall(name=call["name"], error="the arguments must be a JSON object")
    return ToolCall(name=call["name"], kwargs=arguments)


def _text_call(text: str) -> ToolCall:
    try:
        node = ast.parse(text, mode="eval").body
    except SyntaxError as e:
        return ToolCall(error=f"the tool call is not valid ({e.msg})")
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        return ToolCall(error="a tool call is name(arguments)")
    try:
        args = tuple(ast.literal_eval(a) for a in node.args)
        kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}
    except (ValueError, SyntaxError, TypeError):
        return ToolCall(name=node.func.id, error="the arguments must be literals (numbers, strings)")
    return ToolCall(name=node.func.id, args=args, kwargs=kwargs)


def _load(spec: str | Callable[..., Any], key: str) -> Callable[..., Any]:
    """The function ``"module:function"`` names (or ``spec`` itself)."""
    fn: Callable[..., Any] = load_reward_fn(cast(Any, spec), key=key, example="my_tools:add",
                                            expected="a function (a tool, or the answer's reward(answer, row))")
    return fn


def exact_answer(answer: str, row: Mapping[str, Any]) -> float:
    """1.0 when the answer is the row's ``answer`` (both stripped), else 0.0."""
    return float(answer.strip() == str(row.get("answer", "")).strip())


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def numeric_answer(answer: str, row: Mapping[str, Any]) -> float:
    """1.0 when the answer's last number (thousands separators dropped) equals the
    row's ``answer`` as a number, else 0.0: for models that answer in words."""
    numbers = _NUMBER.findall(answer)
    if not numbers:
        return 0.0
    try:
        return float(float(numbers[-1].replace(",", "")) == float(str(row.get("answer", "")).replace(",", "")))
    except ValueError:
        return 0.0


class ToolEnv:
    """Tools for the model (see the module docstring); one per episode.

    Args:
        tools: ``"module:function"`` names (or the functions).
        format: the tool-call format, ``"chat"`` or ``"text"``.
        reward: the answer's reward, ``fn(answer, row) -> float``.
        call_reward: the reward of a turn whose tool calls all ran (a format reward
            that teaches a model to call at all; 0 by default).

    Raises:
        ConfigError: a tool cannot be loaded, two tools share a name, or the
            format is unknown.
    """

    def __init__(self, tools: Sequence[str | Callable[..., Any]] = (), format: str = "text",
                 reward: str | Callable[..., float] = exact_answer, call_reward: float = 0.0) -> None:
        if format not in ("chat", "text"):
            raise ConfigError(f"[env] settings.format = {format!r}: the tool-call format is 'chat' or 'text'")
        self.format: Literal["chat", "text"] = "chat" if format == "chat" else "text"
        if isinstance(tools, str) or not isinstance(tools, Sequence):
            hint = f"; e.g. [{tools!r}]" if isinstance(tools, str) else ""
            raise ConfigError(f"[env] settings.tools must be a list of 'module:function' strings, got {tools!r}{hint}")
        self.tools: dict[str, Callable[..., Any]] = {}
        for i, spec in enumerate(tools):
            fn = _load(spec, f"[env] settings.tools[{i}]")
            name = getattr(fn, "__name__", str(spec))
            if name in self.tools:
                raise ConfigError(f"[env] settings.tools: two tools are named {name!r}")
            self.tools[name] = fn
        self.reward = _load(reward, "[env] settings.reward")
        if isinstance(call_reward, bool) or not isinstance(call_reward, int | float):
            raise ConfigError(f"[env] settings.call_reward must be a number, got {call_reward!r}")
        self.call_reward = float(call_reward)
        self.row: Mapping[str, Any] = {}

    async def reset(self, row: Mapping[str, Any]) -> None:
        """Keep the row (its answer rewards the last turn); no observation."""
        self.row = row

    async def step(self, action: str) -> tuple[str | None, float, bool]:
        """Run the turn's tool calls; a turn without one is the answer."""
        calls = parse_tool_calls(action, self.format)
        if not calls:
            return None, float(self.reward(action, self.row)), True
        results = [await self._run(call) for call in calls]
        ran = all(ok for _, ok in results)
        return "\n".join(text for text, _ in results), self.call_reward if ran else 0.0, False

    async def _run(self, call: ToolCall) -> tuple[str, bool]:
        """The call's observation, and whether the tool ran."""
        if call.error:
            return f"error: {call.error}", False
        fn = self.tools.get(call.name)
        if fn is None:
            return f"error: no tool named {call.name!r} (tools: {', '.join(self.tools)})", False
        try:
            inspect.signature(fn).bind(*call.args, **call.kwargs)
        except TypeError as e:
            return f"error: {call.name}: {e}", False
        except ValueError:
            pass
        try:
            if inspect.iscoroutinefunction(fn):
                out = await fn(*call.args, **call.kwargs)
            else:  # in a thread: a slow tool holds up its own episode only
                out = await asyncio.get_running_loop().run_in_executor(
                    None, functools.partial(fn, *call.args, **call.kwargs))
        except Exception as e:  # the tool's error is the model's to see
            return f"error: {call.name}: {type(e).__name__}: {e}", False
        return str(out), True
