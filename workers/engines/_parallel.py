"""Parallel layout of a training model over a DeviceMesh, kept apart from the model math.

The mesh has dimensions ``("pp", "dp", "tp")``. Tensor parallelism (DTensor,
``parallelize_module``) shards the attention and MLP projections over ``"tp"``; FSDP2
(``fully_shard``) then shards every parameter over ``"dp"``, or every ``"dp"`` rank
keeps a whole replica whose gradients are reduced in one all-reduce (with the step's
loss normaliser and metrics riding in it). Pipeline stages over ``"pp"`` are
:mod:`workers.engines._pipelined`'s, gradient norms over any layout
:mod:`workers.engines._grad_norm`'s. The engine asks a :class:`Parallelism` which
device it computes on, how big its data-parallel group is, and how to reduce over it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from workers._dtensor import is_dtensor
from workers.engines._errors import EngineConfigError

if TYPE_CHECKING:  # FSDP2 and tensor parallelism import DTensor (0.8 s): on first use
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor.parallel import ParallelStyle

MESH_DIM_NAMES = ("pp", "dp", "tp")
"""The names (in this order) a training DeviceMesh must have."""


@dataclass(frozen=True, kw_only=True)
class TensorParallelPlan:
    """Which linear layers tensor parallelism shards, by the last part of their name.

    The defaults fit Llama/Qwen/Mistral-style decoders. A column-wise layer keeps its
    output sharded as a plain local tensor (``use_local_output``), so attention sees
    ``heads / tp`` local heads; Hugging Face attention reshapes with ``-1`` heads and
    works unchanged, and integer head counts stored on the attention module (older
    implementations) are divided by ``tp``.
    """

    colwise: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    """Linear layers split along their output features."""
    rowwise: tuple[str, ...] = ("o_proj", "down_proj")
    """Linear layers split along their input features (their output is all-reduced)."""
    head_count_attrs: tuple[str, ...] = ("num_heads", "num_key_value_heads")
    """Integer attributes of a column-wise layer's parent that count heads."""
    config_head_fields: tuple[str, ...] = ("num_attention_heads", "num_key_value_heads")
    """Fields of ``model.config`` that ``tp`` must divide."""


