"""The actor's ``generate`` as a streaming method: groups reported as they finish,
unfinished samples handed to another rank and adopted from one.

Output row ``k`` of a rank is sample ``k % n`` of its prompt ``k // n`` (what the
batch ``generate`` returns), and its row id is ``channels.row_id(rank, k)``. A
prompt's ``n`` samples are one group: a group is reported when its last sample
finishes, so micro-batches hold whole groups.

A :class:`~workers.Tail` holds, per sample of every group not yet reported, the
prompt's columns plus ``_tail_*`` columns: row id, tokens and log-probs so far,
the policy version of each token, whether the sample is already finished, the
sampler state when the engine carries one, and how many calls carried it over
(partial rollouts). The adopting rank re-prefills the unfinished ones and reports
the groups under their original row ids. A prompt's own token budget (its optional
``max_new_tokens`` column) travels as one of its columns and stays the budget of
its samples on the adopting rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from channels import ROW_ID_BITS, Batch, ConfigError, SchemaError, row_id
from workers.host import Adopt, Chunk, Finish, Handoff, StreamMethod, Tail
from workers.host import Step as StepEvent
from workers.rewards import masked_token_lists
from workers.roles import _fields as F
from workers.roles._episodes import EpisodeSetup, stream_episodes
from workers.roles._rollout import (
    RolloutEngine,
    params_for_rank,
    prompt_budgets,
    rollout_rows,
)
from workers.roles._training import require_fields
from workers.rollout import FinishedSample, PartialSample, RolloutOutput, SamplingParams

_ID, _TOKENS, _LOGPROBS, _VERSIONS, _LENGTH, _DONE, _RNG, _RNG_LEN, _CARRIES = (
    "_tail_id", "_tail_tokens", "_tail_logprobs", "_tail_versions", "_tail_length", "_tail_done", "_tail_rng",
    "_tail_rng_length", "_tail_carries")
_TAIL = (_ID, _TOKENS, _LOGPROBS, _VERSIONS, _LENGTH, _DONE, _RNG, _RNG_LEN, _CARRIES)
TAIL_LENGTH = _LENGTH
"""The tail rows' column of response tokens so far."""
_LOCAL_MASK = (1 << ROW_ID_BITS) - 1


@dataclass(eq=False)
class _Group:
    """A prompt's samples: its columns (one row) and the members finished so far."""

    columns: dict[str, Tensor]
    prompt: list[int]
    budget: int | None
    """The prompt's own token budget (its ``max_new_tokens`` column); None: the params'."""
    done: dict[int, FinishedSample] = field(default_factory=dict)


