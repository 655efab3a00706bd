"""Multi-turn episodes: the model acts, an environment answers, for several turns.

- An environment is a class of the user's (:class:`Environment`: ``reset(row)``
  and ``step(action)``, ``async`` or not), built once per episode from
  :class:`EpisodeConfig`; :class:`ToolEnv` is a built-in one that makes plain
  functions into tools (chat-template or text call format).
- Token-in, token-out: an episode is one token sequence, each turn exactly the
  tokens the engine sampled, each observation encoded once with its wrapping
  (:class:`ObservationCodec`); :func:`episode_rows` makes training rows of it
  whose loss mask holds the sampled tokens only.
- :class:`EpisodeRun` steps one rank's episodes: the engine decodes the turns of
  some while the others wait on their environments (:class:`EnvLoop`); an
  environment that raises or outlives its timeout ends its episode (outcome
  ``error``/``timeout``, reward 0) or, with ``on_error = "fail"``, the call.
"""

from workers.episodes._codec import ObservationCodec
from workers.episodes._config import MAX_TURNS_LIMIT, OUTCOMES, EpisodeConfig, outcome_code
from workers.episodes._env import (
    Environment,
    EnvLoop,
    EnvProtocolError,
    build_env,
    checked_step,
    load_env_class,
)
from workers.episodes._rows import (
    EPISODE_COLUMNS,
    EPISODE_METRIC_FIELDS,
    empty_episode_rows,
    episode_metrics,
    episode_rows,
)
from workers.episodes._runner import Episode, EpisodeError, EpisodeRun
from workers.episodes._tools import ToolEnv, exact_answer, numeric_answer, parse_tool_calls

__all__ = [
    "EPISODE_COLUMNS", "EPISODE_METRIC_FIELDS", "MAX_TURNS_LIMIT", "OUTCOMES", "EnvLoop", "EnvProtocolError", "Environment", "Episode",
    "EpisodeConfig", "EpisodeError", "EpisodeRun", "ObservationCodec", "ToolEnv", "build_env", "checked_step", "empty_episode_rows",
    "episode_metrics", "episode_reward", "episode_rows", "exact_answer", "load_env_class", "numeric_answer",
    "outcome_code", "parse_tool_calls",
]


def episode_reward(prompts: list[str], completions: list[str], episode_reward: list[float],
                   **columns: object) -> list[float]:
    """The reward function of runs with an environment: each episode's reward (the
    sum of its turns'), as the environment gave it."""
    return [float(r) for r in episode_reward]
