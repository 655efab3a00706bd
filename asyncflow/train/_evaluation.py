"""Held-out evaluation during a run: greedy accuracy (the mean reward of greedy
responses, by the task's verifier) and, with ``train.eval_samples`` = n, mean@n and
pass@k over n sampled responses per prompt."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from asyncflow.runtime import DataFuture, Roles, Session, merge
from asyncflow.train._config import RunConfig, sampling_of
from asyncflow.train._metrics import pass_at_k
from asyncflow.train._prompts import RunPrompts
from workers.roles import score_summary
from workers.rollout import SamplingParams

EVAL_UID_BASE = 1 << 40
"""Uids of evaluation prompts (never equal to a training prompt's)."""

Generate = Callable[..., DataFuture[Any]]
"""What generates responses: ``generate(prompts, *, n, params)``."""


async def evaluate(session: Session, roles: Roles, prompts: RunPrompts, config: RunConfig, generate: Generate, *,
                   max_new: int) -> dict[str, float]:
    """Held-out scores of the policy ``generate`` samples from.

    Args:
        session: the run's session (the held-out prompts are put into it).
        roles: the run's roles (their ``reward`` scores the responses).
        prompts: the run's prompts; their held-out split is evaluated.
        config: the run's configuration (the rollout's sampling, ``train.eval_samples``
            and ``train.pass_threshold``).
        generate: the actor's ``generate``, or one with the weights of the step evaluated.
        max_new: response tokens at most.

    Returns:
        ``eval/accuracy``, the mean reward of greedy responses; with
        ``train.eval_samples`` = n also ``eval/mean@n`` and ``eval/pass@k``.
    """
    held_out = await session.put(prompts.eval_batch(first_uid=EVAL_UID_BASE))
    r = sampling_of(config)
    greedy = generate(held_out, n=1, params=SamplingParams(temperature=0.0, max_new_tokens=max_new, stop=r.stop))
    stats = score_summary(await roles.reward.stats(roles.reward.score(greedy)))
    out = {"eval/accuracy": float(stats.get("reward/mean", 0.0))}
    n = config.train.eval_samples
    if n:
        params = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=max_new,
                                stop=r.stop)
        sampled = generate(held_out, n=n, params=params)
        rows = await merge(sampled.select("uid"), roles.reward.score(sampled)).fetch()
        out |= pass_at_k(rows["uid"], rows["scores"], n=n, threshold=config.train.pass_threshold)
    return out