class _Rollout:
    """The bookkeeping of one streamed ``generate`` on one rank."""

    def __init__(self, engine: RolloutEngine, prompts: Batch, *, n: int, params: SamplingParams,
                 rank: int, version: int) -> None:
        self.n, self.params, self.version = n, params, version
        self.prompt_names = list(prompts)
        self.row_shapes = {name: tuple(column.shape[1:]) for name, column in prompts.items()}
        """Each prompt column's row shape: an adopted sample's columns must match."""
        lists = masked_token_lists(prompts[F.PROMPT_IDS], prompts[F.PROMPT_MASK])
        budgets = prompt_budgets(prompts, params)
        self.groups: dict[int, _Group] = {}
        for g, prompt in enumerate(lists):
            cols = {k: v[g:g + 1] for k, v in prompts.items()}
            budget = None if budgets is None else budgets[g]
            self.groups[row_id(rank, g * n)] = _Group(columns=cols, prompt=prompt, budget=budget)
        # The engine's own sample indices (0..N-1, what batch generate seeds by) and
        # adopted samples' indices map to row ids.
        self.ids = [row_id(rank, k) for k in range(len(lists) * n)]
        self.rank = rank
        self.versions: dict[int, list[int]] = {}
        """Per row id of an adopted sample: the policy version of each carried token
        (the tokens this run adds are ``version``'s)."""
        self.carries: dict[int, int] = {}
        """Per group: how many calls carried it over (partial rollouts; 0 when absent)."""
        self.must_finish: set[int] = set()
        """Carried groups this call may not carry over again (see :meth:`adopt`)."""
        self.reported = 0
        """Groups reported so far."""
        per_sample = None if budgets is None else [b for b in budgets for _ in range(n)]
        self.run = engine.start([p for p in lists for _ in range(n)], params, max_new_tokens=per_sample)

    def group_of(self, rid: int) -> int:
        return rid - ((rid & _LOCAL_MASK) % self.n)

    def finished(self, samples: Sequence[FinishedSample]) -> list[Chunk]:
        """Record finished samples; the groups they complete, as chunks (one a group)."""
        complete = []
        for s in samples:
            rid = self.ids[s.index]
            key = self.group_of(rid)
            group = self.groups[key]
            group.done[rid] = s
            if len(group.done) == self.n:
                complete.append(self.groups.pop(key))
                self.must_finish.discard(key)
                self.carries.pop(key, None)
                self.reported += 1
        return self._chunks(complete) if complete else []

    def may_stop(self) -> bool:
        """Whether a call that carries its unfinished samples over may end here: no
        group that must finish in it is unfinished, and a group was reported (or
        none is left), so each call makes progress."""
        return not self.must_finish and (self.reported > 0 or not self.groups)

    def _chunks(self, groups: list[_Group]) -> list[Chunk]:
        """``groups``' rows, built together, as one chunk per group."""
        members = [sorted(group.done) for group in groups]
        out = RolloutOutput.from_samples([group.prompt for group in groups for _ in range(self.n)],
                                         [group.done[m] for group, ms in zip(groups, members, strict=True)
                                          for m in ms], self.params)
        columns = (groups[0].columns if len(groups) == 1
                   else {k: torch.cat([group.columns[k] for group in groups]) for k in groups[0].columns})
        rows = rollout_rows(columns, out, n=self.n, params=self.params, version=self.version)
        versions = rows[F.POLICY_VERSION]
        for i, rid in enumerate(m for ms in members for m in ms):
            prefix = self.versions.pop(rid, None)
            if prefix:
                versions[i, :len(prefix)] = torch.tensor(prefix, dtype=versions.dtype)
        n = self.n
        return [Chunk(rows=Batch({name: column[k * n:(k + 1) * n] for name, column in rows.items()}, group_size=n),
                      ids=tuple(ms)) for k, ms in enumerate(members)]

    def _token_versions(self, rid: int, length: int) -> list[int]:
        prefix = self.versions.get(rid, [])
        return prefix[:length] + [self.version] * (length - len(prefix))

    def tail(self) -> Batch:
        """Everything not reported yet, as tail rows (the run is emptied)."""
        partial = {self.ids[p.index]: p for p in self.run.export()}
        width = self.params.max_new_tokens
        rows: list[tuple[_Group, int, list[int], list[float], bool, bytes]] = []
        for key, group in self.groups.items():
            for rid in range(key, key + self.n):
                if rid in group.done:
                    s = group.done[rid]
                    rows.append((group, rid, s.response_ids, s.logprobs, True, b""))
                elif rid in partial:
                    p = partial[rid]
                    rows.append((group, rid, p.response_ids, p.logprobs, False, p.rng_state or b""))
        rng_width = max((len(r[5]) for r in rows), default=0)
        cols: dict[str, Tensor] = {name: torch.cat([r[0].columns[name] for r in rows]) if rows
                                   else torch.zeros(0) for name in self.prompt_names}
        cols[_ID] = torch.tensor([r[1] for r in rows], dtype=torch.int64)
        cols[_TOKENS] = _padded([r[2] for r in rows], width, torch.int64, self.params.pad_token_id)
        cols[_LOGPROBS] = _padded([r[3] for r in rows], width, torch.float32, 0)
        cols[_VERSIONS] = _padded([self._token_versions(r[1], len(r[2])) for r in rows], width, torch.int64, 0)
        cols[_LENGTH] = torch.tensor([len(r[2]) for r in rows], dtype=torch.int64)
        cols[_DONE] = torch.tensor([r[4] for r in rows], dtype=torch.bool)
        cols[_RNG] = _padded([list(r[5]) for r in rows], rng_width, torch.uint8, 0)
        cols[_RNG_LEN] = torch.tensor([len(r[5]) for r in rows], dtype=torch.int64)
        cols[_CARRIES] = torch.tensor([self.carries.get(self.group_of(r[1]), 0) for r in rows], dtype=torch.int64)
        self.groups.clear()
        self.versions.clear()
        self.carries.clear()
        return Batch(cols)

    def adopt(self, tail: Batch, *, limit: int | None = None) -> None:
        """Continue another rank's tail rows here. With ``limit``, they are an earlier
        call's carried samples: they take row ids after this call's own, and the
        groups carried ``limit`` times already must finish in this call (see
        :meth:`may_stop`)."""
        self._check_shapes(tail, carried=limit is not None)
        partial: list[PartialSample] = []
        ids = tail[_ID].tolist()
        carries = tail[_CARRIES].tolist()
        renumber = limit is not None
        if renumber:
            keys = sorted({self.group_of(rid) for rid in ids})
            first = len(self.ids)  # this call's own samples come first
            new_key = {key: row_id(self.rank, first + g * self.n) for g, key in enumerate(keys)}
            ids = [new_key[self.group_of(rid)] + (rid & _LOCAL_MASK) % self.n for rid in ids]
            self.ids.extend([-1] * (len(keys) * self.n))  # reserved: ids by position, set below
        for i, rid in enumerate(ids):
            key = self.group_of(rid)
            self.carries[key] = carries[i]
            if limit is not None and carries[i] >= limit:
                self.must_finish.add(key)
            if key not in self.groups:
                cols = {k: tail[k][i:i + 1] for k in self.prompt_names}
                prompt = masked_token_lists(cols[F.PROMPT_IDS], cols[F.PROMPT_MASK])[0]
                budgets = prompt_budgets(cols, self.params)
                budget = None if budgets is None else budgets[0]
                self.groups[key] = _Group(columns=cols, prompt=prompt, budget=budget)
            length = int(tail[_LENGTH][i])
            tokens = tail[_TOKENS][i, :length].tolist()
            logprobs = tail[_LOGPROBS][i, :length].tolist()
            if length:
                self.versions[rid] = tail[_VERSIONS][i, :length].tolist()
            if renumber:
                index = rid & _LOCAL_MASK
                self.ids[index] = rid
            else:
                index = len(self.ids)
                self.ids.append(rid)
            if bool(tail[_DONE][i]):
                self.groups[key].done[rid] = FinishedSample(index=index, response_ids=tokens, logprobs=logprobs)
                continue
            rng = bytes(tail[_RNG][i, :int(tail[_RNG_LEN][i])].tolist()) or None
            group = self.groups[key]
            partial.append(PartialSample(index=index, prompt=group.prompt, response_ids=tokens,
                                         logprobs=logprobs, rng_state=rng, max_new_tokens=group.budget))
        if partial:
            self.run.admit(partial)

    def _check_shapes(self, tail: Batch, *, carried: bool) -> None:
        """Adopted rows join this call's output: their prompt columns need its row shapes."""
        for name in self.prompt_names:
            column = tail.get(name)
            got = None if column is None else tuple(column.shape[1:])
            if got == self.row_shapes[name]:
                continue
            source = "samples carried over from an earlier call" if carried else "adopted samples"
            have = "lack it" if got is None else f"have rows of shape {list(got)}"
            raise SchemaError(
                f"generate: the {source} {have} in prompt column {name!r}, this call's prompts "
                f"{list(self.row_shapes[name])}; they join this call's output, so every batch a generate with "
                "partial rollouts gets needs the same columns and widths: pad each column to one width for "
                "the run (as PromptDataset.batch does)")


