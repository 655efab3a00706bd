"""Megatron-core training engine: :class:`TrainingEngine`'s API on a Megatron ``GPTModel``.

For GPU machines (megatron-core >= 0.16, the ``gpu`` extra; megatron-core is
imported only when an engine is created); roles choose it with ``engine="megatron"``
(:mod:`workers.roles._engine_choice`). The engine takes the model TrainingEngine
takes (a Llama/Qwen2 causal LM or a :class:`~workers.models.ValueModel`), builds a
``GPTModel`` from Megatron's own layers (the "local" spec: no Transformer Engine or
Apex; :mod:`workers.engines._megatron_model`), copies the weights into it sharded
over its mesh's tensor-parallel group, and runs TrainingEngine's heads, objectives,
loss aggregation and micro-batching on it.
Data-parallel groups pass their own rows and average gradients once per step, so a
step equals one full-batch step. Pipeline parallelism is rejected for now (it needs
Megatron's pipeline schedules).

The weight conversion (Hugging Face names and layouts to Megatron's, and
tensor-parallel shards) is :mod:`workers.engines._megatron_weights`, re-exported
here.

Megatron's RoPE counts positions from the first column rather than from each row's
first real token; rotary attention depends only on query-key distances and a row's
real tokens are contiguous, so the shift changes no result.

Process groups: the engine never initialises ``megatron.core.parallel_state``.
Megatron's ``initialize_model_parallel`` is collective over the whole default
process group and keeps its groups in process-global state; in an asyncflow
session the default group spans every worker of every pool, so a role on one pool
calling it would wait for workers of other pools that never call it (a hang), and
two roles of one process with different layouts would fight over the one global
state. Instead the engine hands Megatron the groups of its own ``("pp", "dp",
"tp")`` DeviceMesh (a role's: its pool's reconnectable groups) through a
``ProcessGroupCollection`` (``GPTModel(pg_collection=...)``, megatron-core >= 0.16),
and a group of this rank alone without a mesh; context parallelism is always this
rank alone. Each engine thus holds its own groups, and every collective it runs is
over its own mesh. Two things stay process-global, neither tied to a layout:
Megatron's scratch buffer for attention scores (made here once per process,
because its only public initialiser is ``initialize_model_parallel``) and the CUDA
RNG tracker (seeded per engine with this rank's tensor coordinate; the engine runs
without dropout, so no result depends on it).

Megatron's model needs CUDA (its RoPE and RNG tracker call CUDA), so the engine
refuses a model on the CPU. ``TrainingConfig.precision`` applies as in
TrainingEngine on an unsharded model (bf16: the forwards run under bfloat16
autocast, parameters, gradients and optimizer state stay float32).
``TrainingConfig.data_parallel`` "shard" is refused: data-parallel ranks keep whole
(tensor-parallel) replicas and average gradients in an all-reduce (Megatron's
distributed optimizer is not driven yet); so is ``activation_checkpointing``
(transformers' mechanism does not reach Megatron's layers; Megatron's own recompute
is planned).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from workers.engines import _checkpoint
from workers.engines._checkpoint import Generators
from workers.engines._config import TrainingConfig
from workers.engines._engine import TrainingEngine
from workers.engines._errors import EngineConfigError
from workers.engines._heads import CausalLMHead, ModelHead, ValueHead
from workers.engines._megatron_model import (
    HFStyleGPT,
    build_gpt,
    megatron_groups,
    padding_idx_of,
    prepare_process,
)
from workers.engines._megatron_weights import (
    GPTShape,
    ModelKind,
    hf_to_megatron,
    megatron_shard_to_hf,
    megatron_tensor_to_hf,
    megatron_to_hf,
    merge_from_tp,
    split_for_tp,
    tp_split_kind,
)
from workers.engines._parallel import Parallelism
from workers.objectives import LossFn

__all__ = [
    "MEGATRON_MIN_VERSION",
    "GPTShape",
    "MegatronConfig",
    "MegatronTrainingEngine",
    "hf_to_megatron",
    "megatron_available",
    "megatron_shard_to_hf",
    "megatron_tensor_to_hf",
    "megatron_to_hf",
    "merge_from_tp",
    "split_for_tp",
]

MEGATRON_MIN_VERSION = (0, 16)
"""The oldest megatron-core the engine runs on: it passes its process groups to
``GPTModel(pg_collection=...)`` instead of initialising Megatron's global state."""


