"""The training engine's state: where it lives and how it persists.

:class:`EngineState` is the part of :class:`~workers.engines.TrainingEngine` that
moves the model's and the optimizer's state between the device and host memory
(:meth:`~EngineState.offload`, :meth:`~EngineState.reload`), measures it, and saves,
restores and exports it (DCP checkpoints, Hugging Face directories, full weights for
rollout engines). The engine's constructor sets the attributes it reads.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn

from workers.engines import _checkpoint
from workers.engines._checkpoint import ExportWriter, Generators
from workers.engines._errors import EngineConfigError
from workers.engines._layout import ModelLayout
from workers.engines._memory import MemoryFootprint, measure_memory
from workers.engines._offload import Offloader

__all__ = ["EngineState"]


class EngineState:
    """Offloading, memory, checkpoints and weights of a training engine (its base)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    device: torch.device
    process_group: dist.ProcessGroup | None
    _offloader: Offloader
    _layout: ModelLayout
    _step: int

    # -------------------------------------------------------------------- memory

    def offload(self, *, params: bool = False) -> None:
        """Move the optimizer state (and with ``params`` the parameters and gradients)
        to host memory, freeing the device memory for something else (generation on
        the same GPU). Idempotent; a no-op on a CPU engine.

        On CUDA the bytes go to pinned host memory without blocking and the freed
        memory is returned to the driver (``torch.cuda.empty_cache``). Until
        :meth:`reload`, :meth:`train_step`, :meth:`save` and :meth:`load` raise, and
        with ``params`` so do the forward passes and weight export. Local to this
        rank (not a collective).

        Args:
            params: also move the parameters and any gradients.
        """
        if self.device.type == "cpu":
            return
        self._offloader.offload(params=params)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def reload(self) -> None:
        """Bring back what :meth:`offload` moved; training then continues bit-identically
        to a run that never offloaded. Idempotent; a no-op on a CPU engine."""
        self._offloader.reload()

    def memory_footprint(self) -> MemoryFootprint:
        """Bytes of this rank's state on the engine's device now, by kind.

        Returns:
            Parameters, gradients (0 between steps) and optimizer state; offloaded
            state counts 0. Activations and the allocator's cache are not included.
        """
        return measure_memory(self.model, self.optimizer, self.device)

    def _require_resident(self, what: str, *, optimizer: bool) -> None:
        if self._offloader.params_offloaded or (optimizer and self._offloader.optimizer_offloaded):
            raise EngineConfigError(
                f"TrainingEngine.{what}: the engine's state is offloaded to host memory; "
                "call engine.reload() first"
            )

    def _trainable_optimizer(self, what: str) -> torch.optim.Optimizer:
        if self.optimizer is None:
            raise EngineConfigError(
                f"TrainingEngine.{what} needs a trainable engine, this one was built with "
                "trainable=False (inference only); build it with trainable=True to train"
            )
        self._require_resident(what, optimizer=True)
        return self.optimizer

    # --------------------------------------------------------- checkpoints, weights

    def save(self, path: str | os.PathLike[str], *, generators: Generators | None = None) -> None:
        """Save model, optimizer, step and RNG states with torch.distributed.checkpoint.

        Collective over ``process_group``; every rank writes its own shards.

        Args:
            path: checkpoint directory, shared by all ranks.
            generators: the caller's own generators, saved with the global RNG states.

        Raises:
            EngineConfigError: if the engine is offloaded (call :meth:`reload`).
        """
        self._require_resident("save", optimizer=True)
        from workers.engines import _dcp  # DCP loads on first use (see its docstring)

        _dcp.save_checkpoint(
            path,
            model=self.model,
            optimizer=self.optimizer,
            step=self._step,
            group=self.process_group,
            generators=generators,
        )

    def load(self, path: str | os.PathLike[str], *, generators: Generators | None = None) -> None:
        """Restore what :meth:`save` wrote, in any layout; the next step continues exactly.

        Collective over ``process_group``.

        Args:
            path: checkpoint directory.
            generators: the caller's generators, restored in place when saved.

        Raises:
            EngineConfigError: if ``path`` holds no checkpoint, or the engine is
                offloaded (call :meth:`reload`).
        """
        self._require_resident("load", optimizer=True)
        from workers.engines import _dcp

        self._step = _dcp.load_checkpoint(
            path,
            model=self.model,
            optimizer=self.optimizer,
            group=self.process_group,
            generators=generators,
        )

    def export_hf(
        self, path: str | os.PathLike[str], *, save: ExportWriter | None = None
    ) -> None:
        """Write a Hugging Face model directory loadable with ``from_pretrained``.

        Collective over ``process_group``: weights are gathered and rank 0 of the group
        writes; every rank returns once the directory is complete.

        Args:
            path: output directory.
            save: writes the gathered state dict into the directory; default the
                model's ``save_pretrained(path, state_dict=...)``.

        Raises:
            EngineConfigError: without ``save``, if the model is not a Hugging Face
                ``PreTrainedModel``; if the parameters are offloaded.
        """
        self._require_resident("export_hf", optimizer=False)
        _checkpoint.export_hf(path, self.model, group=self.process_group, writer=0, save=save,
                              weights=self.named_full_weights())

    def named_full_weights(self) -> Iterator[tuple[str, Tensor]]:
        """Yield ``(hf_name, full tensor)`` for weight sync into rollout engines.

        Collective: every rank must exhaust the iterator (DTensor shards are gathered).

        Yields:
            Full, detached tensors by the model's own (Hugging Face) names.

        Raises:
            EngineConfigError: if the parameters are offloaded (call :meth:`reload`).
        """
        self._require_resident("named_full_weights", optimizer=False)
        return self._layout.full_weights()
