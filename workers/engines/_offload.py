"""Offload of a training engine's state to host memory and back (verl's offload).

An actor that generates on the GPU it trains on frees the GPU memory its optimizer
state (and, optionally, its parameters and gradients) takes while it generates. The
move works on storages, not on tensor objects: each storage's bytes are copied into
host memory (pinned on CUDA, copied without blocking) and the device storage is
resized to zero; :meth:`HostCopies.restore` resizes it back and copies the bytes in.
Every tensor object (parameters, DTensor shards, FSDP2's views, optimizer state keyed
by parameter) therefore stays the same object with the same device and metadata, and
the state after a round trip is bit-identical. A tensor must not be used while its
storage is offloaded; :class:`Offloader` records what is, so that the engine can
refuse.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import Tensor, nn

from workers._dtensor import is_dtensor, is_fsdp_module


def local_tensor(tensor: Tensor) -> Tensor:
    """The tensor holding this rank's data: a DTensor's local shard, else itself.

    Args:
        tensor: a plain tensor or a DTensor.

    Returns:
        A plain tensor sharing the storage.
    """
    return tensor.to_local() if is_dtensor(tensor) else tensor


def unique_storages(tensors: Iterable[Tensor], device: torch.device) -> list[torch.UntypedStorage]:
    """The distinct non-empty storages behind ``tensors`` that live on ``device``.

    Tied parameters and views share a storage; it is listed once.

    Args:
        tensors: plain tensors or DTensors.
        device: only storages on this device (type and index) are listed.

    Returns:
        The storages, in first-seen order.
    """
    seen: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        local = local_tensor(tensor)
        if local.device != device:
            continue
        storage = local.untyped_storage()
        if storage.nbytes() > 0:
            seen.setdefault(storage.data_ptr(), storage)
    return list(seen.values())


def _bytes_of(storage: torch.UntypedStorage) -> Tensor:
    """A uint8 tensor over the whole of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class HostCopies:
    """Storages whose bytes wait in host memory while their device memory is freed.

    Waits for nothing: on CUDA the copies are queued on the current stream, which
    orders them before any later use of the freed memory.
    """

    def __init__(
        self, tensors: Iterable[Tensor], *, device: torch.device, host: torch.device
    ) -> None:
        """Copy the storages of ``tensors`` on ``device`` to ``host`` and free them.

        Args:
            tensors: the tensors whose storages move (plain or DTensor).
            device: where they live; tensors elsewhere are left alone.
            host: the host device (``torch.device("cpu")``); pinned memory and
                non-blocking copies when ``device`` is CUDA.
        """
        self._pin = device.type == "cuda"
        self._parked: list[tuple[torch.UntypedStorage, Tensor]] = []
        with torch.no_grad():
            for storage in unique_storages(tensors, device):
                source = _bytes_of(storage)
                copy = torch.empty(source.numel(), dtype=torch.uint8, device=host, pin_memory=self._pin)
                copy.copy_(source, non_blocking=self._pin)
                storage.resize_(0)
                self._parked.append((storage, copy))

    @property
    def nbytes(self) -> int:
        """Bytes held in host memory."""
        return sum(copy.numel() for _, copy in self._parked)

    def restore(self) -> None:
        """Give every storage back its size and its bytes; the host copies are dropped."""
        with torch.no_grad():
            for storage, copy in self._parked:
                storage.resize_(copy.numel())
                _bytes_of(storage).copy_(copy, non_blocking=self._pin)
        self._parked = []


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> Iterator[Tensor]:
    """Every tensor of an optimizer's state (AdamW's moments and step counters)."""
    for state in optimizer.state.values():
        yield from (value for value in state.values() if isinstance(value, Tensor))


def parameter_tensors(model: nn.Module) -> Iterator[Tensor]:
    """Every parameter of ``model`` and its gradient, if it has one.

    An FSDP2 model is resharded first, so that the parameters are the shards (after a
    forward without backward the root's may still be gathered).
    """
    for module in model.modules():
        if is_fsdp_module(module):
            module.reshard()
    for param in model.parameters():
        yield param
        if param.grad is not None:
            yield param.grad


class Offloader:
    """Moves a model's optimizer state, and optionally its parameters and gradients, to
    host memory and back; idempotent both ways."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        device: torch.device,
        host: torch.device | None = None,
    ) -> None:
        """Nothing moves until :meth:`offload`.

        Args:
            model: the (laid out) model.
            optimizer: its optimizer, or None for an inference-only engine.
            device: the device the state lives on.
            host: where it goes (default the CPU).
        """
        self.model = model
        self.optimizer = optimizer
        self.device = device
        self.host = host if host is not None else torch.device("cpu")
        self._optimizer_copy: HostCopies | None = None
        self._params_copy: HostCopies | None = None

    @property
    def optimizer_offloaded(self) -> bool:
        """Whether the optimizer state is in host memory."""
        return self._optimizer_copy is not None

    @property
    def params_offloaded(self) -> bool:
        """Whether the parameters (and gradients) are in host memory."""
        return self._params_copy is not None

    def offload(self, *, params: bool = False) -> None:
        """Move the optimizer state (and with ``params`` the parameters and gradients)
        to host memory; what is there already stays.

        Args:
            params: also move the parameters and gradients.
        """
        if self.optimizer is not None and self._optimizer_copy is None:
            self._optimizer_copy = HostCopies(
                optimizer_tensors(self.optimizer), device=self.device, host=self.host
            )
        if params and self._params_copy is None:
            self._params_copy = HostCopies(
                parameter_tensors(self.model), device=self.device, host=self.host
            )

    def reload(self) -> None:
        """Bring everything :meth:`offload` moved back to the device (no-op if nothing)."""
        for copy in (self._params_copy, self._optimizer_copy):
            if copy is not None:
                copy.restore()
        self._params_copy = self._optimizer_copy = None