@dataclass(frozen=True, kw_only=True)
class MegatronConfig:
    """What a :class:`MegatronTrainingEngine` needs beyond :class:`TrainingConfig`
    (its layout is its mesh's, its precision ``TrainingConfig.precision``)."""

    seed: int = 0
    """Seed of Megatron's model-parallel CUDA RNG tracker (dropout; the engine runs
    without dropout, but Megatron's attention needs the tracker)."""

    def __post_init__(self) -> None:
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise EngineConfigError(f"MegatronConfig.seed must be an int, got {self.seed!r}")


def megatron_available() -> str | None:
    """Why the Megatron engine cannot run in this environment, or None when it can.

    Reads the installed distribution's version only (imports nothing).

    Returns:
        A sentence naming what to install, or None.
    """
    want = ".".join(map(str, MEGATRON_MIN_VERSION))
    try:
        version = metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        return (f"megatron-core is not installed: pip install 'megatron-core>={want}' "
                "(asyncflow's 'gpu' extra)")
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits) if digits else 0)
    if tuple(parts) < MEGATRON_MIN_VERSION:
        return (f"megatron-core {version} is installed, the engine needs >= {want} "
                f"(explicit process groups): pip install -U 'megatron-core>={want}'")
    return None


def _import_megatron() -> None:
    problem = megatron_available()
    if problem is not None:
        raise EngineConfigError(f"MegatronTrainingEngine: {problem}; or use TrainingEngine")


def _model_kind(model: nn.Module) -> ModelKind:
    if hasattr(model, "lm_head"):
        return "causal_lm"
    if hasattr(model, "backbone") and hasattr(model, "head"):
        return "value"
    raise EngineConfigError(
        f"MegatronTrainingEngine takes a Llama/Qwen2 causal LM or a ValueModel, got "
        f"{type(model).__name__}"
    )


