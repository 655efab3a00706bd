"""The actor's generation side: which rollout engine, and rows in and out of it.

The engine is picked by the type of its config (``NativeRolloutConfig`` or
``VLLMRolloutConfig``); it holds a full copy of the actor's weights, which the
actor refreshes after every update, unless the native engine samples from the
training parameters themselves (:func:`bind_training_weights`).

vLLM runs in the worker's own process (``VLLMRolloutEngine`` keeps its
``torch.distributed`` set-up apart from the session's groups); weights reach it by
Hugging Face name through ``update_weights``.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Literal, Protocol

import msgspec
import torch
from torch import Tensor

from channels import ConfigError
from workers._dtensor import is_dtensor
from workers.engines import PrecisionName
from workers.roles import _fields as F
from workers.rollout import (
    GenerationRun,
    NativeRolloutConfig,
    NativeRolloutEngine,
    RolloutOutput,
    SamplingParams,
    VLLMRolloutConfig,
    VLLMRolloutEngine,
    load_tokenizer,
)

if TYPE_CHECKING:  # transformers' model classes: seconds to import; a generating worker has them
    from transformers import PreTrainedModel

RolloutConfig = NativeRolloutConfig | VLLMRolloutConfig
"""A rollout engine's settings; the type selects the engine."""

SEED_STRIDE = 1 << 20
"""Per-rank offset of sampling seeds, so ranks do not draw the same random streams."""


MAX_NEW_TOKENS = "max_new_tokens"
"""Optional prompt column, int64 ``[]``: the prompt's own token budget, for every one of
its samples, in ``1..params.max_new_tokens`` (responses keep that width)."""


