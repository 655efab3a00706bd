"""The settings of a :class:`~._native.NativeRolloutEngine`."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Literal

import torch

from channels import ConfigError

__all__ = ["NativeRolloutConfig"]


@dataclass(frozen=True, kw_only=True)
class NativeRolloutConfig:
    """Settings of a :class:`NativeRolloutEngine`."""

    max_batch_size: int | None = None
    """Most sequences decoding at once; waiting prompts join as rows finish. None
    (the default): every sample of a request decodes in one batch, sized from the
    request. A cap that splits a request into waves is logged (a warning, once per
    engine), as is the batch a run chose (at INFO)."""
    seed: int = 0
    """Seed of the engine's generator, which draws a request's seed when
    ``SamplingParams.seed`` is None."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """The dtype of the weights the engine samples from (and of its KV cache):
    ``"auto"`` is the policy's training precision (the actor's
    ``TrainingConfig.precision``: bfloat16 on a GPU, float32 on the CPU by default;
    a rollout role on its own pool takes the same rule from its device). The
    roles apply it when they build the engine; log-probs are float32 either way."""
    decode: Literal["auto", "dynamic", "static"] = "auto"
    """How decode steps keep the KV cache. ``"dynamic"``: a cache that grows with the
    batch's longest row and is compacted as rows leave (cheap on the CPU, where a step
    costs what it reads). ``"static"``: one cache preallocated for the run, a slot per
    row, each step's attention masked to the slot's own tokens, and the samples'
    bookkeeping on tensors; on CUDA its decode step is replayed as a CUDA graph
    (``cuda_graphs``). ``"auto"``: static on a CUDA device for the models the lean
    step supports (Llama, Qwen2), dynamic elsewhere. Tokens and log-probs mean the
    same either way (equal up to float rounding). The static cache (and its graphs)
    stays allocated between runs, for the next one, until the engine's weights are
    released (``release_weights``)."""
    cuda_graphs: bool = True
    """With the static cache on CUDA, capture the decode step as one CUDA graph per
    batch-size bucket and replay it (prefill stays eager); False runs it eagerly. An
    engine whose weights are bound from outside (``bind_weights``: the hybrid engine,
    new tensors at every transition) stops capturing after its first bind, as every
    bind would capture again."""

    compile: bool | Literal["auto"] = "auto"
    """With the static cache, compile each layer's parts before and after attention
    with ``torch.compile`` (Inductor, sizes dynamic: compiled once, they serve every
    layer, batch-size bucket and decoder of a model's shape), which fuses the norms,
    the rotary embedding and the activation into a few kernels; the CUDA graphs then
    replay the compiled kernels. Sampling from the model's own distribution
    (temperature 1, neither top-k nor top-p) is compiled too: two reads of the
    logits. The first step pays the compilation (seconds on a GPU's host). ``"auto"``
    (the default): on CUDA where Triton is installed, off elsewhere (on the CPU a
    step costs what it reads, and compiling takes a minute). A compilation that
    fails is logged and the step runs uncompiled."""

    def __post_init__(self) -> None:
        if self.max_batch_size is not None and (
            not isinstance(self.max_batch_size, int) or isinstance(self.max_batch_size, bool) or self.max_batch_size < 1
        ):
            raise ConfigError(
                f"NativeRolloutConfig.max_batch_size must be an int >= 1 or None (sized from the request), "
                f"got {self.max_batch_size!r}"
            )
        if not isinstance(self.seed, int):
            raise ConfigError(f"NativeRolloutConfig.seed must be an int, got {self.seed!r}")
        if self.decode not in ("auto", "dynamic", "static"):
            raise ConfigError(f"NativeRolloutConfig.decode must be 'auto', 'dynamic' or 'static', got {self.decode!r}")
        if not isinstance(self.cuda_graphs, bool):
            raise ConfigError(f"NativeRolloutConfig.cuda_graphs must be a bool, got {self.cuda_graphs!r}")
        if self.compile not in (True, False, "auto"):
            raise ConfigError(f"NativeRolloutConfig.compile must be a bool or 'auto', got {self.compile!r}")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ConfigError(f"NativeRolloutConfig.dtype must be 'auto', 'float32' or 'bfloat16', got {self.dtype!r}")

    def compiles(self, device: torch.device) -> bool:
        """Whether static decoders on ``device`` compile their step (see ``compile``)."""
        if self.compile == "auto":
            return device.type == "cuda" and importlib.util.find_spec("triton") is not None
        return self.compile

