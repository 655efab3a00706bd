"""Finished episodes as training rows.

Row ``i`` of a group is episode ``i`` of one prompt: the prompt's columns, then the
episode's sequence after the prompt as the response (right-padded to
``EpisodeConfig.max_tokens``):

- ``response_ids``: observations and the model's turns, in order;
- ``response_mask``: 1 on the tokens the model sampled (the loss's tokens);
- ``observation_mask``: 1 on the observations' tokens (the model reads them, no
  loss is taken on them);
- ``rollout_logprobs``: the rollout's log-prob of each sampled token (0 elsewhere);
- ``policy_version``: the weights' version, every token;
- ``turn_rewards``: each turn's reward, on its last sampled token (0 elsewhere; all
  0 after an environment failure);
- ``episode_reward`` (the sum), ``episode_turns`` and ``episode_outcome``
  (:data:`~workers.episodes.OUTCOMES` index), one value per row.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from workers.episodes._config import OUTCOMES, outcome_code
from workers.episodes._runner import Episode

__all__ = ["EPISODE_COLUMNS", "EPISODE_METRIC_FIELDS", "empty_episode_rows", "episode_metrics", "episode_rows"]

OBSERVATION_MASK = "observation_mask"
TURN_REWARDS = "turn_rewards"
EPISODE_REWARD = "episode_reward"
EPISODE_TURNS = "episode_turns"
EPISODE_OUTCOME = "episode_outcome"
EPISODE_COLUMNS = (OBSERVATION_MASK, TURN_REWARDS, EPISODE_REWARD, EPISODE_TURNS, EPISODE_OUTCOME)
"""The columns episodes add to a generation's rows."""
EPISODE_METRIC_FIELDS = (EPISODE_TURNS, EPISODE_OUTCOME, OBSERVATION_MASK)
"""The columns :func:`episode_metrics` reads."""


def episode_rows(prompt: Mapping[str, Tensor], episodes: Sequence[Episode], *, width: int, pad: int,
                 version: int) -> dict[str, Tensor]:
    """The rows of one prompt's episodes (see the module docstring).

    Args:
        prompt: the prompt's columns, one row each.
        episodes: its episodes, in row order.
        width: the response width (``EpisodeConfig.max_tokens``).
        pad: the padding token id.
        version: the weights' version.
    """
    rows = len(episodes)
    columns = {name: value.expand(rows, *value.shape[1:]).clone() for name, value in prompt.items()}
    ids = torch.full((rows, width), pad, dtype=torch.int64)
    sampled = torch.zeros((rows, width), dtype=torch.int64)
    observed = torch.zeros((rows, width), dtype=torch.int64)
    logprobs = torch.zeros((rows, width), dtype=torch.float32)
    turn_rewards = torch.zeros((rows, width), dtype=torch.float32)
    for i, e in enumerate(episodes):
        length = len(e.tokens)
        ids[i, :length] = torch.tensor(e.tokens, dtype=torch.int64)
        mask = torch.tensor(e.sampled, dtype=torch.bool)
        sampled[i, :length] = mask.long()
        observed[i, :length] = (~mask).long()
        logprobs[i, :length] = torch.tensor(e.logprobs, dtype=torch.float32)
        failed = e.outcome in ("error", "timeout")
        for end, reward in zip(e.turn_ends, e.turn_rewards, strict=True):
            turn_rewards[i, end] = 0.0 if failed else reward
    columns.update({
        "response_ids": ids, "response_mask": sampled, OBSERVATION_MASK: observed, "rollout_logprobs": logprobs,
        "policy_version": torch.full((rows, width), version, dtype=torch.int64), TURN_REWARDS: turn_rewards,
        EPISODE_REWARD: torch.tensor([e.reward for e in episodes], dtype=torch.float32),
        EPISODE_TURNS: torch.tensor([e.turns for e in episodes], dtype=torch.int64),
        EPISODE_OUTCOME: torch.tensor([outcome_code(e.outcome) for e in episodes], dtype=torch.int64),
    })
    return columns


def empty_episode_rows(prompt: Mapping[str, Tensor], *, width: int) -> dict[str, Tensor]:
    """The columns of :func:`episode_rows` with no row (a rank without prompts)."""
    return episode_rows({k: v[:0] for k, v in prompt.items()}, [], width=width, pad=0, version=0)


def episode_metrics(batch: Mapping[str, Tensor]) -> dict[str, float]:
    """Means over rows of episodes (none for rows that are not): ``episode/turns``,
    ``episode/observation_tokens`` and, per outcome, the share of episodes that
    ended so (``episode/done``, ``episode/max_turns``, ``episode/budget``,
    ``episode/error``, ``episode/timeout``)."""
    outcome = batch.get(EPISODE_OUTCOME)
    if outcome is None or not outcome.numel():
        return {}
    out = {"episode/turns": float(batch[EPISODE_TURNS].float().mean()),
           "episode/observation_tokens": float(batch[OBSERVATION_MASK].sum(dim=1).float().mean())}
    for code, name in enumerate(OUTCOMES):
        out[f"episode/{name}"] = float((outcome == code).float().mean())
    return out
