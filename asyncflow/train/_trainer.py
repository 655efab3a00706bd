"""The RL run behind ``asyncflow train``: optional SFT warm start, roles placed on
pools, the algorithm's step in a loop with a progress bar, metrics, checkpoints,
resume, held-out evaluation before and after, and a plot of the curves."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from asyncflow._datastream import StreamOptions
from asyncflow._errors import CallTimeoutError, PoolBrokenError, WorkerDiedError
from asyncflow._future import DataFuture
from asyncflow._ops import merge
from asyncflow._proxy import Roles
from asyncflow._ray_start import check_answers
from asyncflow._session import Session
from asyncflow.algos import PromptSource, WeightSync
from asyncflow.train._ahead import Sampled, SamplesAhead
from asyncflow.train._checkpoint import CheckpointDir
from asyncflow.train._config import RunConfig, algorithm_in, rollout_of
from asyncflow.train._memory import check_memory
from asyncflow.train._metrics import (
    MetricsLog,
    advance_bar,
    pass_at_k,
    plot_curves,
    progress_bar,
    read_metrics,
    truncate_after,
)
from asyncflow.train._prompts import RunPrompts, TrainBatches, run_prompts
from asyncflow.train._roles import role_specs
from asyncflow.train._signals import Say, StopRequest, TracedSteps
from channels import AsyncflowError, ConfigError
from workers.models import CharTokenizer, check_supported_checkpoint, gguf_to_hf_dir
from workers.roles import PartialRollout, score_summary
from workers.rollout import SamplingParams
from workers.tasks import check_fits_context, generate_splits, sft_warm_start

logger = logging.getLogger(__name__)
T = TypeVar("T")

EVAL_UID_BASE = 1 << 40
"""Uids of evaluation prompts (never equal to a training prompt's)."""

CURVES = ("reward/mean", "actor/kl_to_ref", "eval/accuracy", "actor/logprob_mismatch")


class RunInterruptedError(AsyncflowError):
    """A run stopped because a worker process died, a call on it stalled past its
    timeout (a weight pull), or SIGTERM / SIGINT asked it to (see
    :class:`~asyncflow.train._signals.StopRequest`); the message names why and the
    checkpoint to continue from."""


@dataclass
class RunResult:
    """What a run reports at the end."""

    accuracy_before: float
    accuracy_after: float
    steps: int
    output_dir: Path
    plot: Path | None


class Trainer:
    """Runs one configuration.

    Args:
        config: the validated run configuration.
        resume: continue from the latest checkpoint in ``output_dir``.
        say: where human-readable progress lines go (the CLI prints them).
        progress_bar: show a tqdm bar over RL steps.
        address: the Ray cluster to run on (``Session(address=...)``); None:
            ``RAY_ADDRESS`` when set, else a Ray instance of this machine's own.
    """

    def __init__(self, config: RunConfig, *, resume: bool = False, say: Say = logger.info,
                 progress_bar: bool = True, address: str | None = None) -> None:
        self.config = config
        self.address = address
        self.resume = resume
        self.say = say
        self.progress_bar = progress_bar
        self.out = Path(config.output_dir)
        self.checkpoints = CheckpointDir(self.out / "checkpoints", keep=config.train.keep_checkpoints)
        self._ahead: SamplesAhead | None = None

    # ----- set-up -----

    def model_dir(self) -> str:
        """The policy's starting directory: ``[model]``'s, or the SFT warm start's
        (``<output_dir>/sft_model``, trained once per settings and reused)."""
        c = self.config
        if c.sft is None:
            if c.model.gguf:
                target = self.out / "model_from_gguf"
                self.say(f"model: {c.model.gguf} -> {target} (dequantised; once per file)")
                return str(gguf_to_hf_dir(c.model.gguf, target, key="model.gguf"))
            check_supported_checkpoint(Path(c.model.path))
            return c.model.path
        target = self.out / "sft_model"
        sft = msgspec.structs.replace(c.sft, task=c.task)
        stamp = target / "asyncflow_sft.json"
        if stamp.exists() and stamp.read_bytes() == msgspec.json.encode(sft):
            self.say(f"SFT warm start: reusing {target} (same settings)")
            return str(target)
        shutil.rmtree(target, ignore_errors=True)
        self.say(f"SFT warm start: up to {sft.steps} steps, until {sft.stop_at_train_accuracy or 'all'} "
                 f"train accuracy (at most {sft.max_seconds or 'unlimited'} s) ...")
        t = time.monotonic()
        metrics = sft_warm_start(target, sft)
        stamp.write_bytes(msgspec.json.encode(sft))
        self.say(f"SFT warm start done in {time.monotonic() - t:.0f} s: "
                 + ", ".join(f"{k}={v:.3g}" for k, v in metrics.items()))
        return str(target)

    # ----- the run -----

    async def run(self) -> RunResult:
        """Train; returns held-out accuracy before and after RL."""
        c = self.config
        check_answers(self.address)  # before minutes of SFT, not after
        self.out.mkdir(parents=True, exist_ok=True)
        max_new = rollout_of(c).max_new_tokens
        if c.sft is not None:  # fail before minutes of SFT, not after
            splits = generate_splits(c.task)
            check_fits_context(list(splits.train) + list(splits.eval), CharTokenizer(c.sft.model.tokenizer),
                               max_new_tokens=max_new, max_positions=c.sft.model.max_position_embeddings)
        model_dir = self.model_dir()
        prompts = run_prompts(c, model_dir, max_new)
        for line in prompts.summary():
            self.say(line)
        for line in check_memory(c, model_dir, context=prompts.context):  # before the workers start
            self.say(f"warning: {line}")
        start, state = 0, {}
        if not self.resume:  # a new run: the previous run's results go
            for old in ("metrics.jsonl", "curves.png"):
                (self.out / old).unlink(missing_ok=True)
            for old in ("tensorboard", "checkpoints"):
                shutil.rmtree(self.out / old, ignore_errors=True)
            self.checkpoints = CheckpointDir(self.out / "checkpoints", keep=c.train.keep_checkpoints)
        if self.resume:
            ckpt = self.checkpoints.latest()
            state = CheckpointDir.state(ckpt)
            start = int(state["step"])
            truncate_after(self.out / "metrics.jsonl", start)
            self.say(f"resuming from {ckpt} (step {start})")
        async with Session(address=self.address, worker_nice=c.worker_nice) as session:
            roles = await session.spawn(role_specs(c, model_dir, context=prompts.context))
            self.say(f"roles up: {', '.join(f'{n}@{g.pool.name}({g.layout})' for n, g in roles.items())}; "
                     f"rows move by {session.transport}")
            self.say("pools on nodes: " + "; ".join(
                f"{pool} on {', '.join(dict.fromkeys(n.describe() for n in nodes))}"
                for pool, nodes in session.placement().items()))
            if self.resume:
                await self._load(roles, self.checkpoints.latest())
            before = state.get("accuracy_before")
            if before is None:
                scores = await self._evaluate(session, roles, prompts, max_new)
                before = scores["eval/accuracy"]
                self.say(f"held-out accuracy before RL: {before:.3f}" + _more_scores(scores))
                log = MetricsLog(self.out, tensorboard=False)
                log.write(0, scores)
                log.close()
            stop = StopRequest(self.say)
            stop.install()
            try:
                result = await self._loop(session, roles, prompts, max_new, start=start,
                                          state=state | {"accuracy_before": before}, stop=stop)
            except (WorkerDiedError, CallTimeoutError, PoolBrokenError) as e:
                raise self._interrupted(e, session) from e
            except asyncio.CancelledError:
                if not stop.now:
                    raise
                raise RunInterruptedError(f"stopped by {stop.signal} twice, during a step; "
                                          f"{self._where_to_go_on()}") from None
            finally:
                stop.remove()
        return result

    def _interrupted(self, error: WorkerDiedError | CallTimeoutError | PoolBrokenError,
                     session: Session) -> RunInterruptedError:
        """One line: which process died (or stalled) on which node, and where the run
        can continue from."""
        died = error.cause if isinstance(error, PoolBrokenError) else error
        assert isinstance(died, WorkerDiedError | CallTimeoutError)
        who = f"{died.role} " if died.role else ""
        doing = f" during {died.role}.{died.method}" if died.role else ""
        where = self._where_to_go_on()
        if isinstance(died, CallTimeoutError):
            return RunInterruptedError(f"{died.role}.{died.method} stalled on rank {died.rank} of pool {died.pool!r}: "
                                       f"{died.cause}; {where}")
        process = f"the {who}worker process of rank {died.rank} in pool {died.pool!r}"
        try:
            node = session.where(died.pool, died.rank)
            if session.has_left(node):
                return RunInterruptedError(f"{node.describe()} left the Ray cluster: {process} died{doing}; {where}")
            process += f" on {node.describe()}"
        except KeyError:  # not a rank of a pool (a producer's label)
            pass
        return RunInterruptedError(f"{process} died{doing}; {where}")

    def _where_to_go_on(self) -> str:
        done = self.checkpoints.complete()
        return (f"last checkpoint: {done[-1]} (continue with --resume)" if done
                else "no checkpoint was written yet (rerun from the start)")

    async def _loop(self, session: Session, roles: Roles, prompts: RunPrompts, max_new: int, *, start: int,
                    state: dict[str, Any], stop: StopRequest) -> RunResult:
        c = self.config
        log = MetricsLog(self.out)
        algo = algorithm_in(c)
        algo_state = None
        if algo.state is not None:
            algo_state = algo.state(c.algorithm)
            if "algorithm_state" in state:  # resumed: the state the checkpoint saved
                algo_state = msgspec.convert(state["algorithm_state"], type(algo_state))
        # The data position of a resumed run: the batches drawn so far (one a step,
        # unless the algorithm draws more, as DAPO's dynamic sampling does).
        source = TrainBatches(session, prompts, c.train.prompts_per_step, seed=c.seed,
                               skip=int(state.get("batches_drawn", start)))
        if "rollout" in roles:  # generation on its own pool, up to max_staleness steps ahead
            sync = WeightSync(roles.actor, roles.rollout, bucket_bytes=max(1, int(c.train.weight_sync_bucket_mb * 2**20)),
                              timeout_s=c.train.weight_sync_timeout_s or None)
            partial = (PartialRollout(c.train.partial_rollout_decode_steps, c.train.partial_rollout,
                                      c.train.partial_rollout_max_carries)
                       if c.train.partial_rollout_decode_steps else None)
            self._ahead = SamplesAhead(session, roles, rollout_of(c), max_staleness=c.train.max_staleness,
                                       last_step=c.train.steps, seed_of=self._seed, next_prompts=source.next,
                                       start=start, sync=sync, partial=partial)
            if self.resume:
                await self._ahead.restore(self.checkpoints.latest(), state.get("in_flight", []))
        bar = progress_bar(self.progress_bar, start, c.train.steps)
        began, step = time.monotonic(), start
        evaluated: tuple[int, dict[str, float]] = (-1, {})
        traced = TracedSteps(session, self.out, c.train.trace_steps, say=self.say)
        ending = False  # the time budget is spent: no step starts ahead any more

        def evaluates(m: int) -> bool:
            return bool(c.train.eval_every and m % c.train.eval_every == 0 and m < c.train.steps)

        def saves(m: int) -> bool:
            return bool(c.train.checkpoint_every and m % c.train.checkpoint_every == 0)

        def overlap(m: int) -> bool:
            """May step m + 1 start before step m's metrics are back (see SamplesAhead.steps)?"""
            return (c.train.overlap_steps and algo.state is None and not algo.draws and not ending
                    and stop.signal is None and not evaluates(m) and not saves(m)
                    and not (traced.on and traced.left <= 1))

        async def run(m: int, sampled: Sampled | None = None, ahead: dict[str, float] | None = None) -> dict[str, float]:
            await traced.before_step()
            drawn = sampled.prompts if sampled is not None else await source.next()
            return await self._step(step_roles, drawn, algo_state, seed=self._seed(m), more=source.next,
                                    rollout=sampled.rows if sampled is not None else None) | (ahead or {})

        step_roles = self._ahead.step_roles() if self._ahead is not None else roles
        steps = (self._ahead.steps(start + 1, c.train.steps, run, overlap=overlap) if self._ahead is not None
                 else _one_by_one(start + 1, c.train.steps, run))
        try:
            t = time.monotonic()
            async with contextlib.aclosing(steps):
                async for step, metrics in steps:
                    in_flight = self._ahead.started if self._ahead is not None else None  # started before this ended
                    metrics["time/step_s"] = time.monotonic() - t
                    traced.after_step()
                    tokens = metrics.get("actor/response_tokens", 0.0)
                    metrics["throughput/tokens_per_s"] = tokens / metrics["time/step_s"]
                    if evaluates(step):
                        evaluated = step, await self._evaluate(session, roles, prompts, max_new, version=step)
                        metrics |= evaluated[1]
                    log.write(step, metrics)
                    advance_bar(bar, metrics)
                    if saves(step) or (stop.signal is not None and in_flight is None):
                        await self._save(roles, step, state | _saved(algo_state, source))
                    if stop.signal is not None and in_flight is None:
                        raise RunInterruptedError(f"stopped by {stop.signal} after step {step}; "
                                                  f"{self._where_to_go_on()}")
                    if c.train.max_seconds and time.monotonic() - began > c.train.max_seconds:
                        ending = True
                        if in_flight is None:
                            self.say(f"time budget of {c.train.max_seconds:.0f} s reached after step {step}")
                            break
                    t = time.monotonic()
        finally:
            if bar is not None:
                bar.close()
            traced.close()
        if evaluated[0] == step:  # the time budget ended the run right after an evaluation
            scores = evaluated[1]
        else:
            scores = await self._evaluate(session, roles, prompts, max_new, version=step)
            log.write(step, scores)
        after = scores["eval/accuracy"]
        if scores.keys() - {"eval/accuracy"}:
            self.say("held-out after RL:" + _more_scores(scores))
        log.close()
        if not c.train.checkpoint_every or step % c.train.checkpoint_every:
            await self._save(roles, step, state | _saved(algo_state, source))
        if c.train.export_hf != "never":
            await roles.actor.export_hf(str(self.out / "policy"))
            self.say(f"trained policy: {self.out / 'policy'} (AutoModelForCausalLM.from_pretrained or vLLM)")
        plot = plot_curves(read_metrics(self.out / "metrics.jsonl"), self.out / "curves.png", CURVES)
        return RunResult(accuracy_before=float(state["accuracy_before"]), accuracy_after=after,
                         steps=step, output_dir=self.out, plot=plot)

    def _seed(self, step: int) -> int:
        """The sampling seed of step ``step`` (of batch ``step`` when sampled ahead)."""
        return self.config.seed * 1_000_003 + step

    async def _step(self, roles: Roles, prompts: DataFuture[Any], algo_state: Any, *, seed: int,
                    more: PromptSource | None = None, rollout: DataFuture[Any] | None = None) -> dict[str, float]:
        c = self.config
        stream = None
        if c.train.stream:
            stream = StreamOptions(micro_batch=c.train.stream_micro_batch, migrate=c.train.migrate)
        return await algorithm_in(c).run_step(roles, prompts, c.algorithm, seed=seed, stream=stream,
                                              state=algo_state, more=more, rollout=rollout)

    def _generate(self, roles: Roles, version: int) -> Callable[..., DataFuture[Any]]:
        """What generates for evaluation: the actor, or the rollout role with the
        actor's weights of ``version`` (before the first step it holds them)."""
        if "rollout" not in roles:
            return roles.actor.generate
        if self._ahead is None:
            return roles.rollout.generate
        ahead = self._ahead
        return lambda prompts, *, n, params: ahead.generate_now(prompts, version=version, n=n, params=params)

    async def _evaluate(self, session: Session, roles: Roles, prompts: RunPrompts, max_new: int, *,
                        version: int = 0) -> dict[str, float]:
        """Held-out scores: ``eval/accuracy``, the mean reward of greedy responses (the
        task's verifier); with ``train.eval_samples`` = n also ``eval/mean@n`` and
        ``eval/pass@k`` over n sampled responses per prompt. ``version``: the actor's
        step (the weights a rollout role must hold)."""
        c = self.config
        held_out = await session.put(prompts.eval_batch(first_uid=EVAL_UID_BASE))
        r = rollout_of(c)
        generate = self._generate(roles, version)
        greedy = generate(held_out, n=1, params=SamplingParams(temperature=0.0, max_new_tokens=max_new, stop=r.stop))
        stats = score_summary(await roles.reward.stats(roles.reward.score(greedy)))
        out = {"eval/accuracy": float(stats.get("reward/mean", 0.0))}
        n = c.train.eval_samples
        if n:
            params = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=max_new,
                                    stop=r.stop)
            sampled = generate(held_out, n=n, params=params)
            rows = await merge(sampled.select("uid"), roles.reward.score(sampled)).fetch()
            out |= pass_at_k(rows["uid"], rows["scores"], n=n, threshold=c.train.pass_threshold)
        return out

    async def _save(self, roles: Roles, step: int, state: dict[str, Any]) -> None:
        tmp = self.checkpoints.staging(step)
        trained = [r for r in ("actor", "critic", "cost_critic") if r in roles]
        for role in trained:
            await roles[role].save_checkpoint(str(tmp / role))
        if self.config.train.export_hf == "checkpoints":
            await roles.actor.export_hf(str(tmp / "policy"))
        if self._ahead is not None:  # the batches generated ahead, by versions this checkpoint no longer holds
            state = state | {"in_flight": await self._ahead.save(tmp)}
        final = self.checkpoints.commit(tmp, step, state | {"step": step, "seed": self.config.seed})
        self.say(f"checkpoint: {final}")

    async def _load(self, roles: Roles, ckpt: Path) -> None:
        for role in ("actor", "critic", "cost_critic"):
            if role in roles:
                if not (ckpt / role).exists():
                    raise ConfigError(f"--resume: checkpoint {ckpt} has no {role} (placement changed?)")
                await roles[role].load_checkpoint(str(ckpt / role))


async def _one_by_one(first: int, last: int, run: Callable[[int], Awaitable[T]]) -> AsyncGenerator[tuple[int, T], None]:
    """Steps ``first .. last``, each started after the one before ended."""
    for step in range(first, last + 1):
        yield step, await run(step)


def _saved(algo_state: Any, source: TrainBatches) -> dict[str, Any]:
    """The algorithm's state and the data position, as a checkpoint keeps them."""
    out: dict[str, Any] = {"batches_drawn": source.drawn}
    if algo_state is not None:
        out["algorithm_state"] = msgspec.to_builtins(algo_state)
    return out


def _more_scores(scores: dict[str, float]) -> str:
    more = {k.removeprefix("eval/"): v for k, v in scores.items() if k != "eval/accuracy"}
    return "".join(f", {k} {v:.3f}" for k, v in more.items())
