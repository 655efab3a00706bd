"""Demonstrations for the SFT warm start: arithmetic problems taught as episodes
with the run's environment (``[sft] demonstration_share``), so that the policy RL
starts from sometimes acts as they do (e.g. calls a tool).

A demonstration is the episode of a policy that acts as ``[sft]
demonstration_turns`` say, then answers: each turn filled in with the problem and
ended by EOS, and after each turn but the answer the observation the run's
environment gives it, encoded by :class:`~workers.episodes.ObservationCodec` as
the run's episodes encode it. Its tokens are those an RL episode that acted so
holds, position by position; the loss is on the turns only (observations are
read, not learnt).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from channels import ConfigError
from workers.data import ArithmeticProblem
from workers.episodes import (
    EnvLoop,
    EnvProtocolError,
    EpisodeConfig,
    EpisodeRun,
    ObservationCodec,
    checked_step,
    load_env_class,
)
from workers.models import CharTokenizer, PromptTokenizer
from workers.rollout import NativeRolloutEngine, SamplingParams

__all__ = ["Demonstration", "demonstrate", "demonstrated", "evaluate_episodes", "fill_turn", "sft_rows"]

TURN_FIELDS = ("left", "operator", "right")
"""What a demonstration turn's template may name: the problem's fields."""


@dataclass(frozen=True)
class Demonstration:
    """One problem's episode after its prompt."""

    tokens: list[int]
    """Observations and turns, in order."""
    sampled: list[bool]
    """Per token: a turn's (the loss's), or an observation's."""
    longest_turn: int
    """Tokens of the longest turn, EOS included."""


def fill_turn(template: str, problem: ArithmeticProblem, *, key: str) -> str:
    """``template`` filled in with ``problem``'s fields (``{left}``, ``{operator}``, ``{right}``).

    Raises:
        ConfigError: the template names another field or is malformed (``key`` says
            which setting it is).
    """
    try:
        return template.format(left=problem.left, operator=problem.operator, right=problem.right)
    except (KeyError, IndexError, ValueError) as e:
        raise ConfigError(f"{key} = {template!r} cannot be filled in ({type(e).__name__}: {e}); a turn may name "
                          f"{', '.join('{' + f + '}' for f in TURN_FIELDS)}") from None


def demonstrated(count: int, share: float) -> list[int]:
    """The indices of the ``share`` of ``count`` problems taught as demonstrations,
    spread evenly (``round(count * share)`` of them)."""
    return [i for i in range(count) if int((i + 1) * share + 0.5) > int(i * share + 0.5)]


def demonstrate(problems: Sequence[ArithmeticProblem], tokenizer: CharTokenizer, turns: Sequence[str],
                episodes: EpisodeConfig) -> list[Demonstration]:
    """The demonstrations of ``problems``: their episodes with the run's environment
    (one environment each, called as an episode calls it; many at once).

    Args:
        problems: the problems to demonstrate.
        tokenizer: the policy's tokenizer.
        turns: the model's turns before the answer, templates of the problem's fields.
        episodes: the run's episode settings (environment, observation format, budgets).

    Raises:
        ConfigError: a turn cannot be filled in or encoded, the environment cannot
            be built, raises, ends an episode before its answer or does not end it
            at the answer, gives the answer no reward, or an episode outgrows the
            ``[env]`` budgets.
    """
    if len(turns) + 1 > episodes.max_turns:
        raise ConfigError(f"sft.demonstration_turns: {len(turns)} turns and the answer are more than [env] "
                          f"max_turns = {episodes.max_turns}")
    cls = load_env_class(episodes.env)
    codec = ObservationCodec(PromptTokenizer(tokenizer, source="sft.model.tokenizer"), format=episodes.format,
                             observation_role=episodes.observation_role, text_template=episodes.text_template)
    loop = EnvLoop.shared()
    actions = [_actions(p, tokenizer, turns) for p in problems]
    timeout = episodes.timeout_s * (len(turns) + 2)
    futures = [loop.submit(_episode, _env(cls, episodes), {"prompt": p.prompt, "answer": p.answer},
                           [text for _, text in acts], timeout_s=timeout) for p, acts in zip(problems, actions, strict=True)]
    # Not cancelled when one fails: each ends at its timeout, and a future cancelled
    # as its episode failed would leave that error unread (asyncio logs it).
    return [_tokens(p, acts, _answered(f, p, episodes), codec, episodes)
            for p, acts, f in zip(problems, actions, futures, strict=True)]


