"""``generate`` with an environment: each sample is an episode.

A role whose config holds an :class:`~workers.episodes.EpisodeConfig` runs episodes
where it would sample one response: the same call, the same streaming (each
prompt's group of ``n`` episodes is reported when its last episode ends), rows
laid out as :func:`~workers.episodes.episode_rows` says. Long-tail migration and
partial rollouts of episodes are not built (planned): a stream that asks for them
is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from channels import Batch, ConfigError, row_id
from workers.episodes import (
    Episode,
    EpisodeConfig,
    EpisodeRun,
    empty_episode_rows,
    episode_rows,
    load_env_class,
)
from workers.host import Adopt, Chunk, Finish, Handoff, StreamMethod
from workers.host import Step as StepEvent
from workers.models import PromptTokenizer, load_prompt_tokenizer
from workers.rewards import masked_token_lists, row_columns
from workers.roles import _fields as F
from workers.rollout import SamplingParams

__all__ = ["EpisodeSetup", "stream_episodes"]


@dataclass(frozen=True, eq=False)
class EpisodeSetup:
    """What a generating role needs for episodes: the settings and the policy's
    tokenizer. Built when the role starts, so a bad environment class fails there."""

    config: EpisodeConfig
    tokenizer: PromptTokenizer

    @classmethod
    def of(cls, config: EpisodeConfig | None, model_dir: str) -> EpisodeSetup | None:
        """The setup of a role with ``config`` (None: the role samples single responses)."""
        if config is None:
            return None
        load_env_class(config.env)
        return cls(config, load_prompt_tokenizer(model_dir))

_NOT_FOR_ENV = frozenset({F.PROMPT_MASK})


def stream_episodes(engine: Any, prompts: Batch, *, n: int, params: SamplingParams, config: EpisodeConfig,
                    tokenizer: PromptTokenizer, rank: int, version: int, where: str) -> StreamMethod:
    """Run ``n`` episodes per prompt, reporting each prompt's group when its last
    episode ends (a streaming method, see ``workers.host``)."""
    width = config.max_tokens
    yield Chunk(rows=Batch(empty_episode_rows(dict(prompts), width=width), group_size=n), ids=())
    lists = masked_token_lists(prompts[F.PROMPT_IDS], prompts[F.PROMPT_MASK])
    env_columns = {k: v for k, v in prompts.items() if k not in _NOT_FOR_ENV and not k.startswith("_")}
    values = row_columns(env_columns, tokenizer)
    rows = [{name: column[g] for name, column in values.items()} for g in range(len(lists))]
    run = EpisodeRun(engine, lists, rows, n=n, params=params, config=config, tokenizer=tokenizer, where=where)
    groups: dict[int, dict[int, Episode]] = {}
    try:
        while True:
            control = yield StepEvent(pending=run.pending)
            if isinstance(control, Finish):
                return
            if isinstance(control, Handoff | Adopt):
                raise ConfigError(f"{where}: long-tail migration of episodes is planned, not built; stream "
                                  "episodes without migration (StreamOptions(migrate=False))")
            if not run.pending:
                continue
            for episode in run.advance():
                g = episode.index // n
                done = groups.setdefault(g, {})
                done[episode.index] = episode
                if len(done) < n:
                    continue
                del groups[g]
                members = sorted(done)
                cols = episode_rows({k: v[g:g + 1] for k, v in prompts.items()}, [done[k] for k in members],
                                    width=width, pad=params.pad_token_id, version=version)
                yield Chunk(rows=Batch(cols, group_size=n), ids=tuple(row_id(rank, k) for k in members))
    finally:
        run.close()
