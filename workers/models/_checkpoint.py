"""What the loaders and writers share: is a directory a checkpoint of a supported
architecture, and how to write one from any rank of a process group."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist
from torch import Tensor

from ._architecture import read_architecture

if TYPE_CHECKING:  # transformers' model classes: seconds to import; imported where a model is built
    from transformers import PretrainedConfig, PreTrainedModel

__all__ = ["check_supported_checkpoint", "save_pretrained_here"]


def check_supported_checkpoint(path: Path) -> PretrainedConfig:
    """Read a checkpoint's config and check its architecture is supported
    (:func:`~._architecture.read_architecture`).

    Args:
        path: A local checkpoint directory.

    Returns:
        The checkpoint's transformers config.

    Raises:
        ConfigError: If ``path`` has no readable ``config.json``, or its
            ``model_type`` is not in :data:`~._architecture.SUPPORTED_ARCHITECTURES`.
    """
    read_architecture(path)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path, local_files_only=True)


def _this_process_writes(is_main_process: bool) -> bool:
    return is_main_process


def save_pretrained_here(
    model: PreTrainedModel,
    directory: str | os.PathLike[str],
    *,
    state_dict: Mapping[str, Tensor] | None = None,
) -> Path:
    """``model.save_pretrained(directory)`` (safetensors), written by this process.

    transformers 5 writes a model only on rank 0 of the *default* process group
    (``PreTrainedModel.should_save_on_this_rank``). The writer of a role is rank 0 of
    its pool's own group, which in a session spanning several pools is usually not
    the default group's rank 0, so a plain ``save_pretrained`` there silently wrote
    nothing. For the duration of the call this process is declared the writer; the
    caller decides which single process calls it.

    Args:
        model: A Hugging Face model.
        directory: Target directory (created).
        state_dict: Weights to write instead of the model's own (e.g. full tensors
            gathered from a sharded model).

    Returns:
        The directory.
    """
    path = Path(directory)
    writes_anyway = (
        dist.is_available() and dist.is_initialized() and dist.get_rank() != 0
        and hasattr(model, "should_save_on_this_rank")
    )
    if writes_anyway:
        # An instance attribute shadows the class's method for this call only.
        model.should_save_on_this_rank = _this_process_writes  # type: ignore[method-assign]
    try:
        model.save_pretrained(os.fspath(path), state_dict=None if state_dict is None else dict(state_dict),
                              safe_serialization=True, is_main_process=True)
    finally:
        if writes_anyway:
            del model.should_save_on_this_rank
    return path