def check_mesh(mesh: DeviceMesh, *, engine: str = "the PyTorch-native engine", stages: bool = False) -> None:
    """Raise :class:`EngineConfigError` unless ``mesh`` is a training mesh the engine
    can use: dimensions :data:`MESH_DIM_NAMES`, and ``pp`` of 1 unless it runs
    pipeline stages.

    Args:
        mesh: the mesh.
        engine: the engine, as the message names it.
        stages: whether the engine runs pipeline stages (``pp`` above 1).
    """
    if mesh.mesh_dim_names != MESH_DIM_NAMES:
        raise EngineConfigError(
            f"mesh dimensions must be named {MESH_DIM_NAMES}, got {mesh.mesh_dim_names}; build it "
            f'with init_device_mesh(device, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))'
        )
    if mesh["pp"].size() != 1 and not stages:
        raise EngineConfigError(
            f"mesh 'pp' size is {mesh['pp'].size()}, but pipeline parallelism is not implemented "
            f"in {engine}; use pp=1 and put those ranks into 'dp' or 'tp'"
        )


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, plan: TensorParallelPlan | None = None) -> None:
    """Shard ``model``'s projections over the 1-D ``tp_mesh`` in place (DTensor), as
    the training engine does; the rollout engine generates this way in a generation
    layout with ``tg > 1``.

    Raises:
        EngineConfigError: ``tp`` does not divide a head count, or the plan names no
            linear layer of the model.
    """
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = plan or TensorParallelPlan()
    tp = tp_mesh.size()
    config = getattr(model, "config", None)
    for name in plan.config_head_fields:
        count = getattr(config, name, None)
        if isinstance(count, int) and count % tp:
            raise EngineConfigError(
                f"model config {name}={count} is not divisible by the mesh's tp={tp}; "
                "choose a tp size that divides it"
            )
    styles: dict[str, ParallelStyle] = {}
    parents: dict[int, nn.Module] = {}
    modules = dict(model.named_modules())
    for name, module in modules.items():
        leaf = name.rsplit(".", 1)[-1]
        if not isinstance(module, nn.Linear):
            continue
        if leaf in plan.colwise:
            styles[name] = ColwiseParallel()
            parent = modules[name.rsplit(".", 1)[0]] if "." in name else model
            parents[id(parent)] = parent
        elif leaf in plan.rowwise:
            styles[name] = RowwiseParallel()
    if not styles:
        raise EngineConfigError(
            f"tensor parallelism found no linear layer named {plan.colwise + plan.rowwise}; "
            "pass a TensorParallelPlan naming this model's projections"
        )
    parallelize_module(model, tp_mesh, styles)
    for parent in parents.values():
        for attr in plan.head_count_attrs:
            count = getattr(parent, attr, None)
            if isinstance(count, int) and not isinstance(count, bool):
                setattr(parent, attr, count // tp)


def _apply_fully_shard(model: nn.Module, dp_mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy | None,
                       units: Sequence[nn.Module] = ()) -> None:
    # Each block of every ModuleList (the transformer layers) is its own FSDP unit so
    # that only one block's full parameters exist at a time; ``units`` (called on
    # their own, not through the model's forward) come next; the root unit holds the
    # rest (embeddings, final norm, heads). Every unit gets the same precision policy.
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp_policy = mp_policy or MixedPrecisionPolicy()
    for module in list(model.modules()):
        if isinstance(module, nn.ModuleList):
            for block in module:
                if next(block.parameters(), None) is not None:  # not a pipeline stage's stand-in
                    fully_shard(block, mesh=dp_mesh, mp_policy=mp_policy)
    for unit in units:
        fully_shard(unit, mesh=dp_mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp_policy)


class Parallelism:
    """A model's layout over a mesh: TP over ``"tp"``, then FSDP2 over ``"dp"``.

    Without a mesh everything is local to one device. Order matters: TP must see the
    plain ``nn.Linear`` layers, and FSDP2 then shards the resulting DTensors over
    ``"dp"`` (the 2-D layout), whereas the reverse order is not supported by FSDP2.
    """

    def __init__(
        self,
        mesh: DeviceMesh | None,
        *,
        tp_plan: TensorParallelPlan | None = None,
        device: torch.device | None = None,
    ) -> None:
        """Validate the mesh.

        Args:
            mesh: a ``("pp", "dp", "tp")`` DeviceMesh, or None for a single process.
            tp_plan: which layers TP shards (defaults to the Llama-style plan).
            device: the device without a mesh (default: the model's).

        Raises:
            EngineConfigError: for a mesh with other dimension names.
        """
        if mesh is not None:
            check_mesh(mesh, stages=True)
        self.mesh = mesh
        self.tp_plan = tp_plan or TensorParallelPlan()
        self._device = device
        self.replicated = False
        """Whether :meth:`parallelize` kept a whole copy on every data-parallel rank."""
        # Read once: slicing a DeviceMesh recomputes its layout (a few hundred
        # microseconds), and the update reduces over "dp" several times a step.
        self._dp_size = 1 if mesh is None else mesh["dp"].size()
        self._dp_rank = 0 if mesh is None else mesh["dp"].get_local_rank()
        self._tp_size = 1 if mesh is None else mesh["tp"].size()
        self._dp_group = None if mesh is None or self._dp_size == 1 else mesh.get_group("dp")
        self.pp_size = 1 if mesh is None else mesh["pp"].size()
        """Pipeline stages (1 without a mesh)."""

    @property
    def dp_size(self) -> int:
        """Number of data-parallel ranks (1 without a mesh)."""
        return self._dp_size

    @property
    def dp_rank(self) -> int:
        """This rank's position in its data-parallel group (0 without a mesh)."""
        return self._dp_rank

    @property
    def tp_size(self) -> int:
        """Number of tensor-parallel ranks (1 without a mesh)."""
        return self._tp_size

    def device_for(self, model: nn.Module) -> torch.device:
        """The device the model trains on.

        Args:
            model: the model (its first parameter's device is used without a mesh).

        Returns:
            The mesh's device for this rank (``cuda:<current>`` for a CUDA mesh).
        """
        if self.mesh is None:
            if self._device is not None:
                return self._device
            first = next(model.parameters(), None)
            return first.device if first is not None else torch.device("cpu")
        if self.mesh.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(self.mesh.device_type)

    def shards(self, *, replicate: bool) -> bool:
        """Whether :meth:`parallelize` with this ``replicate`` shards with FSDP2.

        Args:
            replicate: the value to be passed to :meth:`parallelize`.

        Returns:
            True when there is more than one data-parallel rank and no replication.
        """
        return self.mesh is not None and self.dp_size > 1 and not replicate

    def parallelize(
        self,
        model: nn.Module,
        *,
        replicate: bool = False,
        mp_policy: MixedPrecisionPolicy | None = None,
        units: Sequence[nn.Module] = (),
    ) -> nn.Module:
        """Move the model to its device and apply TP then, over ``"dp"``, FSDP2 or
        (``replicate``) nothing: every data-parallel rank keeps a whole copy and
        :meth:`normalise_gradients` reduces the gradients. Each applies only if its
        size is > 1.

        Args:
            model: an unsharded model, identical on every rank.
            replicate: keep whole copies over ``"dp"`` instead of sharding.
            mp_policy: FSDP2's mixed-precision policy for every ``fully_shard`` call
                (default: compute and reduce in the parameters' dtype).
            units: submodules of ``model`` called on their own, not through its
                forward (a pipeline stage's body): each is an FSDP unit of its own,
                so that its parameters are gathered when it runs.

        Returns:
            The same module object, now laid out in place.
        """
        model.to(self.device_for(model))
        if self.mesh is not None and self.tp_size > 1:
            apply_tensor_parallel(model, self.mesh["tp"], self.tp_plan)
        self.replicated = replicate and self.dp_size > 1
        if self.mesh is not None and self.shards(replicate=replicate):
            _apply_fully_shard(model, self.mesh["dp"], mp_policy, units)
        return model

    def normalise_gradients(self, model: nn.Module, sums: Tensor, maxes: Tensor) -> tuple[Tensor, Tensor]:
        """Sum the gradients of a replicated model's unnormalised losses over the
        data-parallel ranks and divide them by the summed loss normaliser
        (``sums[0]``, at least 1), with the rest of ``sums`` and ``maxes`` riding in
        the same all-reduce: a step of a replicated model then needs no collective of
        its own for its normaliser and metrics. Each rank writes its values into its
        own row of a table at the flat buffer's end (as float32 pairs that add up to
        the float64 value to about 48 bits), and the rows are summed and maximised
        locally, so that every rank gets the same bits.

        Args:
            model: the model whose ``.grad`` are reduced in place.
            sums: float64, 1-D: this rank's loss normaliser, then any other addends.
            maxes: float64, 1-D: this rank's candidates for maxima (``-inf`` for none).

        Returns:
            ``(sums, maxes)`` over the ranks (float64, on the gradients' device).

        Raises:
            EngineConfigError: the model is not replicated.
        """
        if not self.replicated:
            raise EngineConfigError("normalise_gradients sums over replicas; this model is not replicated")
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:  # the same on every rank: each ran the same forwards
                p.grad = torch.zeros_like(p)
        local = [g.to_local() if is_dtensor(g) else g for g in (p.grad for p in params)]
        device = local[0].device  # type: ignore[union-attr]
        values = torch.cat([sums.to(device), maxes.to(device)])
        pairs = torch.zeros(self.dp_size, 2 * values.numel(), dtype=torch.float32, device=device)
        pairs[self.dp_rank] = _float32_pairs(values)
        flat = torch.cat([*(g.reshape(-1) for g in local), pairs.view(-1)])  # type: ignore[union-attr]
        dist.all_reduce(flat, group=self._dp_group)
        grads = flat[:flat.numel() - pairs.numel()]
        rows = _from_float32_pairs(flat[grads.numel():].view_as(pairs))
        summed, maxed = rows[:, :sums.numel()].sum(0), rows[:, sums.numel():].amax(0)
        grads /= max(float(summed[0]), 1.0)
        offset = 0
        for g in local:
            assert g is not None
            g.copy_(grads[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        return summed, maxed

    def all_reduce_dp(
        self, tensor: Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
    ) -> Tensor:
        """Reduce ``tensor`` in place over the data-parallel group (no-op without DP).

        Args:
            tensor: a tensor on this rank's device.
            op: the reduction.

        Returns:
            ``tensor``.
        """
        if self._dp_group is not None:
            dist.all_reduce(tensor, op=op, group=self._dp_group)
        return tensor

    def sums_and_maxes_over_dp(self, sums: Tensor, maxes: Tensor) -> tuple[Tensor, Tensor]:
        """``sums`` summed and ``maxes`` maximised over the data-parallel ranks, in one
        collective: each rank writes its values into its own row of a zeroed
        ``[dp_size, n]`` float64 table, one all-reduce (sum) gives every rank the whole
        table, and the rows are then summed and maximised locally, in rank order, so
        every rank gets the same bits.

        Args:
            sums: 1-D, this rank's addends (on this rank's device).
            maxes: 1-D, this rank's candidates for the maxima (``-inf`` for none).

        Returns:
            ``(sums, maxes)`` over the group, float64; the inputs as float64 without DP.
        """
        sums, maxes = sums.to(torch.float64), maxes.to(torch.float64)
        if self._dp_group is None:
            return sums, maxes
        width = sums.numel()
        table = torch.zeros(self.dp_size, width + maxes.numel(), dtype=torch.float64, device=sums.device)
        table[self.dp_rank, :width] = sums
        table[self.dp_rank, width:] = maxes
        dist.all_reduce(table, group=self._dp_group)
        return table[:, :width].sum(0), table[:, width:].amax(0)

    def counts_over_dp(self, value: int, device: torch.device) -> list[int]:
        """Every data-parallel rank's ``value``, in data-parallel rank order.

        Args:
            value: this rank's value (e.g. its row count).
            device: where the communication tensor lives.

        Returns:
            ``dp_size`` values; entry ``dp_rank`` is this rank's.
        """
        holder = torch.zeros(self.dp_size, dtype=torch.int64, device=device)
        holder[self.dp_rank] = value
        return [int(v) for v in self.all_reduce_dp(holder).tolist()]


def _float32_pairs(values: Tensor) -> Tensor:
    """float64 ``values`` as float32 ``[high..., low...]``, ``high + low`` equal to
    them to about 48 bits (a non-finite value stays in ``high``, its ``low`` is 0)."""
    high = values.to(torch.float32)
    low = torch.where(torch.isfinite(high), values - high.to(torch.float64), 0.0).to(torch.float32)
    return torch.cat([high, low])


def _from_float32_pairs(table: Tensor) -> Tensor:
    """Each row of :func:`_float32_pairs` back to float64."""
    width = table.shape[1] // 2
    return table[:, :width].to(torch.float64) + table[:, width:].to(torch.float64)
