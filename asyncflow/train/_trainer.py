"""The RL run behind ``asyncflow train``: optional SFT warm start, roles placed on
pools, the algorithm's step in a loop with a progress bar, metrics, checkpoints,
resume, held-out evaluation before and after, and a plot of the curves; all of a
run's files in a directory of its own (see :mod:`asyncflow.train._rundir`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from asyncflow.algos import PromptSource, WeightSync
from asyncflow.runtime import (
    CallTimeoutError,
    DataFuture,
    PoolBrokenError,
    Roles,
    Session,
    StreamOptions,
    WorkerDiedError,
    check_answers,
)
from asyncflow.train._ahead import Sampled, SamplesAhead
from asyncflow.train._checkpoint import CheckpointDir, CheckpointError, staged
from asyncflow.train._config import RunConfig, algorithm_in, response_width, sampling_of
from asyncflow.train._evaluation import evaluate
from asyncflow.train._memory import check_memory
from asyncflow.train._metrics import (
    MetricsLog,
    advance_bar,
    plot_curves,
    progress_bar,
    read_metrics,
    truncate_after,
)
from asyncflow.train._prompts import RunPrompts, TrainBatches, response_key, run_prompts
from asyncflow.train._quiet import RunLog
from asyncflow.train._ray_ahead import ray_started_ahead
from asyncflow.train._roles import role_specs
from asyncflow.train._rundir import (
    RunDirs,
    RunLock,
    changed_settings,
    make_output_dir,
    save_settings,
)
from asyncflow.train._signals import Say, StopRequest, TracedSteps
from asyncflow.train._start_model import starting_model
from asyncflow.train._user_modules import importable, worker_python_path
from channels import AsyncflowError, ConfigError
from workers.data import check_fits_context, generate_splits
from workers.models import CharTokenizer
from workers.roles import PartialRollout

logger = logging.getLogger(__name__)
T = TypeVar("T")

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
    run_dir: Path
    """The run's own directory, ``<output_dir>/version_<n>``."""
    plot: Path | None


