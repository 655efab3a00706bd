"""Native rollout engine: continuous-batching generation on a transformers causal LM.

:meth:`NativeRolloutEngine.start` opens a run that keeps one decode batch of all its
samples (at most ``max_batch_size`` rows when that is set). Every step first
prefills waiting samples into the free rows (a separate left-padded forward pass
whose KV cache then joins the decode batch), then decodes one token for every row.
A row leaves the batch as soon as it samples EOS (unless ``ignore_eos``), completes
a stop string or reaches its token budget (``max_new_tokens``, or the prompt's
own), and its :class:`FinishedSample` is reported in that step, so streaming
consumers see each sample when it completes, not when its batch does. ``generate``
and ``generate_stream`` step such a run to its end.

Unfinished samples leave a run as :class:`PartialSample` (``export``) and continue in
another run, on this engine or another one (``admit``): their prompt and response so
far are prefilled again, their random stream goes on where it stopped and their
budget stays theirs. The run lives in :mod:`._native_run`, its running rows in a
decode batch (:mod:`._decode_batch`): a dynamic KV cache (:mod:`._kv_batch`, the CPU's)
or a static one whose decode step is replayed as CUDA graphs (:mod:`._static_batch`,
:mod:`._static_cache`, the default on CUDA); the per-sample random streams are in
:mod:`._sampling`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from channels import ConfigError
from workers._dtensor import is_dtensor

from ._bind import bind_parameters, release_parameters
from ._decode_batch import DecodeBatch, RunRules
from ._kv_batch import DynamicBatch
from ._lean_decode import lean_decoder
from ._native_config import NativeRolloutConfig
from ._native_run import NativeRun
from ._static_batch import StaticBatch
from ._static_cache import DecoderPool
from ._stop import StopStrings, TextDecoder
from ._types import (
    FinishedSample,
    GenerationRun,
    RolloutOutput,
    SamplingParams,
    drain,
    resolve_budgets,
    resolve_indices,
    run_to_output,
)

if TYPE_CHECKING:  # transformers' model classes: seconds to import; a generating worker has them
    from transformers import PreTrainedModel

__all__ = ["NativeRolloutEngine"]

logger = logging.getLogger(__name__)


class NativeRolloutEngine:
    """Generates responses with a transformers causal LM, a KV cache and continuous batching.

    Not thread-safe: use one engine from one thread. Runs opened by :meth:`start`
    (and :meth:`generate_stream` iterators) stay valid until :meth:`update_weights`;
    then they refuse to step (rows in flight would mix old and new weights).

    Args:
        model: A transformers causal LM (e.g. ``LlamaForCausalLM``); the engine puts
            it in eval mode and updates it in place in :meth:`update_weights`.
        config: Engine settings.
        tokenizer: The model's tokenizer (anything with ``decode(ids,
            skip_special_tokens=True)``), which stop strings (``SamplingParams.stop``)
            are looked for with; None refuses requests with stop strings.

    Raises:
        ValueError: If the model uses sliding-window attention (not supported).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        config: NativeRolloutConfig,
        tokenizer: TextDecoder | None = None,
    ) -> None:
        layer_types = getattr(model.config, "layer_types", None) or []
        if any(kind != "full_attention" for kind in layer_types):
            raise ConfigError(
                f"NativeRolloutEngine supports full attention only; the model's "
                f"config.layer_types is {layer_types}"
            )
        self._model = model.eval()
        self._config = config
        self._tokenizer = tokenizer
        self._device = next(model.parameters()).device
        self._vocab_size = int(model.config.vocab_size)
        self._max_length = int(model.config.max_position_embeddings)
        self._generator = torch.Generator().manual_seed(config.seed)
        self._weights_version = 0
        self._warned_cap = False
        self._released: dict[str, tuple[int, ...]] | None = None
        self._decoders = self._static_decoders()

    def _static_decoders(self) -> DecoderPool | None:
        """The static decoders' pool where the config asks for the static cache (see
        ``NativeRolloutConfig.decode``); None for the dynamic one."""
        decode = self._config.decode
        lean = lean_decoder(self._model) is not None
        if decode == "static" and not lean:
            raise ConfigError(
                f"NativeRolloutConfig.decode='static' needs a Llama- or Qwen2-shaped model with default "
                f"RoPE and SDPA attention; this one ({type(self._model).__name__}) decodes with "
                "decode='dynamic' (or 'auto')"
            )
        if decode == "dynamic" or (decode == "auto" and (self._device.type != "cuda" or not lean)):
            return None
        return DecoderPool(self._model, graphs=self._config.cuda_graphs, compiled=self._config.compiles(self._device))

    @property
    def model(self) -> PreTrainedModel:
        """The causal LM the engine samples from."""
        return self._model

    @property
    def config(self) -> NativeRolloutConfig:
        """The engine's settings."""
        return self._config

    @property
    def static_cache(self) -> bool:
        """Whether runs decode with the static cache (``NativeRolloutConfig.decode``):
        weights bound from outside (:meth:`bind_weights`) then turn its CUDA graphs
        and compiling off."""
        return self._decoders is not None

    @property
    def weights_version(self) -> int:
        """Changes whenever the weights do (a load, bind or release): a run started
        before refuses to step on."""
        return self._weights_version

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        max_new_tokens: Sequence[int] | None = None,
    ) -> RolloutOutput:
        """Generate one response per prompt and return them as padded tensors.

        Args:
            prompts: Token ids of each prompt (no padding).
            params: How to sample.
            max_new_tokens: Each prompt's own token budget, in
                ``1..params.max_new_tokens``; None gives every prompt
                ``params.max_new_tokens``. Responses are padded to
                ``params.max_new_tokens`` either way.

        Returns:
            The responses, row ``i`` answering ``prompts[i]``, in the conventions of
            :class:`RolloutOutput`.

        Raises:
            ValueError: If a prompt is empty, holds an id outside the vocabulary, or
                is too long for its budget of new tokens within the model's
                ``max_position_embeddings``, or a budget is out of range (naming
                the prompt).
        """
        return run_to_output(self.start(prompts, params, max_new_tokens=max_new_tokens), prompts, params)

    def generate_stream(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        max_new_tokens: Sequence[int] | None = None,
    ) -> Iterator[FinishedSample]:
        """Generate one response per prompt, yielding each as soon as it completes.

        Prompts are validated before this returns; generation advances as the
        iterator is consumed (one step of :meth:`start`'s run per pull at most).

        Args:
            prompts: Token ids of each prompt (no padding).
            params: How to sample.
            max_new_tokens: Each prompt's own token budget, as in :meth:`generate`.

        Returns:
            An iterator over the finished samples in completion order; each prompt's
            index appears exactly once.

        Raises:
            ValueError: As :meth:`generate`.
        """
        return drain(self.start(prompts, params, max_new_tokens=max_new_tokens))

    def start(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        indices: Sequence[int] | None = None,
        max_new_tokens: Sequence[int] | None = None,
    ) -> GenerationRun:
        """Open a run that generates one response per prompt as the caller steps it.

        Sampled sample ``i`` draws from a random stream seeded from ``(seed, indices[i])``,
        so with the default indices the run's samples are :meth:`generate`'s rows.
        An exported sample carries its stream's row seed: admitted into a run on an
        engine with the same weights, it gets the tokens it would have had
        uninterrupted, with log-probs equal up to float rounding (the prefill sums
        in another order than the decode steps it replaces). A sample admitted
        without ``rng_state`` is re-seeded from ``(seed, index, tokens so far)``.
        The run stays valid until :meth:`update_weights`.

        Args:
            prompts: Token ids of each prompt (no padding); may be empty (a run that
                takes admitted samples only).
            params: How to sample; with ``seed`` None, the engine's generator draws one.
            indices: The caller's id of each prompt (:attr:`FinishedSample.index`);
                ``0..len(prompts)-1`` by default.
            max_new_tokens: Each prompt's own token budget, in
                ``1..params.max_new_tokens``; None gives every prompt
                ``params.max_new_tokens``. An exported sample carries its budget.

        Returns:
            The run; nothing is computed before its first step.

        Raises:
            ValueError: As :meth:`generate`, or if ``indices`` does not give one
                distinct id per prompt, or ``params.stop`` is set on an engine
                without a tokenizer.
        """
        if self._released is not None:
            raise ConfigError("the rollout engine's weights were released (release_weights); bind_weights "
                              "before generating")
        self._check_params(params)
        budgets = resolve_budgets(max_new_tokens, len(prompts), params)
        prompt_lists = [
            self.checked_prompt(p, budget, f"prompts[{i}]")
            for i, (p, budget) in enumerate(zip(prompts, budgets, strict=True))
        ]
        caller_indices = resolve_indices(indices, len(prompt_lists))
        seed = params.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (), generator=self._generator))
        stop = None
        if params.stop:
            assert self._tokenizer is not None  # _check_params refuses stop strings without one
            stop = StopStrings(self._tokenizer, params.stop, min_new_tokens=params.min_new_tokens)
        self._log_batch(len(prompt_lists))
        rules = RunRules(params=params, stop=stop, early_banned=self._early_banned(params))
        batch: DecodeBatch = (
            DynamicBatch(self._model, rules) if self._decoders is None
            else StaticBatch(self._model, rules, self._decoders, slots=self._config.max_batch_size)
        )
        run = NativeRun(self, rules, seed, batch)
        run.queue(
            [
                run.row(index, prompt, [], [], budget)
                for index, prompt, budget in zip(caller_indices, prompt_lists, budgets, strict=True)
            ]
        )
        return run

    def _log_batch(self, samples: int) -> None:
        """Say how a request of ``samples`` decodes: in one batch, or in waves under the cap."""
        cap = self._config.max_batch_size
        if cap is None or samples <= cap:
            logger.info("native rollout: %d samples decode in one batch (max_batch_size=%s)", samples, cap)
        elif not self._warned_cap:
            self._warned_cap = True
            logger.warning(
                "native rollout: %d samples exceed max_batch_size=%d; they decode in waves of at most %d "
                "(NativeRolloutConfig.max_batch_size=None sizes the batch from the request)", samples, cap, cap)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy new weights into the model in place; open runs stop being valid.

        Tensors are copied as they arrive; when one fails, those before it are loaded.

        Args:
            named_tensors: ``(name, tensor)`` pairs named as in ``model.state_dict()``;
                any subset of the parameters may be given; a tensor-parallel
                parameter (a DTensor) takes this rank's shard.

        Returns:
            The number of tensors loaded.

        Raises:
            ValueError: If a name is not one of the model's or a shape differs.
        """
        self._weights_version += 1
        targets = self._model.state_dict(keep_vars=True)
        loaded = 0
        with torch.no_grad():
            for name, tensor in named_tensors:
                target = targets.get(name)
                if target is None:
                    example = next(iter(targets), "")
                    raise ConfigError(
                        f"update_weights got {name!r}, which is not a tensor of the model; "
                        f"use the names of model.state_dict(), e.g. {example!r}"
                    )
                if is_dtensor(target):  # tensor parallel: this rank's shard
                    target = target._local_tensor
                if tuple(target.shape) != tuple(tensor.shape):
                    raise ConfigError(
                        f"update_weights got {name!r} with shape {tuple(tensor.shape)}, but the "
                        f"model's is {tuple(target.shape)} (this rank's shard when tensor parallel)"
                    )
                target.copy_(tensor.detach().to(device=target.device, dtype=target.dtype))
                loaded += 1
        return loaded

    def bind_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Make the model's parameters view the given tensors (no copy): the hybrid
        engine's generation shards, kept alive by the caller until
        :meth:`release_weights`, or the training engine's own parameters where they
        are the whole model in the engine's dtype. Open runs stop being valid.

        Raises:
            ConfigError: a name is not a parameter, or a shape or dtype differs.
        """
        self._weights_version += 1
        if self._decoders is not None:
            self._decoders.clear(rebound=True)
        bound = bind_parameters(self._model, named_tensors, self._released or {})
        self._released = None
        return bound

    def release_weights(self) -> None:
        """Drop the model's parameter memory; generating refuses until :meth:`bind_weights`."""
        self._weights_version += 1
        if self._decoders is not None:
            self._decoders.clear()  # the KV cache's memory goes with the weights'
        shapes = release_parameters(self._model)
        self._released = self._released or shapes

    def _early_banned(self, params: SamplingParams) -> tuple[int, ...]:
        """The ids ``min_new_tokens`` keeps out of a response's first tokens, as in vLLM.

        ``eos_token_id`` when it ends responses; and, as vLLM's ``min_tokens`` also
        masks its tokenizer's EOS whenever it masks anything (EOS or stop strings
        to honour), the tokenizer's ``eos_token_id`` then too.
        """
        banned = []
        if not params.ignore_eos and params.eos_token_id is not None:
            banned.append(params.eos_token_id)
        tokenizer_eos = getattr(self._tokenizer, "eos_token_id", None)
        if (banned or params.stop) and isinstance(tokenizer_eos, int) and tokenizer_eos not in banned:
            if 0 <= tokenizer_eos < self._vocab_size:
                banned.append(tokenizer_eos)
        return tuple(banned)

    def _check_params(self, params: SamplingParams) -> None:
        if params.stop and self._tokenizer is None:
            raise ConfigError(
                f"SamplingParams.stop={list(params.stop)!r} needs a tokenizer to decode "
                "responses, and this NativeRolloutEngine has none; create it with "
                "tokenizer=<the model's tokenizer> or leave stop empty"
            )
        for name in ("pad_token_id", "eos_token_id"):
            token = getattr(params, name)
            if token is not None and not 0 <= token < self._vocab_size:
                raise ConfigError(
                    f"SamplingParams.{name}={token} is outside the model's vocabulary "
                    f"[0, {self._vocab_size})"
                )

    def checked_tokens(self, tokens: Sequence[int], where: str) -> list[int]:
        """``tokens`` as a list of ints, all within the vocabulary.

        Raises:
            ConfigError: naming ``where`` and the token outside the vocabulary.
        """
        ids = [int(token) for token in tokens]
        bad = next((t for t in ids if not 0 <= t < self._vocab_size), None)
        if bad is not None:
            raise ConfigError(
                f"{where} holds token id {bad}, outside the model's vocabulary "
                f"[0, {self._vocab_size})"
            )
        return ids

    def checked_prompt(self, prompt: Sequence[int], budget: int, where: str) -> list[int]:
        """``prompt`` as a list, checked: not empty, in the vocabulary, and short
        enough for ``budget`` more tokens.

        Raises:
            ConfigError: naming ``where`` and what is wrong.
        """
        if not prompt:
            raise ConfigError(f"{where} is empty; every prompt needs >= 1 token")
        ids = self.checked_tokens(prompt, where)
        length = len(ids)
        if length + budget > self._max_length:
            raise ConfigError(
                f"{where} has {length} tokens; with max_new_tokens={budget} that is "
                f"{length + budget} > the model's max_position_embeddings="
                f"{self._max_length}; shorten the prompt or lower its max_new_tokens"
            )
        return ids
