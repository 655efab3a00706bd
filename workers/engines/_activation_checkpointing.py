"""Activation checkpointing: recompute each transformer block in backward instead of
keeping its activations.

The transformers models' own mechanism is used (``gradient_checkpointing_enable``
with non-reentrant ``torch.utils.checkpoint``): it keeps the parameter names (so
checkpoints, exports and weight sync see the same names), composes with DTensor TP,
and composes with FSDP2 whichever comes first (FSDP2's forward hooks skip the
recompute, whose parameters the pre-backward hook has already gathered). It applies
to every transformers model inside the engine's model, so a value model built around
a transformers backbone is checkpointed too.
"""

from __future__ import annotations

from torch import nn

from workers.engines._errors import EngineConfigError


def enable_activation_checkpointing(model: nn.Module) -> int:
    """Make every transformer block of ``model`` recompute its forward in backward.

    Only in training mode: transformers checkpoints when ``module.training``, so
    ``log_probs``/``values`` (eval, no grad) run as before.

    Args:
        model: a transformers model, or a module holding one (e.g. a value model's
            backbone); not yet sharded or sharded, either works.

    Returns:
        How many transformers models were switched (the outermost ones).

    Raises:
        EngineConfigError: if no submodule supports transformers' gradient
            checkpointing (the field to change is named).
    """
    switched: list[str] = []
    for name, module in model.named_modules():
        if any(_inside(name, outer) for outer in switched):
            continue  # inside a model already switched (it switches its submodules)
        enable = getattr(module, "gradient_checkpointing_enable", None)
        if callable(enable) and getattr(module, "supports_gradient_checkpointing", False):
            enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            switched.append(name)
    if not switched:
        raise EngineConfigError(
            f"TrainingConfig.activation_checkpointing=True needs a transformers model "
            f"supporting gradient checkpointing inside the engine's model, and "
            f"{type(model).__name__} holds none; set activation_checkpointing=False"
        )
    return len(switched)


def _inside(name: str, outer: str) -> bool:
    return outer == "" or name == outer or name.startswith(f"{outer}.")
