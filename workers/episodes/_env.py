"""Environments: the user's Python code an episode talks to.

An environment is a class named in the config (``[env] class = "my_env:Calculator"``)
and built once per episode with the config's settings as keyword arguments. It has
two methods, each ``async def`` or a plain function:

- ``reset(row) -> observation``: the episode starts; ``row`` is the prompt's row as
  Python values (``row["prompt"]``, ``row["answer"]`` and the data's own columns,
  decoded as reward functions get them). The observation (text, or None for none)
  follows the prompt before the model's first turn.
- ``step(action) -> (observation, reward, done)``: ``action`` is the text of the
  model's turn (its sampled tokens decoded). The observation follows the turn
  (unless ``done``); ``reward`` is the turn's.

Each call runs on the worker's environment loop (:class:`EnvLoop`), so many
episodes wait on their environments at once while the engine decodes the others; a
plain function runs in a thread of its own there.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import math
import numbers
import threading
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from channels import ConfigError
from workers.rewards import load_reward_fn

__all__ = ["EnvLoop", "EnvProtocolError", "Environment", "StepResult", "build_env", "checked_step", "load_env_class"]


class Environment(Protocol):
    """What an episode needs of an environment (``async`` or plain methods)."""

    def reset(self, row: Mapping[str, Any]) -> Any:
        """The episode starts on ``row``; returns the first observation (or None)."""
        ...

    def step(self, action: str) -> Any:
        """The model acted; returns ``(observation, reward, done)``."""
        ...


StepResult = tuple[str, float, bool]
"""``Environment.step``'s answer, checked: the observation ("" for none), the
turn's reward and whether the episode is over."""


class EnvProtocolError(Exception):
    """An environment returned something that is not what the protocol says."""


def load_env_class(spec: str | type, *, key: str = "[env] class") -> type:
    """The environment class ``"module:Class"`` names (or ``spec`` itself).

    Raises:
        ConfigError: the module cannot be imported, has no such class, or the
            class lacks ``reset`` or ``step``.
    """
    cls = spec if isinstance(spec, type) else load_reward_fn(spec, key=key, form="module:Class",
                                                             example="workers.episodes:ToolEnv",
                                                             expected="a class with reset(row) and step(action)")
    if not isinstance(cls, type):
        raise ConfigError(f"{key} = {spec!r} names a {type(cls).__name__}, not a class with reset and step")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise ConfigError(f"{key} = {spec!r}: the class {cls.__name__} has no {' or '.join(missing)} method; "
                          "an environment has reset(row) -> observation and "
                          "step(action) -> (observation, reward, done)")
    return cls


def build_env(cls: type, settings: Mapping[str, Any], *, key: str = "[env]") -> Any:
    """One environment (one episode's): ``cls(**settings)``.

    Raises:
        ConfigError: the settings do not fit the class's constructor.
    """
    try:
        inspect.signature(cls).bind(**settings)
    except TypeError as e:
        raise ConfigError(f"{key} settings {sorted(settings)} do not fit {cls.__name__}: {e}") from None
    except ValueError:  # no signature to read (a builtin): let the call say
        pass
    try:
        return cls(**settings)
    except ConfigError:
        raise
    except Exception as e:  # the user's constructor
        raise ConfigError(f"{key}: {cls.__name__}(**settings) raised {type(e).__name__}: {e}") from None


def checked_observation(value: Any, where: str) -> str:
    """An observation as text ("" for None).

    Raises:
        EnvProtocolError: it is neither text nor None.
    """
    if value is None:
        return ""
    if not isinstance(value, str):
        raise EnvProtocolError(f"{where} returned an observation of type {type(value).__name__}; "
                               "return text (str) or None")
    return value


def checked_step(value: Any, where: str) -> StepResult:
    """``step``'s return value checked: ``(observation, reward, done)``.

    Raises:
        EnvProtocolError: naming what is wrong with it.
    """
    if not isinstance(value, tuple | list) or len(value) != 3:
        raise EnvProtocolError(f"{where} returned {value!r}; return (observation, reward, done)")
    observation, reward, done = value
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(float(reward)):
        raise EnvProtocolError(f"{where} returned reward {reward!r}; return a finite number")
    if not (isinstance(done, bool) or type(done).__name__ in ("bool", "bool_") or (isinstance(done, int) and done in (0, 1))):
        raise EnvProtocolError(f"{where} returned done {done!r} ({type(done).__name__}); return True or False")
    return checked_observation(observation, where), float(reward), bool(done)


ENV_THREADS = 64
"""Threads the environment loop runs plain (synchronous) methods on."""


class EnvLoop:
    """An event loop on a thread of its own, where environment calls run.

    :meth:`submit` is called from the engine's thread and returns a
    ``concurrent.futures.Future``; a plain (synchronous) method runs in the loop's
    thread pool, so one that blocks holds up only its own episode. A call past its
    deadline is cancelled (a plain function's thread cannot be stopped: it runs on,
    its result unused).
    """

    _shared: EnvLoop | None = None
    _lock = threading.Lock()

    def __init__(self, *, threads: int = ENV_THREADS) -> None:
        self.threads = threads
        self.loop = asyncio.new_event_loop()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="env")
        self.loop.set_default_executor(self._pool)
        self._thread = threading.Thread(target=self.loop.run_forever, name="env-loop", daemon=True)
        self._thread.start()

    @classmethod
    def shared(cls) -> EnvLoop:
        """The process's loop, started on first use."""
        with cls._lock:
            if cls._shared is None:
                cls._shared = EnvLoop()
            return cls._shared

    def submit(self, method: Callable[..., Any], *args: Any, timeout_s: float) -> concurrent.futures.Future[Any]:
        """Call ``method(*args)`` on the loop, giving up after ``timeout_s``
        (the future then holds ``TimeoutError``)."""
        return asyncio.run_coroutine_threadsafe(_call(method, args, timeout_s, self.threads), self.loop)


class EnvThreadsBusy(TimeoutError):
    """A plain method's call did not start within its timeout: every thread of the
    environment loop was running a call that hangs."""


async def _call(method: Callable[..., Any], args: tuple[Any, ...], timeout_s: float, threads: int) -> Any:
    started = threading.Event()

    def call() -> Any:
        started.set()
        return method(*args)

    async def run() -> Any:
        if inspect.iscoroutinefunction(method):
            return await method(*args)
        out = await asyncio.get_running_loop().run_in_executor(None, call)
        if inspect.isawaitable(out):  # a plain function that returned a coroutine
            return await _awaited(out)
        return out

    try:
        return await asyncio.wait_for(run(), timeout_s)
    except TimeoutError:
        if inspect.iscoroutinefunction(method) or started.is_set():
            raise
        raise EnvThreadsBusy(f"did not start within {timeout_s:g} s: all {threads} threads of the "
                             "environment loop run calls that hang") from None


async def _awaited(value: Awaitable[Any]) -> Any:
    return await value