def _actions(problem: ArithmeticProblem, tokenizer: CharTokenizer, turns: Sequence[str]) -> list[tuple[list[int], str]]:
    """Each turn's tokens (EOS included) and its text as the episode decodes it."""
    out = []
    texts = [*(fill_turn(t, problem, key=f"sft.demonstration_turns[{k}]") for k, t in enumerate(turns)),
             problem.answer]
    for text in texts:
        ids = [*tokenizer.encode(text, add_bos=False), tokenizer.eos_token_id]
        out.append((ids, tokenizer.decode(ids, skip_special_tokens=True)))
    return out


def _env(cls: type, episodes: EpisodeConfig) -> Any:
    try:
        return cls(**episodes.settings)
    except TypeError as e:
        raise ConfigError(f"[env] settings do not fit {cls.__name__}: {e}") from None


async def _episode(env: Any, row: Mapping[str, Any], actions: Sequence[str]) -> tuple[Any, list[Any]]:
    """``reset(row)``, then ``step`` with each action: the environment's answers."""
    first = await _call(env.reset, row)
    return first, [await _call(env.step, action) for action in actions]


async def _call(method: Any, arg: Any) -> Any:
    """``method(arg)``; a plain method on the loop's threads, so that one that blocks
    holds up only its own episode and its timeout still fires."""
    if inspect.iscoroutinefunction(method):
        return await method(arg)
    out = await asyncio.get_running_loop().run_in_executor(None, method, arg)
    return await out if inspect.isawaitable(out) else out


def _answered(future: concurrent.futures.Future[Any], problem: ArithmeticProblem,
              episodes: EpisodeConfig) -> tuple[str, list[tuple[str, float, bool]]]:
    where = f"sft: the demonstration of {problem.prompt!r}"
    try:
        first, steps = future.result()
    except (TimeoutError, concurrent.futures.TimeoutError):
        raise ConfigError(f"{where}: the environment took more than [env] timeout_s = {episodes.timeout_s:g} s "
                          "per call") from None
    except Exception as e:  # the user's environment: any error
        raise ConfigError(f"{where}: the environment raised {type(e).__name__}: {e}") from e
    checked = []
    for k, answer in enumerate(steps):
        try:
            observation, reward, done = checked_step(answer, "step")
        except EnvProtocolError as e:
            raise ConfigError(f"{where}: {e}") from None
        if done != (k == len(steps) - 1):
            raise ConfigError(f"{where}: the environment {'ended' if done else 'did not end'} the episode after "
                              f"turn {k + 1} of {len(steps)} (the last is the answer)")
        checked.append((observation, reward, done))
    if not checked[-1][1] > 0:
        raise ConfigError(f"{where}: the environment gave the answer {problem.answer!r} reward {checked[-1][1]:g}; "
                          "a demonstration teaches answers the environment rewards")
    if first is not None and not isinstance(first, str):
        raise ConfigError(f"{where}: reset returned an observation of type {type(first).__name__}; "
                          "return text (str) or None")
    return first or "", checked


def _tokens(problem: ArithmeticProblem, actions: Sequence[tuple[list[int], str]],
            answers: tuple[str, list[tuple[str, float, bool]]], codec: ObservationCodec,
            episodes: EpisodeConfig) -> Demonstration:
    first, steps = answers
    tokens: list[int] = []
    sampled: list[bool] = []

    def add(ids: Sequence[int], by_model: bool) -> None:
        tokens.extend(ids)
        sampled.extend([by_model] * len(ids))

    add(_encoded(lambda: codec.encode_first(first), problem), False)
    for (ids, _), (observation, _, done) in zip(actions, steps, strict=True):
        add(ids, True)
        if not done:  # a turn ends with EOS
            add(_encoded(lambda o=observation: codec.encode(o, after_eos=True), problem), False)
    if len(tokens) > episodes.max_tokens:
        raise ConfigError(f"sft: the demonstration of {problem.prompt!r} is {len(tokens)} tokens after the prompt, "
                          f"more than [env] max_tokens = {episodes.max_tokens}; raise it")
    return Demonstration(tokens=tokens, sampled=sampled, longest_turn=max(len(ids) for ids, _ in actions))


