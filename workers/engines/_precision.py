"""Numeric precision of a training engine: which dtype computes and which one stores.

A :class:`Precision` is the strategy the engine consults at three points, so that no
mode branch sits in its loop: :meth:`Precision.prepare` before the layout (an
inference-only bf16 model stores its parameters in bf16), :meth:`Precision.fsdp_policy`
for every ``fully_shard`` call, and :meth:`Precision.context` around every forward.

Mixed bf16 training follows torchtitan and verl: float32 master weights, optimizer
state and gradient reduction, bfloat16 matrix products. FSDP2 does the casting on a
sharded model (``MixedPrecisionPolicy``); an unsharded one (one rank, replicas, TP
alone) runs its forward under ``torch.autocast``. Log-probs, entropy, values and losses
are computed in float32 whatever the strategy (the heads cast the model's outputs).
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

from workers.engines._errors import EngineConfigError

if TYPE_CHECKING:  # FSDP's modules: a second to import, needed only where a model is sharded
    from torch.distributed.fsdp import MixedPrecisionPolicy

PrecisionName = Literal["fp32", "bf16"]
"""A resolved precision: float32 throughout, or bfloat16 compute."""

PRECISION_SETTINGS = ("auto", "fp32", "bf16")
"""The values of ``TrainingConfig.precision``."""


def resolve_precision(setting: str, device: torch.device) -> PrecisionName:
    """The precision a setting means on a device.

    Args:
        setting: ``"auto"`` (bf16 on CUDA, fp32 elsewhere), ``"fp32"`` or ``"bf16"``.
        device: the device the model computes on.

    Returns:
        ``"fp32"`` or ``"bf16"``.

    Raises:
        EngineConfigError: for an unknown setting, or ``"bf16"`` on a GPU without
            bfloat16 arithmetic.
    """
    if setting not in PRECISION_SETTINGS:
        raise EngineConfigError(
            f"TrainingConfig.precision must be one of {PRECISION_SETTINGS}, got {setting!r}"
        )
    cuda = device.type == "cuda"
    if setting == "auto":
        return "bf16" if cuda and torch.cuda.is_bf16_supported() else "fp32"
    if setting == "bf16" and cuda and not torch.cuda.is_bf16_supported():
        raise EngineConfigError(
            f"TrainingConfig.precision='bf16' needs bfloat16 arithmetic, which {device} lacks "
            "(Ampere or newer has it); use precision='fp32' or 'auto'"
        )
    return setting  # type: ignore[return-value]


class Precision:
    """Float32 throughout: the base strategy, which the bf16 ones refine."""

    name: PrecisionName = "fp32"
    """The resolved precision this strategy implements."""

    def prepare(self, model: nn.Module) -> None:
        """Adjust the model's storage before it is laid out (nothing here).

        Args:
            model: the unsharded model.
        """

    def fsdp_policy(self) -> MixedPrecisionPolicy:
        """The mixed-precision policy of every ``fully_shard`` call.

        Returns:
            FSDP2's default: compute and reduce in the parameters' dtype.
        """
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy()

    def context(self) -> AbstractContextManager[None]:
        """What a forward runs under (its backward needs nothing).

        Returns:
            A context manager; here one that does nothing.
        """
        return contextlib.nullcontext()


class ShardedMixedBF16(Precision):
    """bf16 compute on an FSDP2-sharded model: FSDP2 all-gathers bf16 copies of the
    float32 shards and reduce-scatters float32 gradients."""

    name: PrecisionName = "bf16"

    def fsdp_policy(self) -> MixedPrecisionPolicy:
        """bf16 parameters in compute, float32 gradient reduction.

        Returns:
            ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``.
        """
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


class AutocastBF16(Precision):
    """bf16 compute on an unsharded model: float32 parameters, forwards under
    ``torch.autocast``; gradients come out float32, so a replicated model's
    all-reduce stays float32."""

    name: PrecisionName = "bf16"

    def __init__(self, device_type: str) -> None:
        """Autocast on one device type.

        Args:
            device_type: the engine's device type (``"cuda"``, ``"cpu"``).
        """
        self.device_type = device_type

    def context(self) -> AbstractContextManager[None]:
        """Autocast to bfloat16 on the engine's device type.

        Returns:
            The autocast context.
        """
        return torch.autocast(self.device_type, dtype=torch.bfloat16)


class BF16Weights(Precision):
    """Inference in bf16: the parameters themselves are cast (half the memory of
    float32); buffers (e.g. rotary frequencies) keep their dtype."""

    name: PrecisionName = "bf16"

    def prepare(self, model: nn.Module) -> None:
        """Cast every floating-point parameter of ``model`` to bfloat16 in place.

        Args:
            model: the unsharded model (tied parameters stay tied: the same
                ``Parameter`` objects are kept).
        """
        with torch.no_grad():
            for param in model.parameters():  # each shared parameter once
                if param.is_floating_point():
                    param.data = param.data.to(torch.bfloat16)


def precision_strategy(
    name: PrecisionName, *, device: torch.device, trainable: bool, sharded: bool
) -> Precision:
    """The strategy for a resolved precision and the model's role and layout.

    Args:
        name: the resolved precision (:func:`resolve_precision`).
        device: the engine's device (its type selects the autocast device).
        trainable: whether the engine trains (False: inference only).
        sharded: whether FSDP2 shards the model over data-parallel ranks.

    Returns:
        :class:`Precision` (fp32), :class:`BF16Weights` (bf16 inference),
        :class:`ShardedMixedBF16` or :class:`AutocastBF16` (bf16 training).
    """
    if name == "fp32":
        return Precision()
    if not trainable:
        return BF16Weights()
    return ShardedMixedBF16() if sharded else AutocastBF16(device.type)