class Trainer:
    """Runs one configuration.

    Args:
        config: the validated run configuration.
        resume: continue the newest run under ``output_dir`` that has a checkpoint (its
            ``latest``, unless newer runs ended before their first) from its latest
            checkpoint, in its directory; else a new run gets a new directory.
        clean: delete the earlier runs under ``output_dir`` before a new run starts.
        say: where human-readable progress lines go (the CLI prints them).
        progress_bar: show a tqdm bar over RL steps.
        address: the Ray cluster to run on (``Session(address=...)``); None:
            ``RAY_ADDRESS`` when set, else a Ray instance of this machine's own.
        module_dirs: where the config's own modules (reward functions, ...) are
            imported from, in the driver and the workers (the CLI gives the config
            file's directory and the working directory: :func:`module_dirs`).
        terminal_level: the lowest level of the engines' log records (vLLM, Ray,
            transformers) the terminal shows; the records from INFO up go to
            the run's ``engines.log`` (:mod:`asyncflow.train._quiet`).

    Raises:
        ConfigError: both ``resume`` and ``clean``.
    """

    def __init__(self, config: RunConfig, *, resume: bool = False, clean: bool = False, say: Say = logger.info,
                 progress_bar: bool = True, address: str | None = None, module_dirs: Sequence[str] = (),
                 terminal_level: int = logging.WARNING) -> None:
        if resume and clean:
            raise ConfigError("--clean would delete the run --resume continues; pass one of them")
        self.config = config
        self.address = address
        self.resume, self.clean = resume, clean
        self.say = say
        self.progress_bar = progress_bar
        self.module_dirs = tuple(module_dirs)
        self.terminal_level = terminal_level
        self._log: RunLog | None = None
        self.output_dir = Path(config.output_dir)
        self.runs = RunDirs(self.output_dir)
        self._run_dir: Path | None = None
        self._resumed: Path | None = None  # the checkpoint a resumed run continues from
        self._lock: RunLock | None = None  # held on the run directory while the run writes there
        self._ahead: SamplesAhead | None = None
        self._logged = 0  # the last step whose metrics were written

    # ----- set-up -----

    @property
    def run_dir(self) -> Path:
        """This run's directory (``<output_dir>/version_<n>``), chosen by :meth:`run`."""
        assert self._run_dir is not None, "run() chooses the run directory first"
        return self._run_dir

    @property
    def checkpoints(self) -> CheckpointDir:
        """This run's checkpoints."""
        return CheckpointDir(self.run_dir / "checkpoints", keep=self.config.train.keep_checkpoints)

    def model_dir(self) -> str:
        """The policy's starting directory: ``[model]``'s, a GGUF file's conversion or
        the SFT warm start's, the last two made once and shared by the runs with the
        same settings (see :func:`~asyncflow.train._start_model.starting_model`)."""
        make_output_dir(self.output_dir)  # where a warm start or a conversion is kept
        with importable(self.module_dirs):  # an SFT warm start's demonstrations call the config's modules
            return starting_model(self.config, say=self.say)

    def _new_run(self) -> None:
        """A new run directory (with ``clean``, the earlier runs deleted first)."""
        if self.clean and (gone := self.runs.clean()):
            self.say(f"--clean: deleted {len(gone)} earlier run(s) under {self.output_dir}")
        self._run_dir = self.runs.new()
        self._lock = RunLock(self._run_dir)
        self._lock.acquire()
        save_settings(self._run_dir, self.config)
        if self._log is not None:
            self._log.move_into(self._run_dir)
        self.say(f"run directory: {self.run_dir}")

    # ----- the run -----

    async def run(self) -> RunResult:
        """Train; returns held-out accuracy before and after RL.

        Raises:
            ConfigError: ``resume`` without a run or a complete checkpoint to continue, or
                an ``output_dir`` that cannot be made or written (before the SFT warm
                start or a GGUF conversion starts).
            CheckpointError: a checkpoint or the export could not be written.
            RunInterruptedError: see its docstring.
            AsyncflowError: any other error of the RL steps (a reward function's, a role
                method's), with a note (``__notes__``) naming the last step logged and
                the checkpoint to continue from.
        """
        check_answers(self.address)  # before minutes of SFT, not after
        try:
            if self.clean:  # likewise
                self.runs.refuse_busy()
            if self.resume:  # likewise
                latest = self.runs.latest()
                self._run_dir, self._resumed = self.runs.to_resume(steps=self.config.train.steps)
                self._lock = RunLock(self._run_dir)
                self._lock.acquire()
                if latest is not None and latest.name != self._run_dir.name:
                    self.say(f"--resume: {latest.name} ended before its first checkpoint; continuing {self._run_dir.name}")
                if changed := changed_settings(self._run_dir, self.config):
                    self.say(f"warning: --resume with other settings than {self._run_dir.name} started with "
                             f"({'; '.join(changed)}): the run will not repeat the uninterrupted one")
            c = self.config
            if c.sft is not None:  # likewise, and before Ray starts
                splits = generate_splits(c.data.arithmetic)
                check_fits_context(list(splits.train) + list(splits.eval), CharTokenizer(c.sft.model.tokenizer),
                                   max_new_tokens=response_width(c), max_positions=c.sft.model.max_position_embeddings,
                                   fix=f"raise sft.model.max_position_embeddings, or lower {response_key(c)} or "
                                       "data.arithmetic.digits")
            with (RunLog(self.output_dir, terminal_level=self.terminal_level, run_dir=self._run_dir) as self._log,
                  importable(self.module_dirs)):
                worker_env = self._log.worker_env() | worker_python_path(self.module_dirs)
                # Ray and the workers start while the driver prepares the model and the data.
                with ray_started_ahead(c, address=self.address, worker_env=worker_env):
                    return await self._run(worker_env)
        finally:
            if self._lock is not None:
                self._lock.release()

    async def _run(self, worker_env: dict[str, str]) -> RunResult:
        c = self.config
        max_new = sampling_of(c).max_new_tokens
        model_dir = self.model_dir()
        prompts = run_prompts(c, model_dir, response_width(c))
        for line in prompts.summary():
            self.say(line)
        for line in check_memory(c, model_dir, context=prompts.context):  # before the workers load models
            self.say(f"warning: {line}")
        start, state = 0, {}
        if self._resumed is not None:
            state = CheckpointDir.state(self._resumed)
            start = self._logged = int(state["step"])
        async with Session(address=self.address, worker_nice=c.worker_nice, worker_env=worker_env) as session:
            roles = await session.spawn(role_specs(c, _for_workers(model_dir), context=prompts.context))
            self.say(f"roles up: {', '.join(f'{n}@{g.pool.name}({g.layout})' for n, g in roles.items())}; "
                     f"rows move by {session.transport}")
            self.say("pools on nodes: " + "; ".join(
                f"{pool} on {', '.join(dict.fromkeys(n.describe() for n in nodes))}"
                for pool, nodes in session.placement().items()))
            if self._resumed is None:  # made once the workers are up: a run that never started leaves none
                self._new_run()
            else:
                await self._load(roles, self._resumed)
                truncate_after(self.run_dir / "metrics.jsonl", start)
                self.say(f"resuming from {self._resumed} (step {start})")
            before = state.get("accuracy_before")
            if before is None:
                scores = await self._evaluate(session, roles, prompts, max_new)
                before = scores["eval/accuracy"]
                self.say(f"held-out accuracy before RL: {before:.3f}" + _more_scores(scores))
                log = MetricsLog(self.run_dir, tensorboard=False)
                log.write(0, scores)
                log.close()
            stop = StopRequest(self.say)
            stop.install()
            try:
                result = await self._loop(session, roles, prompts, max_new, start=start,
                                          state=state | {"accuracy_before": before}, stop=stop)
            except (WorkerDiedError, CallTimeoutError, PoolBrokenError) as e:
                raise self._interrupted(e, session) from e
            except (RunInterruptedError, CheckpointError):  # their messages say where to continue
                raise
            except AsyncflowError as e:  # a reward function, a role method, the data: what failed is e's
                e.add_note(f"the run stopped after step {self._logged}; {self._where_to_go_on()}")
                raise
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
        log = MetricsLog(self.run_dir)
        algo = algorithm_in(c)
        algo_state = algo.initial_state(c.algorithm)
        if algo_state is not None and "algorithm_state" in state:  # resumed: the state the checkpoint saved
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
            self._ahead = SamplesAhead(session, roles, sampling_of(c), max_staleness=c.train.max_staleness,
                                       last_step=c.train.steps, seed_of=self._seed, next_prompts=source.next,
                                       start=start, sync=sync, partial=partial)
            if self._resumed is not None:
                await self._ahead.restore(self._resumed, state.get("in_flight", []))
        bar = progress_bar(self.progress_bar, start, c.train.steps)
        began, step = time.monotonic(), start
        evaluated: tuple[int, dict[str, float]] = (-1, {})
        traced = TracedSteps(session, self.run_dir, c.train.trace_steps, say=self.say)
        ending = False  # the time budget is spent: no step starts ahead any more

        def evaluates(m: int) -> bool:
            return bool(c.train.eval_every and m % c.train.eval_every == 0 and m < c.train.steps)

        def saves(m: int) -> bool:
            return bool(c.train.checkpoint_every and m % c.train.checkpoint_every == 0)

        def overlap(m: int) -> bool:
            """May step m + 1 start before step m's metrics are back (see SamplesAhead.steps)?"""
            return (c.train.overlap_steps and algo.state_type is None and not algo.draws and not ending
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
                    if self._ahead is not None:  # 1: the next step started before this one's metrics were back
                        metrics["async/overlapped"] = float(in_flight is not None)
                    traced.after_step()
                    tokens = metrics.get("actor/response_tokens", 0.0)
                    metrics["throughput/tokens_per_s"] = tokens / metrics["time/step_s"]
                    if evaluates(step):
                        evaluated = step, await self._evaluate(session, roles, prompts, max_new, version=step)
                        metrics |= evaluated[1]
                    log.write(step, metrics)
                    self._logged = step
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
        if step > start and (not c.train.checkpoint_every or step % c.train.checkpoint_every):
            await self._save(roles, step, state | _saved(algo_state, source))
        if c.train.export_hf != "never":
            await self._export(roles)
        plot = plot_curves(read_metrics(self.run_dir / "metrics.jsonl"), self.run_dir / "curves.png", CURVES)
        return RunResult(accuracy_before=float(state["accuracy_before"]), accuracy_after=after,
                         steps=step, run_dir=self.run_dir, plot=plot)

    def _seed(self, step: int) -> int:
        """The sampling seed of step ``step`` (of batch ``step`` when sampled ahead)."""
        return self.config.seed * 1_000_003 + step

    async def _step(self, roles: Roles, prompts: DataFuture[Any], algo_state: Any, *, seed: int,
                    more: PromptSource | None = None, rollout: DataFuture[Any] | None = None) -> dict[str, float]:
        c = self.config
        stream = None
        if c.train.stream:
            # Episodes do not migrate (planned): their environments live on the rank that runs them.
            migrate = None if c.env is not None else c.train.migrate
            stream = StreamOptions(micro_batch=c.train.stream_micro_batch, migrate=migrate)
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
        """Held-out scores (see :func:`~asyncflow.train._evaluation.evaluate`) of the
        actor's weights of step ``version`` (those a rollout role must hold)."""
        return await evaluate(session, roles, prompts, self.config, self._generate(roles, version), max_new=max_new)

    async def _save(self, roles: Roles, step: int, state: dict[str, Any]) -> None:
        trained = [r for r in ("actor", "critic", "cost_critic") if r in roles]
        with staged(f"writing checkpoint step {step}", self.checkpoints.staging(step),
                    then=self._where_to_go_on) as tmp:
            for role in trained:
                await roles[role].save_checkpoint(_for_workers(tmp / role))
            if self.config.train.export_hf == "checkpoints":
                await roles.actor.export_hf(_for_workers(tmp / "policy"))
            if self._ahead is not None:  # the batches generated ahead, by versions this checkpoint no longer holds
                state = state | {"in_flight": await self._ahead.save(tmp)}
            final = self.checkpoints.commit(tmp, step, state | {"step": step, "seed": self.config.seed})
        self.say(f"checkpoint: {final}")

    async def _export(self, roles: Roles) -> None:
        """The trained policy into ``policy/`` of the run directory, renamed into
        place once complete."""
        policy = self.run_dir / "policy"
        with staged("exporting the policy", self.run_dir / ".tmp_policy", then=self._where_to_go_on) as tmp:
            await roles.actor.export_hf(_for_workers(tmp))
            shutil.rmtree(policy, ignore_errors=True)  # a resumed run's own earlier export
            os.replace(tmp, policy)
        self.say(f"trained policy: {policy} (AutoModelForCausalLM.from_pretrained or vLLM)")

    async def _load(self, roles: Roles, ckpt: Path) -> None:
        for role in ("actor", "critic", "cost_critic"):
            if role in roles:
                if not (ckpt / role).exists():
                    raise ConfigError(f"--resume: checkpoint {ckpt} has no {role} (placement changed?)")
                await roles[role].load_checkpoint(_for_workers(ckpt / role))


def _for_workers(path: str | os.PathLike[str]) -> str:
    """``path`` as the workers are told it: absolute, since a worker's working
    directory is where its Ray node started (a cluster's, or a Ray instance started
    before this run), not necessarily the driver's."""
    return os.path.abspath(path)


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
