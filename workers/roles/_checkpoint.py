"""Checkpoints and exports of the trainable roles, collective over the role's own pool.

The work is the training engine's (:meth:`TrainingEngine.save`, ``load``,
``export_hf``), which the roles build over their pool's process group: the session's
default group spans every worker of every pool, most of which take no part in the
call. This module adds what a role owns beside the engine: its generators (saved with
the RNG states) and the tokenizer files an exported directory needs to serve as a
model directory.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from channels import OneToAll
from workers.engines import TrainingEngine
from workers.host import Role, register

COPIED_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "chat_template.jinja", "chat_template.json", "generation_config.json",
    "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt", "merges.txt",
)
"""Files copied from the source model directory into an exported one when present
(tokenizers of every kind transformers saves, chat template, generation config);
never the weights or ``config.json``, which the export writes."""

COPIED_DIRS = ("additional_chat_templates",)
"""Directories copied likewise (transformers 5 saves named chat templates there)."""


def copy_tokenizer_files(source_dir: str | Path, out: Path) -> None:
    """Copy the :data:`COPIED_FILES` and :data:`COPIED_DIRS` of ``source_dir``
    that ``out`` lacks into it."""
    source = Path(source_dir)
    for name in COPIED_FILES:
        src = source / name
        if src.is_file() and not (out / name).exists():
            shutil.copyfile(src, out / name)
    for name in COPIED_DIRS:
        src = source / name
        if src.is_dir() and not (out / name).exists():
            shutil.copytree(src, out / name)


class TrainedRole(Role):
    """A role that trains a model with a :class:`TrainingEngine`: checkpoints and
    export, shared by the actor and the critic.

    Subclasses set ``self.engine`` (built with ``process_group=engine_group(ctx)``),
    ``self._shuffle`` (the mini-batch generator) and ``self.config.model_dir``, and
    implement :meth:`_save_export`.
    """

    engine: TrainingEngine
    _shuffle: torch.Generator
    config: Any

    @register(protocol=OneToAll())
    def save_checkpoint(self, path: str) -> None:
        """Save model, optimizer, step and RNG states (DCP; every rank writes its shards).

        Args:
            path: a directory every rank can write.
        """
        self.engine.save(path, generators={"shuffle": self._shuffle})

    @register(protocol=OneToAll())
    def load_checkpoint(self, path: str) -> None:
        """Restore a :meth:`save_checkpoint` directory (into any layout of the model).

        Args:
            path: the checkpoint directory.

        Raises:
            ConfigError: ``path`` holds no checkpoint.
        """
        self.engine.load(path, generators={"shuffle": self._shuffle})
        self._after_load()

    @register(protocol=OneToAll())
    def export_hf(self, path: str) -> None:
        """Write the model as a Hugging Face directory (weights gathered, pool rank 0
        writes); tokenizer and generation files of ``config.model_dir`` are copied
        beside it, so the directory can be any role's ``model_dir`` (or be served by
        vLLM, or loaded with ``from_pretrained``).

        Collective over the pool: every rank returns once the directory is complete.

        Args:
            path: output directory (created), which pool rank 0 can write.
        """
        group = self.ctx.process_group
        if self.engine.process_group is None and group is not None:
            # Every rank holds a full copy (a replicated critic): one writes, the
            # others wait for it rather than write the same files at once.
            if self.ctx.rank == 0:
                self.engine.export_hf(path, save=self._write_export)
            dist.barrier(group=group)
            return
        self.engine.export_hf(path, save=self._write_export)

    def _write_export(self, state: dict[str, Tensor], out: Path) -> None:
        self._save_export(state, out)
        copy_tokenizer_files(self.config.model_dir, out)

    def _after_load(self) -> None:
        """Hook run after a checkpoint is loaded (the actor syncs its rollout engine)."""

    def _save_export(self, state: dict[str, Tensor], out: Path) -> None:
        raise NotImplementedError
