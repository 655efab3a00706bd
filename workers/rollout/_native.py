"""Native rollout engine: continuous-batching generation on a transformers causal LM.

:meth:`NativeRolloutEngine.start` opens a run that keeps one decode batch of at most
``max_batch_size`` rows. Every step first prefills waiting samples into the free rows
(a separate left-padded forward pass whose KV cache then joins the decode batch),
then decodes one token for every row. A row leaves the batch as soon as it samples
EOS or reaches ``max_new_tokens``, and its :class:`FinishedSample` is reported in that
step, so streaming consumers see each sample when it completes, not when its batch
does. ``generate`` and ``generate_stream`` step such a run to its end.

Unfinished samples leave a run as :class:`PartialSample` (``export``) and continue in
another run, on this engine or another one (``admit``): their prompt and response so
far are prefilled again and their random stream goes on where it stopped. The KV
cache layout lives in :mod:`._kv_batch`, the per-sample random streams in
:mod:`._sampling`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from channels import ConfigError

from ._kv_batch import KVBatch, decode, prefill
from ._sampling import generator_state, restore_generator, row_generator, sample_tokens
from ._types import (
    FinishedSample,
    GenerationRun,
    PartialSample,
    RolloutOutput,
    SamplingParams,
    check_admissible,
    drain,
    resolve_indices,
)

__all__ = ["NativeRolloutConfig", "NativeRolloutEngine"]


@dataclass(frozen=True, kw_only=True)
class NativeRolloutConfig:
    """Settings of a :class:`NativeRolloutEngine`."""

    max_batch_size: int = 32
    """Most sequences decoding at once; waiting prompts join as rows finish."""
    seed: int = 0
    """Seed of the engine's generator, which draws a request's seed when
    ``SamplingParams.seed`` is None."""

    def __post_init__(self) -> None:
        if not isinstance(self.max_batch_size, int) or self.max_batch_size < 1:
            raise ConfigError(
                f"NativeRolloutConfig.max_batch_size must be an int >= 1, got {self.max_batch_size!r}"
            )
        if not isinstance(self.seed, int):
            raise ConfigError(f"NativeRolloutConfig.seed must be an int, got {self.seed!r}")


@dataclass(kw_only=True, eq=False)
class _Row:
    """One sample of a run: its prompt, its response so far and its random stream."""

    index: int
    prompt: list[int]
    response: list[int]
    logprobs: list[float]
    generator: torch.Generator | None
    """None when sampling is greedy."""

    def finished(self) -> FinishedSample:
        return FinishedSample(index=self.index, response_ids=self.response, logprobs=self.logprobs)

    def partial(self) -> PartialSample:
        state = None if self.generator is None else generator_state(self.generator)
        return PartialSample(
            index=self.index,
            prompt=self.prompt,
            response_ids=self.response,
            logprobs=self.logprobs,
            rng_state=state,
        )


class _NativeRun:
    """The :class:`~._types.GenerationRun` of a :class:`NativeRolloutEngine`.

    One decode batch of at most ``max_batch_size`` rows: each step first prefills
    waiting samples into the free rows (as a separate left-padded forward pass whose
    KV cache then joins the batch; a migrated sample prefills its prompt and its
    response so far), then decodes one token for every row. A row leaves as soon as
    it samples EOS or reaches ``max_new_tokens``.
    """

    def __init__(self, engine: NativeRolloutEngine, params: SamplingParams, seed: int) -> None:
        self._engine = engine
        self._params = params
        self._seed = seed
        self._weights_version = engine._weights_version
        self._rows: dict[int, _Row] = {}
        """Every pending sample by index, waiting or running."""
        self._waiting: deque[_Row] = deque()
        self._running: KVBatch | None = None
        self._closed = False

    @property
    def pending(self) -> int:
        """Samples not finished yet (waiting or running)."""
        return len(self._rows)

    def step(self) -> list[FinishedSample]:
        """One scheduling step; the samples that finished in it, in completion order."""
        self._check_usable("step")
        # Grad mode is off inside each model call only (prefill and decode), so a
        # consumer stepping the run keeps its own grad mode.
        model = self._engine.model
        finished: list[FinishedSample] = []
        running = self._running
        free = self._engine.config.max_batch_size - (len(running) if running is not None else 0)
        if self._waiting and free > 0:
            joining = [self._waiting.popleft() for _ in range(min(free, len(self._waiting)))]
            fresh, logits = prefill(
                model,
                [row.prompt + row.response for row in joining],
                [row.index for row in joining],
                pad_token_id=self._params.pad_token_id,
            )
            finished += self._advance(fresh, logits)
            if running is None:
                running = fresh
            elif len(fresh):
                running.extend(fresh)
        if running is not None and len(running):
            finished += self._advance(running, decode(model, running))
        self._running = running if running is not None and len(running) else None
        return finished

    def export(self) -> list[PartialSample]:
        """Remove every unfinished sample and return it, in the order they joined."""
        exported = [row.partial() for row in self._rows.values()]
        self._rows.clear()
        self._waiting.clear()
        self._running = None
        return exported

    def admit(self, samples: Sequence[PartialSample]) -> None:
        """Queue ``samples`` to continue here, with their carried random streams."""
        self._check_usable("admit")
        check_admissible(samples, self._params, self._rows)
        engine, rows = self._engine, []
        for partial in samples:
            where = f"PartialSample index={partial.index}"
            prompt = engine._checked_prompt(partial.prompt, self._params, where)
            response = engine._checked_tokens(partial.response_ids, f"{where} response_ids")
            logprobs = list(partial.logprobs)
            rows.append(self._row(partial.index, prompt, response, logprobs, partial.rng_state))
        self._queue(rows)

    def close(self) -> None:
        """Drop every pending sample; later steps and admits raise. Idempotent."""
        self.export()
        self._closed = True

    def _row(
        self,
        index: int,
        prompt: list[int],
        response: list[int],
        logprobs: list[float],
        rng_state: bytes | None = None,
    ) -> _Row:
        """A row of checked tokens, with its generator when sampling."""
        generator, device = None, self._engine._device
        if not self._params.greedy and rng_state is not None:
            generator = restore_generator(rng_state, device, index=index)
        elif not self._params.greedy:
            generator = row_generator(self._seed, index, device, skip=len(response))
        return _Row(
            index=index, prompt=prompt, response=response, logprobs=logprobs, generator=generator
        )

    def _queue(self, rows: list[_Row]) -> None:
        for row in rows:
            self._rows[row.index] = row
        self._waiting.extend(rows)

    def _advance(self, batch: KVBatch, logits: torch.Tensor) -> list[FinishedSample]:
        """Sample one token per row, record it, and drop the rows that finished."""
        params = self._params
        rows = [self._rows[index] for index in batch.indices]
        tokens, logprobs = sample_tokens(logits, params, [row.generator for row in rows])
        batch.next_tokens = tokens
        finished, keep = [], []
        for position, (row, token, logprob) in enumerate(
            zip(rows, tokens.tolist(), logprobs.tolist(), strict=True)
        ):
            row.response.append(token)
            row.logprobs.append(logprob)
            if token == params.eos_token_id or len(row.response) >= params.max_new_tokens:
                finished.append(self._rows.pop(row.index).finished())
            else:
                keep.append(position)
        batch.keep(keep)
        return finished

    def _check_usable(self, action: str) -> None:
        if self._closed:
            raise RuntimeError(f"cannot {action}: this run is closed; start a new one")
        if self._weights_version != self._engine._weights_version:
            raise RuntimeError(
                f"cannot {action}: the engine's weights changed since this run started; "
                "export() its unfinished samples and admit them into a new run"
            )


class NativeRolloutEngine:
    """Generates responses with a transformers causal LM, a KV cache and continuous batching.

    Not thread-safe: use one engine from one thread. Runs opened by :meth:`start`
    (and :meth:`generate_stream` iterators) stay valid until :meth:`update_weights`;
    then they refuse to step (rows in flight would mix old and new weights).

    Args:
        model: A transformers causal LM (e.g. ``LlamaForCausalLM``); the engine puts
            it in eval mode and updates it in place in :meth:`update_weights`.
        config: Engine settings.

    Raises:
        ValueError: If the model uses sliding-window attention (not supported).
    """

    def __init__(self, model: PreTrainedModel, *, config: NativeRolloutConfig) -> None:
        layer_types = getattr(model.config, "layer_types", None) or []
        if any(kind != "full_attention" for kind in layer_types):
            raise ConfigError(
                f"NativeRolloutEngine supports full attention only; the model's "
                f"config.layer_types is {layer_types}"
            )
        self._model = model.eval()
        self._config = config
        self._device = next(model.parameters()).device
        self._vocab_size = int(model.config.vocab_size)
        self._max_length = int(model.config.max_position_embeddings)
        self._generator = torch.Generator().manual_seed(config.seed)
        self._weights_version = 0

    @property
    def model(self) -> PreTrainedModel:
        """The causal LM the engine samples from."""
        return self._model

    @property
    def config(self) -> NativeRolloutConfig:
        """The engine's settings."""
        return self._config

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> RolloutOutput:
        """Generate one response per prompt and return them as padded tensors.

        Args:
            prompts: Token ids of each prompt (no padding).
            params: How to sample.

        Returns:
            The responses, row ``i`` answering ``prompts[i]``, in the conventions of
            :class:`RolloutOutput`.

        Raises:
            ValueError: If a prompt is empty, holds an id outside the vocabulary, or
                is too long for ``max_new_tokens`` more tokens within the model's
                ``max_position_embeddings``.
        """
        run = self.start(prompts, params)
        samples = {sample.index: sample for sample in drain(run)}
        prompt_lists = [list(prompt) for prompt in prompts]
        return RolloutOutput.from_samples(
            prompt_lists, [samples[i] for i in range(len(prompt_lists))], params
        )

    def generate_stream(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> Iterator[FinishedSample]:
        """Generate one response per prompt, yielding each as soon as it completes.

        Prompts are validated before this returns; generation advances as the
        iterator is consumed (one step of :meth:`start`'s run per pull at most).

        Args:
            prompts: Token ids of each prompt (no padding).
            params: How to sample.

        Returns:
            An iterator over the finished samples in completion order; each prompt's
            index appears exactly once.

        Raises:
            ValueError: As :meth:`generate`.
        """
        return drain(self.start(prompts, params))

    def start(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        indices: Sequence[int] | None = None,
    ) -> GenerationRun:
        """Open a run that generates one response per prompt as the caller steps it.

        Sampled sample ``i`` draws from a generator seeded from ``(seed, indices[i])``,
        so with the default indices the run's samples are :meth:`generate`'s rows.
        An exported sample carries its generator's state: admitted into a run on an
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

        Returns:
            The run; nothing is computed before its first step.

        Raises:
            ValueError: As :meth:`generate`, or if ``indices`` does not give one
                distinct id per prompt.
        """
        self._check_params(params)
        prompt_lists = [
            self._checked_prompt(p, params, f"prompts[{i}]") for i, p in enumerate(prompts)
        ]
        caller_indices = resolve_indices(indices, len(prompt_lists))
        seed = params.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (), generator=self._generator))
        run = _NativeRun(self, params, seed)
        run._queue(
            [
                run._row(index, prompt, [], [])
                for index, prompt in zip(caller_indices, prompt_lists, strict=True)
            ]
        )
        return run

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy new weights into the model in place; open runs stop being valid.

        Tensors are copied as they arrive; when one fails, those before it are loaded.

        Args:
            named_tensors: ``(name, tensor)`` pairs named as in ``model.state_dict()``;
                any subset of the parameters may be given.

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
                if tuple(target.shape) != tuple(tensor.shape):
                    raise ConfigError(
                        f"update_weights got {name!r} with shape {tuple(tensor.shape)}, but the "
                        f"model's is {tuple(target.shape)}"
                    )
                target.copy_(tensor.detach().to(device=target.device, dtype=target.dtype))
                loaded += 1
        return loaded

    def _check_params(self, params: SamplingParams) -> None:
        for name in ("pad_token_id", "eos_token_id"):
            token = getattr(params, name)
            if token is not None and not 0 <= token < self._vocab_size:
                raise ConfigError(
                    f"SamplingParams.{name}={token} is outside the model's vocabulary "
                    f"[0, {self._vocab_size})"
                )

    def _checked_tokens(self, tokens: Sequence[int], where: str) -> list[int]:
        """``tokens`` as a list of ints, all within the vocabulary."""
        ids = [int(token) for token in tokens]
        bad = next((t for t in ids if not 0 <= t < self._vocab_size), None)
        if bad is not None:
            raise ConfigError(
                f"{where} holds token id {bad}, outside the model's vocabulary "
                f"[0, {self._vocab_size})"
            )
        return ids

    def _checked_prompt(
        self, prompt: Sequence[int], params: SamplingParams, where: str
    ) -> list[int]:
        """``prompt`` as a list, checked: not empty, in the vocabulary, short enough."""
        if not prompt:
            raise ConfigError(f"{where} is empty; every prompt needs >= 1 token")
        ids = self._checked_tokens(prompt, where)
        length = len(ids)
        if length + params.max_new_tokens > self._max_length:
            raise ConfigError(
                f"{where} has {length} tokens; with max_new_tokens="
                f"{params.max_new_tokens} that is {length + params.max_new_tokens} > the "
                f"model's max_position_embeddings={self._max_length}; shorten the prompt "
                "or lower SamplingParams.max_new_tokens"
            )
        return ids