class RolloutEngine(Protocol):
    """What the actor needs of a rollout engine (native and vLLM both fit)."""

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                 max_new_tokens: Sequence[int] | None = None) -> RolloutOutput:
        """One response per prompt, each within its own budget when given."""
        ...

    def start(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
              max_new_tokens: Sequence[int] | None = None) -> GenerationRun:
        """A run the caller steps (streaming, migration)."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> object:
        """Copy new weights (Hugging Face names, full tensors) into the engine."""
        ...


ROLLOUT_DTYPES: dict[str, Literal["float32", "bfloat16"]] = {"fp32": "float32", "bf16": "bfloat16"}
"""The rollout dtype of each training precision (what a rollout config's ``"auto"`` becomes)."""


def build_rollout(config: RolloutConfig, *, model: PreTrainedModel, model_dir: str,
                  rank: int, precision: PrecisionName) -> RolloutEngine:
    """The rollout engine ``config`` describes, seeded per rank, in its ``dtype`` (for
    ``"auto"``, the policy's training ``precision``: :data:`ROLLOUT_DTYPES`).

    Args:
        config: native or vLLM settings.
        model: the actor's (unsharded) model; the native engine samples from a copy.
        model_dir: the directory ``model`` was loaded from (vLLM starts from it).
        rank: this rank in the pool (offsets the engine's seed).
        precision: the policy's resolved training precision (what ``"auto"`` follows).

    Returns:
        The engine.
    """
    if isinstance(config, VLLMRolloutConfig):
        dtype = ROLLOUT_DTYPES[precision] if config.dtype == "auto" else config.dtype
        seeded = msgspec.structs.replace(config, seed=config.seed + rank, dtype=dtype)
        return VLLMRolloutEngine(model_dir, config=seeded)
    native = dataclasses.replace(config, seed=config.seed + rank,
                                 dtype=ROLLOUT_DTYPES[precision] if config.dtype == "auto" else config.dtype)
    # The copy never trains. Parameters that require gradients would also change how
    # torch multiplies by them (``matmul`` folds a 3-D input into one 2-D product only
    # against a weight that does not), so a copy and the training parameters
    # themselves (bind_training_weights) would sample differently.
    copied = copy.deepcopy(model).to(getattr(torch, native.dtype)).requires_grad_(False)
    # The tokenizer decodes responses for stop strings (SamplingParams.stop).
    return NativeRolloutEngine(copied, config=native, tokenizer=load_tokenizer(model_dir))


def bind_training_weights(rollout: RolloutEngine | None, weights: Iterable[tuple[str, Tensor]]) -> bool:
    """Make the native ``rollout`` engine sample from ``weights`` (the training
    engine's, by Hugging Face name) themselves instead of its own copy, where that
    takes no conversion: every parameter of its model is among them, whole (no
    shard), with its shape, dtype and device, and it decodes without the static
    cache (a bind would turn that cache's CUDA graphs off). The copy's memory is
    freed. An optimizer step then changes the sampled weights in place; binding
    again after it (see :meth:`NativeRolloutEngine.bind_weights`) ends the runs
    opened before it and follows a parameter whose memory moved.

    Returns:
        Whether it bound them (False: the engine keeps its copy, to load with
        ``update_weights``).
    """
    if not isinstance(rollout, NativeRolloutEngine) or rollout.static_cache:
        return False
    mine = dict(rollout.model.named_parameters())
    given = {name: tensor for name, tensor in weights if name in mine}
    if given.keys() != mine.keys() or any(
        is_dtensor(tensor) or is_dtensor(mine[name]) or tensor.shape != mine[name].shape
        or tensor.dtype != mine[name].dtype or tensor.device != mine[name].device
        for name, tensor in given.items()
    ):
        return False
    rollout.bind_weights(given.items())
    return True


def prompt_budgets(prompts: Mapping[str, Tensor], params: SamplingParams) -> list[int] | None:
    """Each prompt row's token budget, from its ``max_new_tokens`` column (None without one).

    Raises:
        ConfigError: the column is not an integer ``[rows]`` tensor, or a value is
            outside ``1..params.max_new_tokens`` (naming the row and its ``uid``).
    """
    column = prompts.get(MAX_NEW_TOKENS)
    if column is None:
        return None
    if column.dim() != 1 or column.dtype.is_floating_point or column.dtype in (torch.bool, torch.uint8) \
            or column.dtype.is_complex:
        raise ConfigError(f"actor.generate: prompt column {MAX_NEW_TOKENS!r} must be int64 [rows] (one budget "
                          f"per prompt), got {column.dtype} of shape {tuple(column.shape)}")
    budgets = [int(b) for b in column.tolist()]
    for row, budget in enumerate(budgets):
        if not 1 <= budget <= params.max_new_tokens:
            uid = f" (uid {prompts[F.UID][row].tolist()})" if F.UID in prompts else ""
            raise ConfigError(
                f"actor.generate: prompt row {row}{uid} has {MAX_NEW_TOKENS}={budget}; a prompt's budget must "
                f"be in 1..{params.max_new_tokens} (SamplingParams.max_new_tokens, the response width): "
                f"lower it or raise SamplingParams.max_new_tokens")
    return budgets


def model_eos(model: PreTrainedModel) -> int | None:
    """The model config's EOS id (the first when it lists several; None without one)."""
    eos = model.config.eos_token_id
    return eos[0] if isinstance(eos, list) else eos


def params_for_rank(params: SamplingParams, *, eos_token_id: int | None, rank: int) -> SamplingParams:
    """``params`` with the model's EOS filled in (when unset) and the seed offset by rank."""
    changes: dict[str, object] = {}
    if params.eos_token_id is None and eos_token_id is not None:
        changes["eos_token_id"] = eos_token_id
    if params.seed is not None:
        changes["seed"] = params.seed + rank * SEED_STRIDE
    return msgspec.structs.replace(params, **changes) if changes else params


def rollout_rows(prompts: Mapping[str, Tensor], out: RolloutOutput | None, *, n: int,
                 params: SamplingParams, version: int = 0) -> dict[str, Tensor]:
    """The rows ``generate`` returns: every prompt column repeated ``n`` times
    (consecutively) plus the response columns.

    Args:
        prompts: this rank's prompt rows.
        out: the engine's output for the repeated prompts (None when there are none).
        n: samples per prompt.
        params: the sampling parameters (``max_new_tokens`` is the response width).
        version: the weights' version, every token's ``policy_version``.

    Returns:
        The columns, ``rows * n`` rows each.
    """
    rows = len(next(iter(prompts.values()))) if prompts else 0
    index = torch.arange(rows).repeat_interleave(n)
    columns = {name: value.index_select(0, index.to(value.device)) for name, value in prompts.items()}
    width = params.max_new_tokens
    if out is None:
        columns[F.RESPONSE_IDS] = torch.zeros(0, width, dtype=torch.int64)
        columns[F.RESPONSE_MASK] = torch.zeros(0, width, dtype=torch.int64)
        columns[F.ROLLOUT_LOGPROBS] = torch.zeros(0, width, dtype=torch.float32)
        columns[F.POLICY_VERSION] = torch.zeros(0, width, dtype=torch.int64)
        return columns
    columns[F.RESPONSE_IDS] = out.response_ids.to(torch.int64)
    columns[F.RESPONSE_MASK] = out.response_mask.to(torch.int64)
    columns[F.ROLLOUT_LOGPROBS] = out.logprobs.to(torch.float32)
    columns[F.POLICY_VERSION] = torch.full(out.response_ids.shape, version, dtype=torch.int64)
    return columns