def _encoded(encode: Any, problem: ArithmeticProblem) -> list[int]:
    try:
        return list(encode())
    except ConfigError as e:
        raise ConfigError(f"sft: the demonstration of {problem.prompt!r}: an observation: {e}") from None


def sft_rows(problems: Sequence[ArithmeticProblem], tokenizer: CharTokenizer,
             demonstrations: Mapping[ArithmeticProblem, Demonstration]) -> dict[str, Tensor]:
    """A supervised batch: each problem's prompt, then its demonstration when it has
    one, else ``answer <eos>``.

    Returns:
        ``prompt_ids``/``prompt_mask`` ``[B, P]`` left-padded; ``response_ids``,
        ``response_mask`` (1 on the turns: the loss's tokens) and ``observation_mask``
        (1 on the observations: read, no loss) ``[B, R]`` right-padded; int64.
    """
    prompts = [tokenizer.encode(p.prompt) for p in problems]
    responses: list[list[int]] = []
    sampled: list[list[bool]] = []
    for p in problems:
        shown = demonstrations.get(p)
        if shown is None:
            responses.append([*tokenizer.encode(p.answer, add_bos=False), tokenizer.eos_token_id])
            sampled.append([True] * len(responses[-1]))
        else:
            responses.append(shown.tokens)
            sampled.append(shown.sampled)
    pad = tokenizer.pad_token_id
    width, wide = max(map(len, prompts)), max(map(len, responses))
    prompt_ids = torch.full((len(problems), width), pad, dtype=torch.int64)
    prompt_mask = torch.zeros((len(problems), width), dtype=torch.int64)
    response_ids = torch.full((len(problems), wide), pad, dtype=torch.int64)
    response_mask = torch.zeros((len(problems), wide), dtype=torch.int64)
    observation_mask = torch.zeros((len(problems), wide), dtype=torch.int64)
    for i, (prompt, response, by_model) in enumerate(zip(prompts, responses, sampled, strict=True)):
        prompt_ids[i, width - len(prompt):] = torch.tensor(prompt)
        prompt_mask[i, width - len(prompt):] = 1
        response_ids[i, :len(response)] = torch.tensor(response)
        turns = torch.tensor(by_model, dtype=torch.bool)
        response_mask[i, :len(response)] = turns.long()
        observation_mask[i, :len(response)] = (~turns).long()
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "response_ids": response_ids,
            "response_mask": response_mask, "observation_mask": observation_mask}


def evaluate_episodes(engine: NativeRolloutEngine, problems: Sequence[ArithmeticProblem], tokenizer: CharTokenizer,
                      episodes: EpisodeConfig, *, max_new_tokens: int) -> dict[str, float]:
    """Greedy episodes of every problem with the run's environment, as the RL run's
    held-out evaluation has them.

    Args:
        engine: the policy's rollout engine.
        problems: the problems (at least one).
        tokenizer: the policy's tokenizer.
        episodes: the run's episode settings.
        max_new_tokens: a turn's budget.

    Returns:
        ``accuracy`` (the episodes' mean reward), ``num_problems`` and
        ``mean_turns`` (turns per episode).
    """
    if not problems:
        raise ConfigError("evaluate_episodes got no problems; the split is empty")
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=tokenizer.pad_token_id)
    run = EpisodeRun(engine, [tokenizer.encode(p.prompt) for p in problems],
                     [{"prompt": p.prompt, "answer": p.answer} for p in problems], n=1, params=params,
                     config=episodes, tokenizer=PromptTokenizer(tokenizer, source="sft.model.tokenizer"),
                     where="the SFT warm start's evaluation")
    ended = []
    try:
        while run.pending:
            ended += run.advance()
    finally:
        run.close()
    return {"accuracy": sum(e.reward for e in ended) / len(ended), "num_problems": float(len(ended)),
            "mean_turns": sum(e.turns for e in ended) / len(ended)}
