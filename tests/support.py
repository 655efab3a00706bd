"""Test helpers: a background event loop for module-scoped sessions, and roles used
by the runtime tests (pickled by value so Ray workers need not import this file)."""

from __future__ import annotations

import asyncio
import ctypes
import importlib.util
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import psutil
import ray
import torch

from asyncflow import DP, AllToAll, Batch, Metrics, OneToAll, Role, register
from asyncflow import transform as af_transform

T = TypeVar("T")


class LoopThread:
    """An event loop in a thread, so one session can serve several tests."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-loop", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 300) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


def expected_x(idx: torch.Tensor, width: int) -> torch.Tensor:
    """The rows Producer.produce makes for row ids ``idx``."""
    return idx.double().unsqueeze(1) * 1000 + torch.arange(width, dtype=torch.float64)


class Producer(Role):
    """Makes ``x`` rows from row ids."""

    @register(protocol=AllToAll(), reads=("idx",), writes=("idx", "x", "mask"), row_lengths="mask")
    def produce(self, batch: Batch, *, width: int) -> dict[str, torch.Tensor]:
        idx = batch["idx"]
        mask = (torch.arange(width) < (idx.unsqueeze(1) % 7 + 1)).long()
        return {"idx": idx, "x": expected_x(idx, width).float(), "mask": mask}


class Consumer(Role):
    """Echoes what it pulled, and says which rows it got."""

    @register(protocol=DP(), reads=("idx", "x"), writes=("idx", "x", "rank"))
    def echo(self, batch: Batch) -> dict[str, torch.Tensor]:
        rank = torch.full((batch.num_rows,), self.ctx.rank)
        return {"idx": batch["idx"].clone(), "x": batch["x"].clone(), "rank": rank}

    @register(protocol=DP(balance="tokens", group_size=2), reads=("idx", "x"), writes=("idx", "x", "rank"))
    def echo_balanced(self, batch: Batch) -> dict[str, torch.Tensor]:
        return self.echo(batch)

    @register(protocol=Metrics(), reads=("x",))
    def total(self, batch: Batch) -> dict[str, float]:
        return {"sum": float(batch["x"].double().sum()), "rows": batch.num_rows}

    @register(protocol=DP(), reads=("adv",), writes=("adv",))
    def needs_adv(self, batch: Batch) -> dict[str, torch.Tensor]:
        return {"adv": batch["adv"]}


class Sleeper(Role):
    """Sleeps, and reports when (start, end) on every rank."""

    @register(protocol=OneToAll())
    def work(self, seconds: float) -> dict[str, Any]:
        start = time.time()
        time.sleep(seconds)
        return {"start": start, "end": time.time(), "pid": os.getpid()}

    @register(protocol=OneToAll())
    def spin(self, seconds: float) -> None:
        """Keeps its thread busy until it ran ``seconds`` of CPU time."""
        start = time.thread_time()
        while time.thread_time() - start < seconds:
            pass

    @register(protocol=OneToAll())
    def raise_after(self, seconds: float, message: str) -> None:
        """Sleeps, then raises ``RuntimeError(message)``."""
        time.sleep(seconds)
        raise RuntimeError(message)

    @register(protocol=OneToAll())
    def pid(self) -> int:
        return os.getpid()

    @register(protocol=OneToAll())
    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    @register(protocol=OneToAll())
    def process_settings(self) -> dict[str, Any]:
        """This worker's niceness and torch intra-op threads, the OpenMP threads
        the calling thread saw before it called torch, and the scheduling policies
        its threads run under (:func:`thread_policies`)."""
        return {"openmp": openmp_threads(), "nice": os.nice(0), "threads": torch.get_num_threads(),
                "policies": thread_policies()}

    @register(protocol=OneToAll())
    def refaults(self) -> float:
        """:func:`malloc_refaults` on the thread role methods run on."""
        return malloc_refaults()


POLICY_NAMES = {"SCHED_OTHER": "normal", "SCHED_BATCH": "batch", "SCHED_IDLE": "idle", "SCHED_FIFO": "fifo",
             "SCHED_RR": "rr"}


def thread_policies(pid: int | str = "self") -> list[str]:
    """The scheduling policies the threads of process ``pid`` run under, by name
    (``"normal"``, ``"batch"``, ``"idle"``, ...), each once, sorted."""
    names = {getattr(os, k): v for k, v in POLICY_NAMES.items() if hasattr(os, k)}
    found = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            policy = os.sched_getscheduler(int(tid))
        except OSError:  # the thread ended
            continue
        found.add(names.get(policy, str(policy)))
    return sorted(found)


def malloc_refaults(blocks: int = 40, size: int = 512 << 10) -> float:
    """Page faults of the calling thread per round of mallocing ``blocks`` blocks of
    ``size`` bytes, writing them and freeing them all (the C library's ``malloc``,
    as torch's CPU tensors get theirs), after a few rounds first: about
    ``blocks * size / 4096`` where freed memory goes back to the system, about 0
    where the process keeps it (``workers.host._allocator``)."""
    import resource

    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]

    def round_() -> None:
        pointers = [libc.malloc(size) for _ in range(blocks)]
        for p in pointers:
            ctypes.memset(p, 1, size)
        for p in pointers:
            libc.free(p)

    for _ in range(3):
        round_()
    start = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for _ in range(10):
        round_()
    return (resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - start) / 10


def openmp_threads() -> int | None:
    """``omp_get_max_threads()`` in the calling thread, from the OpenMP runtime torch
    loaded (None where this process maps none, or off Linux)."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    paths = {line.split()[-1] for line in maps}
    libraries = sorted(p for p in paths if Path(p).name.startswith(("libgomp", "libiomp", "libomp")))
    return int(ctypes.CDLL(libraries[0]).omp_get_max_threads()) if libraries else None


class Probe(Role):
    """Reports what a worker process carries from one session to the next."""

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self.seen_before = hasattr(sys, "_asyncflow_probe")  # set by an earlier session's Probe
        sys._asyncflow_probe = True  # type: ignore[attr-defined]

    @register(protocol=OneToAll())
    def report(self, *, env: str = "", module: str = "") -> dict[str, Any]:
        """The process, a draw of torch's default generator, the session's process
        group, whether a Probe lived here before, variable ``env``, the variables
        Ray's runtime environment set, and whether ``module`` is importable."""
        return {"pid": os.getpid(), "draw": torch.rand(2).tolist(), "world": torch.distributed.get_world_size(),
                "rank": torch.distributed.get_rank(), "seen_before": self.seen_before,
                "env": os.environ.get(env), "threads": torch.get_num_threads(),
                "ray_env": sorted(ray.get_runtime_context().runtime_env.get("env_vars") or {}),
                "module": module and importlib.util.find_spec(module) is not None}


class Slow(Role):
    """Sleeps longer on one rank, then returns rows (a slow rank is not a failure)."""

    @register(protocol=DP(), reads=("x",), writes=("x", "rank"))
    def lag(self, batch: Batch, *, rank: int, seconds: float) -> dict[str, torch.Tensor]:
        if self.ctx.rank == rank:
            time.sleep(seconds)
        return {"x": batch["x"], "rank": torch.full((batch.num_rows,), self.ctx.rank)}


class Carrier(Role):
    """Contracts that depend on the call: carries its input's columns; reads
    ``weight`` only when asked to."""

    @register(protocol=DP(), reads=("x",), carries="batch", writes=("y",))
    def double(self, batch: Batch) -> dict[str, torch.Tensor]:
        return {**batch, "y": batch["x"] * 2}

    @register(protocol=Metrics(), reads=lambda call: ("x", "weight") if call.arguments["weighted"] else ("x",))
    def total(self, batch: Batch, *, weighted: bool) -> dict[str, float]:
        w = batch["weight"] if weighted else torch.ones(batch.num_rows)
        return {"sum": float((batch["x"].double().sum(dim=-1) * w).sum()), "rows": batch.num_rows}


class Faulty(Role):
    """Raises on one rank."""

    @register(protocol=DP(), reads=("x",), writes=("x",))
    def boom(self, batch: Batch, *, on_rank: int, how: str = "raise") -> dict[str, torch.Tensor]:
        if self.ctx.rank == on_rank:
            if how == "exit":
                sys.exit(3)  # the user's code ending "the program": here, its call
            if how == "interrupt":
                raise KeyboardInterrupt
            if how == "none":  # a return forgotten
                return None  # type: ignore[return-value]
            raise ValueError(f"bad row block on rank {self.ctx.rank}")
        return {"x": batch["x"]}


class Collective(Role):
    """Uses the role's mesh: all-reduce over its data-parallel group."""

    @register(protocol=OneToAll())
    def dp_sum(self) -> float:
        t = torch.tensor([float(self.ctx.rank + 1)])
        torch.distributed.all_reduce(t, group=self.ctx.mesh.get_group("dp"))
        return float(t.item())

    @register(protocol=OneToAll())
    def reduce_unless(self, *, raise_on: int = -1, late: int = -1, seconds: float = 0.0) -> float:
        """All-reduce over the pool's group; rank ``late`` joins ``seconds`` late,
        rank ``raise_on`` raises after ``seconds`` instead of joining."""
        if self.ctx.rank in (late, raise_on):
            time.sleep(seconds)
        if self.ctx.rank == raise_on:
            raise RuntimeError(f"rank {self.ctx.rank} gives up before the all-reduce")
        t = torch.tensor([float(self.ctx.rank + 1)])
        torch.distributed.all_reduce(t, group=self.ctx.process_group)
        return float(t.item())


def cost_of_long_answers(prompts: list[str], responses: list[str], answers: list[str]) -> list[float]:
    """A rule cost: longer responses cost more (a stand-in for a safety classifier)."""
    return [float(len(r)) / 10 for r in responses]


def digit_share_reward(prompts: list[str], responses: list[str], answers: list[str]) -> list[float]:
    """Partial credit: the share of a response's characters that are digits (so an
    untrained model's samples differ in reward and an update moves the policy)."""
    return [sum(c.isdigit() for c in r) / max(len(r), 1) for r in responses]


def sleepy_reward(prompts: list[str], responses: list[str], answers: list[str]) -> list[float]:
    """:func:`digit_share_reward` after 2 s: a step long enough to act in the middle of."""
    time.sleep(2.0)
    return digit_share_reward(prompts, responses, answers)


def raising_reward(prompts: list[str], responses: list[str], answers: list[str]) -> list[float]:
    """A reward function with a bug."""
    raise ZeroDivisionError("reward bug")


class DigitsEnv:
    """An environment for the episode runs of the tests: each step answers with the
    action's length (digits, which the character tokenizer encodes), rewards the
    share of the action's characters that are digits, and ends the episode after
    ``turns`` steps; ``sleep_s`` per step (a run to kill mid-episode)."""

    def __init__(self, turns: int = 2, sleep_s: float = 0.0) -> None:
        self.turns, self.sleep_s, self.seen = turns, sleep_s, 0

    async def reset(self, row: Any) -> None:
        return None

    async def step(self, action: str) -> tuple[str, float, bool]:
        if self.sleep_s:
            await asyncio.sleep(self.sleep_s)
        self.seen += 1
        share = sum(c.isdigit() for c in action) / max(len(action), 1)
        return f"{len(action)}=", share / self.turns, self.seen >= self.turns


class StepWithoutAction(DigitsEnv):
    """``step`` written without its argument (a mistake the config check names)."""

    async def step(self) -> tuple[str, float, bool]:  # type: ignore[override]
        return "", 0.0, True


def wait_for_a_checkpoint(proc: subprocess.Popen[str], checkpoints: Path, stderr: Path,
                          *, timeout_s: float = 200) -> None:
    """Wait until the ``asyncflow train`` run ``proc`` has a complete checkpoint
    (``checkpoints/latest``); on its exit or after ``timeout_s`` (inside
    pytest-timeout's 300 s, so that its output is shown), kill it and fail with its
    stderr. Not a given step's directory: a fast run saves and prunes that between
    two polls."""
    import pytest

    deadline = time.monotonic() + timeout_s
    while not (checkpoints / "latest").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            pytest.fail(f"no checkpoint within {timeout_s:.0f} s (exit {proc.returncode}); stderr:\n"
                        f"{stderr.read_text()[-4000:]}")
        time.sleep(0.2)


def stop_process(pid: int, *, timeout_s: float = 10) -> None:
    """Stop process ``pid`` (``SIGSTOP``) and wait until it is reported stopped."""
    process = psutil.Process(pid)
    process.send_signal(signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while process.status() != psutil.STATUS_STOPPED:
        assert time.monotonic() < deadline, f"process {pid} did not stop within {timeout_s:g} s"
        time.sleep(0.001)


Listener = tuple[str, int]


def tcp_listeners(pid: int) -> set[Listener]:
    """``(address, port)`` of each TCP socket ``pid`` listens on; IPv4 addresses that
    an IPv6 socket holds (``::ffff:127.0.0.1``) are written as IPv4."""
    return {(c.laddr.ip.removeprefix("::ffff:"), c.laddr.port)
            for c in psutil.Process(pid).net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN}


def probe_with_tcpstore_clients(listeners: list[Listener], node_ip: str) -> list[str]:
    """The listeners where a TCPStore client could ``set`` then ``get`` a key.

    In a child process, one forked process per listener: a TCPStore client blocks
    without a deadline (inside its connection ping) on a peer that reads and never
    answers, which gloo's listeners do, so the probes still running 8 s after the
    last fork are killed; Ray's gRPC ports answer with HTTP/2 frames and the client
    fails (retrying until its 2 s timeout). Clients on threads of one process held
    each other up: with some fifty listeners, most had not connected when the
    probe gave up, a real TCPStore among them included.
    """
    targets = [f"{node_ip if ip in ('0.0.0.0', '::') else ip}:{port}" for ip, port in listeners]
    try:
        out = subprocess.run([sys.executable, "-c", _PROBE, *targets], capture_output=True,
                             text=True, timeout=40).stdout
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
    return [line for line in out.splitlines() if line.startswith("SERVED")]


_PROBE = textwrap.dedent("""
    import os, signal, sys, time
    from datetime import timedelta
    import torch.distributed as dist

    def probe(host, port):
        try:
            s = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=2),
                              wait_for_workers=False)
            s.set("probe", "1")
            if s.get("probe") == b"1":
                os.write(1, f"SERVED {host} {port}\\n".encode())
        except Exception:
            pass

    children = set()
    for arg in sys.argv[1:]:
        host, port = arg.rsplit(":", 1)
        pid = os.fork()
        if pid == 0:
            probe(host, int(port))
            os._exit(0)
        children.add(pid)
    deadline = time.monotonic() + 8
    while children and time.monotonic() < deadline:
        pid, _ = os.waitpid(-1, os.WNOHANG)
        if pid:
            children.discard(pid)
        else:
            time.sleep(0.01)
    for pid in children:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
""")


class Ticker(Role):
    """A streaming method in miniature: row ``i`` needs ``steps[i]`` steps (one
    step for every row in progress at a time, ``delay`` seconds each) and is
    reported when done; unfinished rows can be handed to another rank."""

    @register(protocol=DP(), reads=("idx", "steps"), writes=("idx", "steps", "value", "done_by"),
              row_lengths="steps")
    def tick(self, batch: Batch, *, delay: float = 0.0, fail_after: int = -1):
        from asyncflow import Adopt, Chunk, Finish, Handoff, Step, Tail
        from channels import row_id

        # Per row in progress: [row id, idx, steps, steps left]
        left = {row_id(self.ctx.rank, i): [int(x), int(s), int(s)]
                for i, (x, s) in enumerate(zip(batch["idx"].tolist(), batch["steps"].tolist(), strict=True))}
        yield Chunk(rows=self._rows([], []), ids=())  # the schema, for a rank without rows
        done = 0
        while True:
            control = yield Step(pending=len(left))
            if isinstance(control, Finish):
                return
            if isinstance(control, Handoff):
                ids = list(left)
                yield Tail(rows=Batch({"rid": torch.tensor(ids, dtype=torch.int64),
                                       "state": torch.tensor([left[i] for i in ids], dtype=torch.int64).view(-1, 3)}))
                return
            if isinstance(control, Adopt):
                for rid, state in zip(control.rows["rid"].tolist(), control.rows["state"].tolist(), strict=True):
                    left[rid] = state
                continue
            time.sleep(delay)
            finished = []
            for rid, state in left.items():
                state[2] -= 1
                if state[2] <= 0:
                    finished.append(rid)
            for rid in sorted(finished):
                done += 1
                if done == fail_after:
                    raise RuntimeError(f"ticker failed after {done} rows")
                yield Chunk(rows=self._rows([left.pop(rid)], [rid]), ids=(rid,))

    def _rows(self, states: list[list[int]], ids: list[int]) -> Batch:
        idx = torch.tensor([s[0] for s in states], dtype=torch.int64)
        steps = torch.tensor([s[1] for s in states], dtype=torch.int64)
        return Batch({"idx": idx, "steps": steps, "value": idx.double() * 10 + steps,
                      "done_by": torch.full((len(states),), self.ctx.rank, dtype=torch.int64)})


class Scorer(Role):
    """A rank-local method (no collective): scores rows, says which rank did and when."""

    def rank_local(self) -> frozenset[str]:
        return frozenset({"score"})

    @register(protocol=DP(), reads=("idx", "value"), writes=("score", "scored_by", "scored_at"))
    def score(self, batch: Batch, *, delay: float = 0.0) -> dict[str, torch.Tensor]:
        time.sleep(delay)
        n = batch.num_rows
        return {"score": batch["value"] * 2, "scored_by": torch.full((n,), self.ctx.rank, dtype=torch.int64),
                "scored_at": torch.full((n,), time.monotonic(), dtype=torch.float64)}


@af_transform(reads=("response_mask",), writes=("idx", "value"))
def value_of_length(batch: Batch) -> dict[str, torch.Tensor]:
    """Scorer inputs from rollout rows: ``value`` = response length."""
    n = batch.num_rows
    return {"idx": torch.arange(n), "value": batch["response_mask"].sum(1).double()}


@af_transform(reads=("value",), writes=("x",))
def x_of_value(batch: Batch) -> dict[str, torch.Tensor]:
    """``x`` for Consumer methods from Ticker rows."""
    return {"x": batch["value"].float().unsqueeze(1)}


def run_local(specs: dict[str, Any], columns: dict[str, torch.Tensor], pool: Any, main: Any,
              timeout: float = 60) -> Any:
    """``main(session, roles, src)`` in an in-process session of ``specs``, with
    ``columns`` put on ``pool`` as ``src``."""
    from asyncflow.runtime._local import LocalSession

    async def wrapped() -> Any:
        async with LocalSession() as session:
            roles = await session.spawn(specs)
            src = await session.put(columns, pool=pool)
            return await asyncio.wait_for(main(session, roles, src), timeout)
    return asyncio.run(wrapped())


def carried_column_reward(prompts: list[str], completions: list[str], answer: list[str], answer_len: list[int],
                          **columns: object) -> list[float]:
    """A reward that checks that a row's extra fields reach it, per row: ``answer_len``
    (an int column) must be ``len(answer)`` (a text column) of the same row."""
    for a, n in zip(answer, answer_len, strict=True):
        if not isinstance(n, int) or n != len(a):
            raise AssertionError(f"answer_len {n!r} does not belong to answer {a!r}")
    return [1.0 if c.strip().startswith(a) else 0.0 for c, a in zip(completions, answer, strict=True)]


def ppo_role_specs(model_dir: str, policy: Any, scoring: Any = None, *, training: Any = None,
                   **actor: Any) -> dict[str, Any]:
    """The roles of a PPO or GRPO step on ``model_dir``: actor and reference on the
    ``policy`` pool, critic and the rule reward on ``scoring`` (default: the same
    pool); ``training`` (a ``TrainingConfig``) for the three model roles, ``actor``:
    more ``ActorConfig`` settings."""
    from asyncflow import RoleSpec
    from workers.engines import TrainingConfig
    from workers.rewards import RuleRewardConfig
    from workers.roles import (
        ActorConfig,
        ActorWorker,
        CriticConfig,
        CriticWorker,
        ReferenceConfig,
        ReferenceWorker,
        RewardWorker,
        ScoreConfig,
    )

    training = training if training is not None else TrainingConfig()
    scoring = scoring if scoring is not None else policy
    return {
        "actor": RoleSpec(cls=ActorWorker, pool=policy,
                          config=ActorConfig(model_dir=model_dir, training=training, **actor)),
        "ref": RoleSpec(cls=ReferenceWorker, pool=policy, config=ReferenceConfig(model_dir=model_dir,
                                                                                 training=training)),
        "critic": RoleSpec(cls=CriticWorker, pool=scoring, config=CriticConfig(model_dir=model_dir,
                                                                               training=training)),
        "reward": RoleSpec(cls=RewardWorker, pool=scoring,
                           config=ScoreConfig(scorer=RuleRewardConfig(tokenizer_dir=model_dir))),
    }


def config_file(tmp_path: Path, name: str) -> Path:
    """Where a test's in-process ``asyncflow train`` run keeps its configuration file
    ``name``.toml: in one directory for every test of this pytest process (beside
    each test's ``tmp_path``), not in the test's own; its outputs stay in ``tmp_path``.
    A run's workers get the config's directory on their ``PYTHONPATH``, and a session
    adopts the workers an earlier one kept only for the same environment: runs whose
    configs share a directory share worker processes (seconds of imports each) from
    one test to the next. A config with a module beside it keeps its own directory."""
    shared = tmp_path.parent / "configs"
    shared.mkdir(exist_ok=True)
    return shared / f"{tmp_path.name}-{name}.toml"
