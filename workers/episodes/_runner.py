"""Episodes on one rank: the engine decodes some while the others wait on their
environments.

Every episode is one token sequence after its prompt: ``reset``'s observation,
then each turn's tokens exactly as the engine sampled them and the observation
that follows (:class:`ObservationCodec`). A turn is a sample admitted into one
:class:`~workers.rollout.GenerationRun` (continuous batching: it joins the running
batch at the next step) with the whole sequence so far as its prompt, so nothing
the model sampled is ever decoded and encoded again. Its engine index is
``episode * MAX_TURNS_LIMIT + turn``, so each turn draws its own random stream.

Environment calls run on the :class:`EnvLoop`; the run steps the engine while any
turn is in it and waits on the environments only when none is.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from channels import AsyncflowError, ConfigError
from workers.episodes._codec import ObservationCodec
from workers.episodes._config import MAX_TURNS_LIMIT, EpisodeConfig
from workers.episodes._env import (
    EnvLoop,
    EnvThreadsBusy,
    build_env,
    checked_observation,
    checked_step,
    load_env_class,
)
from workers.models import PromptTokenizer
from workers.rollout import FinishedSample, GenerationRun, PartialSample, SamplingParams

__all__ = ["Episode", "EpisodeError", "EpisodeRun"]

log = logging.getLogger(__name__)


class EpisodeError(AsyncflowError):
    """An environment raised or timed out and ``[env] on_error = "fail"``."""


@dataclass(eq=False)
class Episode:
    """One episode's sequence after its prompt, and how it went."""

    index: int
    """The caller's index (the sample's row among the rank's outputs)."""
    prompt: list[int]
    env: Any
    tokens: list[int] = field(default_factory=list)
    """Everything after the prompt: observations and sampled turns."""
    sampled: list[bool] = field(default_factory=list)
    """Per token: sampled by the model (True) or an observation's."""
    logprobs: list[float] = field(default_factory=list)
    """Per token: the rollout's log-prob (0 for observation tokens)."""
    turn_ends: list[int] = field(default_factory=list)
    """Per turn: the position of its last sampled token."""
    turn_rewards: list[float] = field(default_factory=list)
    """Per turn: the environment's reward for it."""
    outcome: str = ""
    """How it ended (:data:`~workers.episodes.OUTCOMES`); "" while it runs."""
    reason: str = ""
    """For ``error`` and ``timeout``: what happened."""
    env_s: float = 0.0
    """Seconds spent waiting on the environment."""

    @property
    def turns(self) -> int:
        return len(self.turn_ends)

    @property
    def reward(self) -> float:
        """The episode's reward: the sum of its turns' (0 after an environment failure)."""
        return 0.0 if self.outcome in ("error", "timeout") else sum(self.turn_rewards)

    def observe(self, tokens: Sequence[int]) -> None:
        self.tokens += tokens
        self.sampled += [False] * len(tokens)
        self.logprobs += [0.0] * len(tokens)

    def act(self, sample: FinishedSample) -> None:
        self.tokens += sample.response_ids
        self.sampled += [True] * len(sample.response_ids)
        self.logprobs += sample.logprobs
        self.turn_ends.append(len(self.tokens) - 1)


@dataclass(frozen=True)
class _Call:
    episode: Episode
    method: str
    started: float