def _device_of(model: nn.Module, mesh: DeviceMesh | None) -> torch.device:
    if mesh is not None and mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    first = next(model.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")
    if device.type != "cuda":
        raise EngineConfigError(
            f"MegatronTrainingEngine needs the model on a CUDA device, got {device} (Megatron's "
            "RoPE and RNG tracker are CUDA-only); use TrainingEngine on the CPU"
        )
    return device


# ------------------------------------------------------------------- the engine


class MegatronTrainingEngine(TrainingEngine):
    """Trains one Llama/Qwen2 model (causal LM or value model) as a Megatron ``GPTModel``.

    :meth:`log_probs`, :meth:`values` and :meth:`train_step` are TrainingEngine's, run
    on the Megatron model behind a transformers-style call; what differs is the
    layout (Megatron's TP layers over the mesh's ``"tp"`` group), gradient
    synchronisation, the gradient norm, checkpoints and weight export. Every rank of
    the mesh calls each method together; no other rank takes part.

    Args:
        model: a Llama/Qwen2 causal LM or a ``ValueModel`` on a CUDA device, identical
            on every rank; its weights are copied (sharded) into the Megatron model,
            it is not kept.
        config: optimizer, schedule, micro-batching and precision (as TrainingEngine:
            bf16 is bfloat16 autocast over float32 master weights and optimizer
            state); ``data_parallel`` must not be "shard", nor
            ``activation_checkpointing`` on.
        megatron: the RNG seed.
        mesh: a ``("pp", "dp", "tp")`` DeviceMesh whose groups Megatron uses (a role
            passes its pool's), ``pp`` = 1; None: this rank alone.
        head: :class:`CausalLMHead` or :class:`ValueHead`; default by the model's kind.
        loss: the default objective of :meth:`train_step`.
        process_group: the group spanning the mesh's ranks, over which :meth:`save`,
            :meth:`load` and :meth:`export_hf` are collective (a role passes its
            pool's group). Default: the default process group with a mesh, none
            without one.

    Raises:
        EngineConfigError: without megatron-core >= 0.16 or torch.distributed, for a
            model off CUDA, a mesh that does not fit the model (``tp`` must divide
            the head counts) or has ``pp > 1``, ``data_parallel="shard"``,
            activation checkpointing, or an unsupported model.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        config: TrainingConfig,
        megatron: MegatronConfig | None = None,
        mesh: DeviceMesh | None = None,
        head: ModelHead | None = None,
        loss: LossFn | None = None,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.megatron = megatron if megatron is not None else MegatronConfig()
        _import_megatron()
        if config.data_parallel == "shard":
            raise EngineConfigError(
                "MegatronTrainingEngine keeps a whole replica on every data-parallel rank "
                "(Megatron's distributed optimizer is not driven yet): set "
                "TrainingConfig.data_parallel to 'auto' or 'replicate', or use TrainingEngine"
            )
        if config.activation_checkpointing:
            raise EngineConfigError(
                "MegatronTrainingEngine does not recompute activations yet (Megatron's own "
                "recompute is planned): set TrainingConfig.activation_checkpointing=False, "
                "or use TrainingEngine"
            )
        self.kind = _model_kind(model)
        self.hf_config = model.config
        self.shape = GPTShape.from_hf_config(model.config)
        device = _device_of(model, mesh)
        self._groups = megatron_groups(mesh)
        self._check_divisible()
        prepare_process(self.megatron.seed, self.tp_rank)
        gpt = build_gpt(
            self.shape, self.kind, device, self._groups, padding_idx=padding_idx_of(model)
        )
        self._load_full(gpt, hf_to_megatron(model.state_dict(), self.shape, kind=self.kind))
        # Megatron marks sharded parameters only when it initialises them itself
        # (perform_initialization), so the engine tells them apart by name.
        self._sharded = {
            id(param)
            for name, param in gpt.named_parameters()
            if tp_split_kind(name, self.kind) != "replicated"
        }
        wrapped = HFStyleGPT(
            gpt,
            kind=self.kind,
            hf_config=model.config,
            hf_names=[name for name, _ in model.named_parameters()],
            shape=self.shape,
            tp_group=self._groups.tp,
        )
        default_head: ModelHead = CausalLMHead() if self.kind == "causal_lm" else ValueHead()
        if process_group is None and mesh is not None:
            process_group = dist.group.WORLD
        # Without a mesh TrainingEngine keeps the model as it is (already laid out by
        # Megatron) and builds the optimizer; its DP reductions then go to the mesh's
        # "dp" group, through a Parallelism that lays nothing out.
        super().__init__(
            wrapped, config=config, head=head or default_head, loss=loss, process_group=process_group
        )
        self.parallel = Parallelism(mesh, device=device)

    # ---------------------------------------------------------------- layout

    @property
    def tensor_parallel(self) -> int:
        """Tensor-parallel size (the mesh's ``"tp"``)."""
        return int(self._groups.tp.size())

    @property
    def tp_rank(self) -> int:
        """This rank's position in its tensor-parallel group."""
        return int(self._groups.tp.rank())

    def _check_divisible(self) -> None:
        tp = self.tensor_parallel
        for name in ("num_heads", "num_kv_heads"):
            if getattr(self.shape, name) % tp:
                raise EngineConfigError(
                    f"the mesh's tp={tp} must divide the model's {name}="
                    f"{getattr(self.shape, name)}"
                )

    def _load_full(self, gpt: nn.Module, full: Mapping[str, Tensor]) -> None:
        """Copy this rank's TP shard of every full Megatron tensor into ``gpt``."""
        tp, rank = self.tensor_parallel, self.tp_rank
        targets = {n: t for n, t in gpt.state_dict().items() if not n.endswith("_extra_state")}
        if missing := sorted(set(targets) - set(full)):
            raise EngineConfigError(f"no weights for Megatron tensors {missing}")
        with torch.no_grad():
            for name, target in targets.items():
                shard = split_for_tp(
                    name, full[name], tp_size=tp, vocab_size=self.shape.vocab_size, kind=self.kind
                )[rank]
                if tuple(shard.shape) != tuple(target.shape):
                    raise EngineConfigError(
                        f"Megatron tensor {name!r}: shard shape {tuple(shard.shape)} does not "
                        f"match the model's {tuple(target.shape)}"
                    )
                target.copy_(shard)

    # ------------------------------------------------------------------ step

    def _clip_gradients(self) -> float:
        # TrainingEngine scales each DP rank's loss by dp_size / (global normaliser),
        # expecting FSDP's gradient average over DP: average, then the TP-aware norm.
        dp = self.parallel.dp_size
        if dp > 1:
            for param in self.model.parameters():
                if param.grad is not None:
                    self.parallel.all_reduce_dp(param.grad).div_(dp)
        grad_norm = float(self._grad_norm())
        clip = self.config.grad_clip
        if clip and math.isfinite(grad_norm) and grad_norm > clip:
            for param in self.model.parameters():
                if param.grad is not None:
                    param.grad.mul_(clip / (grad_norm + 1e-6))
        return grad_norm

    def _position_limit(self) -> int | None:
        return self.shape.max_position_embeddings

    def _grad_norm(self) -> Tensor:
        """Total gradient norm: each TP shard counted once, replicated tensors once."""
        squares = torch.zeros((), dtype=torch.float64, device=self.device)
        for param in self.model.parameters():
            if param.grad is not None and (id(param) in self._sharded or self.tp_rank == 0):
                squares = squares + param.grad.detach().double().pow(2).sum()
        if self.tensor_parallel > 1:
            dist.all_reduce(squares, group=self._groups.tp)
        return squares.sqrt()

    # ---------------------------------------------------- checkpoints, weights

    def _checkpoint_file(self, path: str | os.PathLike[str]) -> Path:
        return Path(path) / f"tp{self.tp_rank:03d}_of_{self.tensor_parallel:03d}.pt"

    def _barrier(self) -> None:
        if self.process_group is not None:
            dist.barrier(group=self.process_group)

    def save(self, path: str | os.PathLike[str], *, generators: Generators | None = None) -> None:
        """Save model shards, optimizer, step and RNG states (collective over
        ``process_group``).

        Data-parallel rank 0 of each TP rank writes its shard; every rank writes its
        RNG states. Loading needs the same tensor-parallel size (:meth:`export_hf`
        writes a layout-free copy).

        Args:
            path: checkpoint directory, shared by all ranks.
            generators: the caller's own generators, saved with the RNG states.
        """
        directory = Path(path)
        directory.mkdir(parents=True, exist_ok=True)
        if self.parallel.dp_rank == 0:  # DP ranks hold equal copies
            optimizer = self.optimizer
            optim = None if optimizer is None else optimizer.state_dict()
            state = {"model": self.model.state_dict(), "optim": optim, "step": self._step}
            torch.save(state, self._checkpoint_file(directory))
        _checkpoint.save_rng(directory, group=self.process_group, generators=generators)
        self._barrier()

    def load(self, path: str | os.PathLike[str], *, generators: Generators | None = None) -> None:
        """Restore what :meth:`save` wrote (same tensor-parallel size; collective over
        ``process_group``).

        Args:
            path: checkpoint directory.
            generators: the caller's generators, restored in place when saved.

        Raises:
            EngineConfigError: if ``path`` holds no checkpoint for this layout.
        """
        file = self._checkpoint_file(path)
        if not file.is_file():
            raise EngineConfigError(
                f"no checkpoint {file.name} in {os.fspath(path)!r}; pass a directory written "
                f"by MegatronTrainingEngine.save with tensor-parallel size {self.tensor_parallel}"
            )
        state = torch.load(file, map_location=self.device, weights_only=False)
        self.model.load_state_dict(state["model"])
        optimizer = self.optimizer
        if optimizer is not None and state["optim"] is not None:
            optimizer.load_state_dict(state["optim"])
        self._step = int(state["step"])
        _checkpoint.load_rng(path, group=self.process_group, generators=generators)
        self._barrier()

    def named_full_weights(self) -> Iterator[tuple[str, Tensor]]:
        """Yield ``(hf_name, full tensor)`` for weight sync into rollout engines.

        Collective over the mesh's tensor-parallel group: every rank must exhaust the
        iterator (TP shards are all-gathered).

        Yields:
            Full, detached tensors by Hugging Face names, on the engine's device; a
            tied LM head also as ``lm_head.weight`` (as a transformers state dict).
        """
        assert isinstance(self.model, HFStyleGPT)
        return self.model.named_full_weights()

    def export_hf(
        self, path: str | os.PathLike[str], *, save: _checkpoint.ExportWriter | None = None
    ) -> None:
        """Write a Hugging Face directory (rank 0 of ``process_group`` writes;
        collective over it).

        Args:
            path: output directory.
            save: writes the gathered state dict (default: a model of the source config).
        """
        writer = _checkpoint.group_rank(self.process_group) == 0
        state = {}
        for name, tensor in self.named_full_weights():
            if writer:
                state[name] = tensor.cpu()
        if writer:
            out = Path(path)
            out.mkdir(parents=True, exist_ok=True)
            if save is not None:
                save(state, out)
            else:
                assert isinstance(self.model, HFStyleGPT)
                from workers.models import save_pretrained_here

                save_pretrained_here(self.model, out, state_dict=state)  # type: ignore[arg-type]
        self._barrier()
