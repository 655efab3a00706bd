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
from asyncflow.train._checkpoint import (
    CheckpointDir,
    CheckpointError,
    for_workers,
    load_roles,
    save_roles,
    staged,
)
from asyncflow.train._config import RunConfig, algorithm_in, response_width, sampling_of
from asyncflow.train._evaluation import evaluate
from asyncflow.train._failures import RunInterruptedError, interrupted
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
from asyncflow.train._rundir import RunDir, RunDirs, make_output_dir
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
        self._dir: RunDir | None = None  # chosen by run(): held while the run writes there
        self._ahead: SamplesAhead | None = None
        self._logged = 0  # the last step whose metrics were written

    # ----- set-up -----

    @property
    def run_dir(self) -> Path:
        """This run's directory (``<output_dir>/version_<n>``), chosen by :meth:`run`."""
        assert self._dir is not None, "run() chooses the run directory first"
        return self._dir.path

    @property
    def checkpoints(self) -> CheckpointDir:
        """This run's checkpoints."""
        assert self._dir is not None, "run() chooses the run directory first"
        return self._dir.checkpoints

    def model_dir(self) -> str:
        """The policy's starting directory: ``[model]``'s, a GGUF file's conversion or
        the SFT warm start's, the last two made once and shared by the runs with the
        same settings (see :func:`~asyncflow.train._start_model.starting_model`)."""
        make_output_dir(self.output_dir)  # where a warm start or a conversion is kept
        with importable(self.module_dirs):  # an SFT warm start's demonstrations call the config's modules
            return starting_model(self.config, say=self.say)

    def _new_run(self) -> None:
        """A new run directory (with ``clean``, the earlier runs deleted first)."""
        self._dir = RunDir.new(self.runs, self.config, clean=self.clean, say=self.say)
        if self._log is not None:
            self._log.move_into(self._dir.path)
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
                self._dir = RunDir.resume(self.runs, self.config, say=self.say)
            c = self.config
            if c.sft is not None:  # likewise, and before Ray starts
                splits = generate_splits(c.data.arithmetic)
                check_fits_context(list(splits.train) + list(splits.eval), CharTokenizer(c.sft.model.tokenizer),
                                   max_new_tokens=response_width(c), max_positions=c.sft.model.max_position_embeddings,
                                   fix=f"raise sft.model.max_position_embeddings, or lower {response_key(c)} or "
                                       "data.arithmetic.digits")
            with (RunLog(self.output_dir, terminal_level=self.terminal_level,
                         run_dir=None if self._dir is None else self._dir.path) as self._log,
                  importable(self.module_dirs)):
                worker_env = self._log.worker_env() | worker_python_path(self.module_dirs)
                # Ray and the workers start while the driver prepares the model and the data.
                with ray_started_ahead(c, address=self.address, worker_env=worker_env):
                    return await self._run(worker_env)
        finally:
            if self._dir is not None:
                self._dir.close()

    async def _run(self, worker_env: dict[str, str]) -> RunResult:
        """The run with SIGTERM / SIGINT caught from Ray's start to its end (see
        :class:`~asyncflow.train._signals.StopRequest`)."""
        stop = StopRequest(self.say)
        stop.install()
        try:
            return await self._stages(worker_env, stop)
        except asyncio.CancelledError:
            if not stop.now:
                raise
            if stop.stepping:
                raise RunInterruptedError(f"stopped by {stop.signal} twice, during a step; "
                                          f"{self._where_to_go_on()}") from None
            if stop.signal == "SIGINT":  # a Ctrl-C outside the steps: the command's own line (cli)
                raise KeyboardInterrupt from None
            raise RunInterruptedError(f"stopped by {stop.signal} before the RL steps; {self._where_to_go_on()}") from None
        finally:
            stop.remove()

    async def _stages(self, worker_env: dict[str, str], stop: StopRequest) -> RunResult:
        c = self.config
        max_new = sampling_of(c).max_new_tokens
        with stop.blocking():  # an SFT warm start runs here, for minutes
            model_dir = self.model_dir()
            prompts = run_prompts(c, model_dir, response_width(c))
        for line in prompts.summary():
            self.say(line)
        for line in check_memory(c, model_dir, context=prompts.context):  # before the workers load models
            self.say(f"warning: {line}")
        resumed = None if self._dir is None else self._dir.resumed
        start, state = 0, {}
        if resumed is not None:
            state = CheckpointDir.state(resumed)
            start = self._logged = int(state["step"])
        async with Session(address=self.address, worker_nice=c.worker_nice, worker_env=worker_env) as session:
            roles = await session.spawn(role_specs(c, for_workers(model_dir), context=prompts.context))
            self.say(f"roles up: {', '.join(f'{n}@{g.pool.name}({g.layout})' for n, g in roles.items())}; "
                     f"rows move by {session.transport}")
            self.say("pools on nodes: " + "; ".join(
                f"{pool} on {', '.join(dict.fromkeys(n.describe() for n in nodes))}"
                for pool, nodes in session.placement().items()))
            if resumed is None:  # made once the workers are up: a run that never started leaves none
                self._new_run()
            else:
                await load_roles(roles, resumed)
                truncate_after(self.run_dir / "metrics.jsonl", start)
                self.say(f"resuming from {resumed} (step {start})")
            before = state.get("accuracy_before")
            if before is None:
                scores = await self._evaluate(session, roles, prompts, max_new)
                before = scores["eval/accuracy"]
                self.say(f"held-out accuracy before RL: {before:.3f}" + _more_scores(scores))
                log = MetricsLog(self.run_dir, tensorboard=False)
                log.write(0, scores)
                log.close()
            stop.begin_steps()
            try:
                return await self._loop(session, roles, prompts, max_new, start=start,
                                        state=state | {"accuracy_before": before}, stop=stop)
            except (WorkerDiedError, CallTimeoutError, PoolBrokenError) as e:
                raise interrupted(e, session, self._where_to_go_on(), signal=stop.signal) from e
            except (RunInterruptedError, CheckpointError):  # their messages say where to continue
                raise
            except AsyncflowError as e:  # a reward function, a role method, the data: what failed is e's
                e.add_note(f"the run stopped after step {self._logged}; {self._where_to_go_on()}")
                raise

    def _where_to_go_on(self) -> str:
        if self._dir is None:  # stopped before the run's directory was made
            return "nothing of the run was written yet (rerun from the start)"
        return self._dir.where_to_go_on()

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
            if self._dir is not None and self._dir.resumed is not None:
                await self._ahead.restore(self._dir.resumed, state.get("in_flight", []))
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
        with staged(f"writing checkpoint step {step}", self.checkpoints.staging(step),
                    then=self._where_to_go_on) as tmp:
            await save_roles(roles, tmp, policy=self.config.train.export_hf == "checkpoints")
            if self._ahead is not None:  # the batches generated ahead, by versions this checkpoint no longer holds
                state = state | {"in_flight": await self._ahead.save(tmp)}
            final = self.checkpoints.commit(tmp, step, state | {"step": step, "seed": self.config.seed})
        self.say(f"checkpoint: {final}")

    async def _export(self, roles: Roles) -> None:
        """The trained policy into ``policy/`` of the run directory, renamed into
        place once complete."""
        policy = self.run_dir / "policy"
        with staged("exporting the policy", self.run_dir / ".tmp_policy", then=self._where_to_go_on) as tmp:
            await roles.actor.export_hf(for_workers(tmp))
            shutil.rmtree(policy, ignore_errors=True)  # a resumed run's own earlier export
            os.replace(tmp, policy)
        self.say(f"trained policy: {policy} (AutoModelForCausalLM.from_pretrained or vLLM)")



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