@dataclass(eq=False)
class CarryOver:
    """Partial rollouts: a ``generate`` call decodes at most ``after`` steps (once it
    has reported a group), and its unfinished samples wait here for the next call
    with a carry-over, which continues them (under its weights); a group carried
    ``limit`` times must finish in the call it reaches. ``restart``: they start
    again from their prompts instead (their tokens so far are dropped)."""

    after: int
    limit: int = 1
    restart: bool = False
    rows: Batch | None = None
    """The carried samples as tail rows (see the module docstring), between calls."""

    def keep(self, tail: Batch) -> None:
        """Hold ``tail`` (a run's unfinished groups) for the next call."""
        if not tail.num_rows:
            self.rows = None
            return
        cols = dict(tail)
        cols[_CARRIES] = cols[_CARRIES] + 1
        if self.restart:
            unfinished = ~cols[_DONE]
            cols[_LENGTH] = torch.where(unfinished, 0, cols[_LENGTH])
            for name in (_TOKENS, _LOGPROBS, _VERSIONS):
                cols[name] = torch.where(unfinished[:, None], torch.zeros_like(cols[name]), cols[name])
        self.rows = Batch(cols)


def checked_generate(engine: RolloutEngine, prompts: Batch, *, n: int, params: SamplingParams | None,
                     default: SamplingParams, eos_token_id: int | None, seed_rank: int, rank: int,
                     where: str, version: int, migratable: bool = True,
                     carry: CarryOver | None = None, episodes: EpisodeSetup | None = None) -> StreamMethod:
    """A role's ``generate``: check the call, fill in the model's EOS and the
    per-rank seed, then :func:`stream_rollout` (``version``: the weights' version,
    the rows' ``policy_version``; ``carry``: partial rollouts; ``episodes``: each
    sample is an episode, :func:`~workers.roles._episodes.stream_episodes`).

    Raises:
        ConfigError: ``n`` < 1 or ``params`` is not a SamplingParams (naming ``where``).
        MissingFieldError: the prompts lack ``prompt_ids`` or ``prompt_mask``.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ConfigError(f"{where}: n must be an int >= 1, got {n!r}")
    if params is not None and not isinstance(params, SamplingParams):
        raise ConfigError(f"{where}: params must be a SamplingParams, got {params!r}")
    require_fields(prompts, (F.PROMPT_IDS, F.PROMPT_MASK), where=where)
    chosen = params_for_rank(params or default, eos_token_id=eos_token_id, rank=seed_rank)
    if episodes is not None:
        if carry is not None:
            raise ConfigError(f"{where}: partial rollouts of episodes are planned, not built; set "
                              "train.partial_rollout_decode_steps = 0 with an [env]")
        return (yield from stream_episodes(engine, prompts, n=n, params=chosen, config=episodes.config,
                                           tokenizer=episodes.tokenizer, rank=rank, version=version, where=where))
    return (yield from stream_rollout(engine, prompts, n=n, params=chosen, rank=rank, version=version,
                                      migratable=migratable, carry=carry))


def stream_rollout(engine: RolloutEngine, prompts: Batch, *, n: int, params: SamplingParams,
                   rank: int, version: int = 0, migratable: bool = True,
                   carry: CarryOver | None = None) -> StreamMethod:
    """Generate ``n`` samples per prompt, reporting each prompt's group when its last
    sample finishes (see the module docstring); obeys handoff and adopt controls,
    which a run that is not ``migratable`` (tensor-parallel generation) refuses.
    With ``carry``, the samples it holds are continued first and the call ends
    after ``carry.after`` decode steps once it may (:meth:`_Rollout.may_stop`),
    leaving its unfinished samples in ``carry``."""
    empty = Batch(rollout_rows({k: v[:0] for k, v in prompts.items()}, None, n=n, params=params), group_size=n)
    yield Chunk(rows=empty, ids=())  # the schema, for a rank without prompts
    state = _Rollout(engine, prompts, n=n, params=params, rank=rank, version=version)
    steps = 0
    if carry is not None and carry.rows is not None:
        state.adopt(carry.rows, limit=carry.limit)
        carry.rows = None
    try:
        while True:
            control = yield StepEvent(pending=state.run.pending)
            if isinstance(control, Finish):
                return
            if isinstance(control, Handoff | Adopt) and not migratable:
                raise ConfigError("long-tail migration of a tensor-parallel generation (generation tg > 1) is "
                                  "not supported; stream without migration")
            if isinstance(control, Handoff):
                yield Tail(rows=state.tail())
                return
            if isinstance(control, Adopt):
                state.adopt(control.rows)
                continue
            if state.run.pending:
                for chunk in state.finished(state.run.step()):  # noqa: UP028 (controls come at Steps only)
                    yield chunk
                steps += 1
                if carry is not None and steps >= carry.after and state.run.pending and state.may_stop():
                    carry.keep(state.tail())
                    return
    finally:
        state.run.close()


def _padded(values: Sequence[Sequence[float]] | Sequence[Sequence[int]], width: int, dtype: torch.dtype,
            pad: float) -> Tensor:
    out = torch.full((len(values), width), pad, dtype=dtype)
    for i, v in enumerate(values):
        if len(v):
            out[i, :len(v)] = torch.tensor(list(v), dtype=dtype)
    return out
