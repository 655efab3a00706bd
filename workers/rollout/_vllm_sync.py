"""How a :class:`~._vllm.VLLMRolloutEngine` starts, shuts down, takes new weights and sleeps.

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
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

__all__ = ["WeightSync", "weight_sync_for_platform"]


_CPU_BATCHED_TOKENS = 4096
"""vLLM's default ``max_num_batched_tokens`` for ``vllm.LLM`` on CPU."""

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


class WeightSync(Protocol):
    """The platform-specific part of the engine (see the module docstring)."""

    def engine_kwargs(self, *, max_model_len: int) -> dict[str, Any]:
        """Extra ``vllm.LLM`` arguments this strategy needs, for an engine of
        ``max_model_len``."""
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

    def engine_kwargs(self, *, max_model_len: int) -> dict[str, Any]:
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
        # Seeded requests crash vLLM's CPU worker when a prefill is chunked: the model
        # runner rewinds a seeded request's generator after a partial prefill with
        # Generator.get_offset(), which CPU generators do not have ("CPU Generator
        # does not use offset"). A step's prompts exceeding max_num_batched_tokens
        # (4096 on CPU) get chunked, so a large seeded batch crashes. Without chunked
        # prefill the scheduler never splits a prompt: one that does not fit waits
        # for the next step, and the budget must hold the longest sequence.
        return {
            "enable_chunked_prefill": False,
            "max_num_batched_tokens": max(max_model_len, _CPU_BATCHED_TOKENS),
        }

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

    def engine_kwargs(self, *, max_model_len: int) -> dict[str, Any]:
        del max_model_len
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


def weight_sync_for_platform() -> WeightSync:
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