class EpisodeRun:
    """The episodes of ``prompts`` (``n`` per prompt), stepped by the caller.

    Args:
        engine: the rollout engine (``start`` opens the run the turns go into).
        prompts: each prompt's tokens.
        rows: each prompt's row as the environment's ``reset`` gets it.
        n: episodes per prompt; episode ``k`` answers prompt ``k // n``.
        params: each turn's sampling (``max_new_tokens``: a turn's budget).
        config: the environment and the episode's budgets.
        tokenizer: the policy's tokenizer (actions are decoded with it, observations
            encoded).
        where: the calling method, for messages.

    Raises:
        ConfigError: the environment class cannot be loaded or built.
    """

    def __init__(self, engine: Any, prompts: Sequence[list[int]], rows: Sequence[Mapping[str, Any]], *, n: int,
                 params: SamplingParams, config: EpisodeConfig, tokenizer: PromptTokenizer, where: str) -> None:
        self.config, self.where, self.tokenizer = config, where, tokenizer
        stop = tuple(dict.fromkeys((*params.stop, *config.stop)))
        self.params = msgspec.structs.replace(params, stop=stop) if stop != params.stop else params
        self.codec = ObservationCodec(tokenizer, format=config.format, observation_role=config.observation_role,
                                      text_template=config.text_template)
        cls = load_env_class(config.env)
        self.loop = EnvLoop.shared()
        self.run: GenerationRun = engine.start([], self.params)
        self.episodes = [Episode(index=k, prompt=list(prompts[k // n]), env=build_env(cls, config.settings))
                         for k in range(len(prompts) * n)]
        self.unfinished = len(self.episodes)
        self._calls: dict[concurrent.futures.Future[Any], _Call] = {}
        self._unsaid: dict[str, int] = {}
        """Per outcome, the episodes ended so after the first (which was logged)."""
        for k, episode in enumerate(self.episodes):
            self._submit(episode, "reset", dict(rows[k // n]))

    @property
    def pending(self) -> int:
        """Episodes not finished yet."""
        return self.unfinished

    def advance(self) -> list[Episode]:
        """One step: take the environments' answers that came (waiting for one when
        the engine has nothing to decode), then one engine step. Returns the
        episodes that ended in it."""
        ended: list[Episode] = []
        if self._calls:
            self._take_answers(ended, wait=not self.run.pending)
        if self.run.pending:
            for sample in self.run.step():
                self._turn_done(self.episodes[sample.index // MAX_TURNS_LIMIT], sample, ended)
        return ended

    def close(self) -> None:
        """Stop the engine's run; calls still in flight finish unseen. Says how many
        more episodes ended like the first of each kind that was logged."""
        for outcome, count in self._unsaid.items():
            if count:
                log.warning("%s: %d more episode(s) ended (%s), as the one above", self.where, count, outcome)
        self._unsaid.clear()
        self.run.close()
        for future in self._calls:
            future.cancel()
        self._calls.clear()

    # ----- environments

    def _submit(self, episode: Episode, method: str, arg: Any) -> None:
        future = self.loop.submit(getattr(episode.env, method), arg, timeout_s=self.config.timeout_s)
        self._calls[future] = _Call(episode, method, time.perf_counter())

    def _take_answers(self, ended: list[Episode], *, wait: bool) -> None:
        if wait:  # nothing to decode: block until an environment answers (its own timeout bounds it)
            concurrent.futures.wait(self._calls, timeout=self.config.timeout_s + 5,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        for future in [f for f in self._calls if f.done()]:
            call = self._calls.pop(future)
            episode = call.episode
            episode.env_s += time.perf_counter() - call.started
            try:
                value = future.result()
                if call.method == "reset":
                    tokens = self.codec.encode_first(checked_observation(value, self._name("reset")))
                    self._next_turn(episode, tokens, ended)
                else:
                    self._stepped(episode, *checked_step(value, self._name("step")), ended)
            except EnvThreadsBusy as e:  # not its own fault: the calls before it hang
                self._failed(episode, "timeout", f"{self._name(call.method)} {e}", ended)
            except (TimeoutError, concurrent.futures.TimeoutError):
                self._failed(episode, "timeout", f"{self._name(call.method)} took more than "
                             f"{self.config.timeout_s:g} s", ended)
            except Exception as e:  # the user's environment (EnvProtocolError included): any error
                self._failed(episode, "error", f"{self._name(call.method)} raised {type(e).__name__}: {e}", ended)

    def _name(self, method: str) -> str:
        env = self.config.env
        return f"{env if isinstance(env, str) else env.__name__}.{method}"

    def _stepped(self, episode: Episode, observation: str, reward: float, done: bool,
                 ended: list[Episode]) -> None:
        episode.turn_rewards[-1] = reward
        if done:
            self._end(episode, "done", ended)
        elif episode.turns >= self.config.max_turns:
            self._end(episode, "max_turns", ended)
        else:
            after_eos = self.params.eos_token_id is not None and episode.tokens[-1] == self.params.eos_token_id
            self._next_turn(episode, self.codec.encode(observation, after_eos=after_eos), ended)

    def _failed(self, episode: Episode, outcome: str, reason: str, ended: list[Episode]) -> None:
        uid = f"episode {episode.index}"
        if self.config.on_error == "fail":
            raise EpisodeError(f"{self.where}: {uid}: {reason} ([env] on_error = 'fail'; 'end' ends the "
                               "episode with reward 0 instead)")
        self._say(outcome, f"{uid} ended ({outcome}): {reason}")
        episode.reason = reason
        self._end(episode, outcome, ended)

    def _say(self, kind: str, line: str) -> None:
        """Log ``line``, the first of its ``kind`` in this run; count the others."""
        if kind in self._unsaid:
            self._unsaid[kind] += 1
        else:
            self._unsaid[kind] = 0
            log.warning("%s: %s", self.where, line)

    # ----- turns

    def _next_turn(self, episode: Episode, observation: list[int], ended: list[Episode]) -> None:
        """Append ``observation`` and admit the next turn, unless the budget is spent."""
        left = self.config.max_tokens - len(episode.tokens) - len(observation)
        if left < 1:
            if not episode.turns:  # no turn at all: every episode like it teaches nothing
                episode.reason = (f"reset's observation is {len(observation)} tokens, which leaves no turn within "
                                  f"[env] max_tokens = {self.config.max_tokens}")
                self._say("budget before a turn", f"episode {episode.index} ended (budget) before its first "
                                                  f"turn: {episode.reason}; raise max_tokens or shorten it")
            self._end(episode, "budget", ended)
            return
        episode.observe(observation)
        turn = PartialSample(index=episode.index * MAX_TURNS_LIMIT + episode.turns,
                             prompt=episode.prompt + episode.tokens, response_ids=[], logprobs=[],
                             max_new_tokens=min(left, self.params.max_new_tokens))
        try:
            self.run.admit([turn])
        except ConfigError as e:  # longer than the engine's context
            episode.reason = str(e)
            self._end(episode, "budget", ended)

    def _turn_done(self, episode: Episode, sample: FinishedSample, ended: list[Episode]) -> None:
        episode.act(sample)
        episode.turn_rewards.append(0.0)
        action = self.tokenizer.decode(list(sample.response_ids), skip_special_tokens=True)
        self._submit(episode, "step", action)

    def _end(self, episode: Episode, outcome: str, ended: list[Episode]) -> None:
        episode.outcome = outcome
        self.unfinished -= 1
        ended.append(episode)
