"""Will the placement fit? A per-device memory estimate of a run's roles, checked
against the devices' memory before the workers start.

Per rank of each pool, summed over the roles placed there: the training state of
the actor and critics (``workers.engines.estimate_memory``: float32 master weights,
gradients and AdamW moments, sharded over the data-parallel ranks when FSDP shards
them) with the activations of one micro-batch (with activation checkpointing, one
block's and the blocks' inputs) plus its logits; the reference's and a reward
model's inference weights; the actor's rollout copy, and its peak: training, or
generating one step's samples (their KV cache) beside the training state that
offloading leaves on the device. It is an estimate: allocator caches, FSDP2's gather buffers,
CUDA's context and fragmentation come on top, so a placement within 90 % of the
memory is reported too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from asyncflow.train._config import (
    RunConfig,
    hybrid_actor,
    needed_roles,
    pools_on_cuda,
    sampling_of,
)
from workers.engines import REPLICATE_MAX_PARAMS, PrecisionName, estimate_memory
from workers.models import Architecture, read_architecture

GIB = 2**30
HEADROOM = 0.9
"""Report a placement whose estimate passes this share of the device's memory."""
TRAINED = ("actor", "critic", "cost_critic")


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """What the estimate needs of a model."""

    parameters: int
    layers: int
    hidden: int
    intermediate: int
    kv_width: int
    """Key/value heads times head size."""
    vocab: int

    @classmethod
    def of(cls, architecture: Architecture) -> ModelShape:
        """The shape of a checkpoint's causal LM."""
        a = architecture
        return cls(parameters=a.parameters, layers=a.num_hidden_layers, hidden=a.hidden_size,
                   intermediate=a.intermediate_size, kv_width=a.num_key_value_heads * a.head_dim,
                   vocab=a.vocab_size)


@dataclass(kw_only=True)
class PoolEstimate:
    """Bytes one rank of a pool needs, by role and part."""

    pool: str
    device: str
    ranks: int
    """The pool's ranks (each holds what :attr:`parts` lists)."""
    parts: dict[str, int] = field(default_factory=dict)
    """``"<role> <part>"`` -> bytes."""

    @property
    def total(self) -> int:
        """The rank's estimated bytes."""
        return sum(self.parts.values())

    def describe(self) -> str:
        """``"12.3 GiB (actor training state 8.0, ...)"``."""
        parts = ", ".join(f"{name} {size / GIB:.1f}" for name, size in self.parts.items() if size >= GIB // 20)
        return f"{self.total / GIB:.1f} GiB per device ({parts})"


def estimate_pools(config: RunConfig, shape: ModelShape, *, context: int, cuda: bool,
                   reward_shape: ModelShape | None = None) -> list[PoolEstimate]:
    """Each pool's per-rank estimate for ``config``'s roles.

    Args:
        config: the run.
        shape: the policy's model (the critics and the reference share it).
        context: the longest prompt plus response, in tokens.
        cuda: whether the pools' devices are GPUs (what ``"auto"`` precision means).
        reward_shape: a reward or cost model's shape, when one scores.

    Returns:
        One estimate per pool that holds a role.
    """
    device = torch.device("cuda" if cuda else "cpu")
    first = next(iter(config.pools))
    out: dict[str, PoolEstimate] = {}
    for role in needed_roles(config):
        place = config.placement.get(role)
        name = place.pool if place is not None else first
        devices = config.pools[name].devices
        t, p = (place.t, place.p) if place is not None else (1, 1)
        estimate = out.setdefault(name, PoolEstimate(pool=name, device=device.type, ranks=devices))
        for part, size in _role_parts(config, role, shape, reward_shape, device=device, devices=devices,
                                      t=t, p=p, context=context).items():
            estimate.parts[f"{role} {part}"] = size
    return list(out.values())


def _role_parts(config: RunConfig, role: str, shape: ModelShape, reward_shape: ModelShape | None, *,
                device: torch.device, devices: int, t: int, p: int, context: int) -> dict[str, int]:
    actor = config.actor
    dp = max(devices // t, 1)  # the generation's data-parallel replicas
    # With pipeline stages a rank holds one stage: about 1/p of the parameters, over
    # devices / (t * p) data-parallel ranks. Its activations stay about one
    # micro-batch's through the whole model (1F1B: the first stage holds p of its
    # 1/p of the layers).
    stage_parameters = -(-shape.parameters // p)
    stage_dp = max(devices // (t * p), 1)
    if role in TRAINED:
        section = actor if role == "actor" else config.critic
        precision = _precision(section.precision, device)
        hybrid = role == "actor" and hybrid_actor(config)  # the hybrid engine keeps whole replicas
        shards = 1 if hybrid or shape.parameters <= REPLICATE_MAX_PARAMS else stage_dp  # data_parallel="auto"
        state = estimate_memory(stage_parameters, precision=precision, shards=shards, tp=t)
        training = {"training state": state.total,
                    "activations": _activations(shape, section.micro_batch_size, context, precision=precision,
                                                checkpointed=section.activation_checkpointing, t=t)}
        if role != "actor" or "rollout" in config.placement:
            return training
        # The actor's peak: training, or generation with what offloading leaves on the device.
        rollout = _generation(config, shape, precision=precision, dp=dp, context=context)
        kept = state.total - (state.optimizer_state if actor.offload_optimizer else 0) \
            - (state.params + state.grads if actor.offload_params else 0)
        generating = {"training state kept": kept, "KV cache": rollout.pop("KV cache")}
        return rollout | (training if sum(training.values()) >= sum(generating.values()) else generating)
    if role == "ref":
        precision = _precision(actor.precision, device)
        return {"weights": estimate_memory(stage_parameters, precision=precision, trainable=False, tp=t).total}
    if role == "rollout":
        precision = _precision(actor.precision, device)
        return _generation(config, shape, precision=precision, dp=dp, context=context)
    if role in ("reward", "cost") and reward_shape is not None:
        if (config.reward if role == "reward" else config.cost).model_dir:
            precision = _precision(actor.precision, device)
            return {"weights": estimate_memory(reward_shape.parameters, precision=precision, trainable=False).total}
    return {}


def _precision(setting: str, device: torch.device) -> PrecisionName:
    """A precision setting on ``device`` (``"auto"``: bf16 on a GPU), without asking
    the driver's own GPU (it may have none)."""
    if setting == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return "bf16" if setting == "bf16" else "fp32"


def _generation(config: RunConfig, shape: ModelShape, *, precision: PrecisionName, dp: int, context: int) -> dict[str, int]:
    """The rollout engine's weights and one step's KV cache on a rank."""
    width = 2 if precision == "bf16" else 4
    samples = math.ceil(config.train.prompts_per_step * sampling_of(config).n / dp)
    cache = 2 * shape.layers * shape.kv_width * context * samples * width
    return {"rollout weights": shape.parameters * width, "KV cache": cache}


def _activations(shape: ModelShape, rows: int, context: int, *, precision: PrecisionName, checkpointed: bool,
                 t: int) -> int:
    """One micro-batch's stored activations and its logits (float32 log-softmax)."""
    width = 2 if precision == "bf16" else 4
    tokens = rows * context
    # Per block and token: norms' and attention's inputs, q/k/v, attention output and
    # the MLP's gate, up, product and down input (flash/SDPA attention: no L x L).
    block = (6 * shape.hidden + 2 * shape.kv_width + 4 * shape.intermediate // t) * width
    stored = tokens * (shape.hidden * width * shape.layers + block if checkpointed else block * shape.layers)
    logits = rows * context * shape.vocab * (width + 4)
    return stored + logits


def check_memory(config: RunConfig, model_dir: str, *, context: int) -> list[str]:
    """:func:`memory_warnings` for ``config`` with the policy in ``model_dir`` and
    samples of at most ``context`` tokens, on the devices its pools will get (the
    driver's view: a GPU pool is checked when the driver sees a GPU)."""
    cuda = pools_on_cuda(config)
    shape = ModelShape.of(read_architecture(model_dir))
    scorer = config.reward.model_dir or config.cost.model_dir
    reward = ModelShape.of(read_architecture(scorer)) if scorer else None
    estimates = estimate_pools(config, shape, context=context, cuda=cuda, reward_shape=reward)
    return memory_warnings(estimates, memory=device_memory("cuda" if cuda else "cpu"))


def device_memory(kind: str) -> int | None:
    """Bytes of one device of this kind as the driver sees it: its first GPU's
    memory, or the host's memory for CPU pools; None when it cannot tell."""
    if kind == "cuda":
        return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
    import psutil

    return int(psutil.virtual_memory().total)


def memory_warnings(estimates: list[PoolEstimate], *, memory: int | None) -> list[str]:
    """A line for each pool whose estimate passes :data:`HEADROOM` of ``memory``
    (CPU pools share the host: their ranks are summed), with what to change."""
    if memory is None or not estimates:
        return []
    fix = ("lower micro_batch_size, set activation_checkpointing = true or actor.offload_optimizer = true, "
           "or spread the roles over more devices")
    if estimates[0].device == "cpu":
        total = sum(e.total * e.ranks for e in estimates)
        if total <= HEADROOM * memory:
            return []
        pools = "; ".join(f"pool {e.pool!r}: {e.describe()}" for e in estimates)
        return [f"the roles' estimated memory, {total / GIB:.1f} GiB, passes {HEADROOM:.0%} of this machine's "
                f"{memory / GIB:.1f} GiB ({pools}); {fix}"]
    return [f"pool {e.pool!r} may not fit its GPUs: estimated {e.describe()} against {memory / GIB:.1f} GiB "
            f"per GPU; {fix}" for e in estimates if e.total > HEADROOM * memory]
