"""Native rollout engine: continuous-batching generation on a transformers causal LM.

The engine keeps one decode batch of at most ``max_batch_size`` rows. Every step it
first admits waiting prompts into the free rows (their prefill runs as a separate
left-padded forward pass, then their KV cache joins the decode batch), then decodes
one token for every row. A row leaves the batch as soon as it samples EOS or reaches
``max_new_tokens``, and its :class:`FinishedSample` is yielded at once, so streaming
consumers see each sample when it completes, not when its batch does.

Rows stay right-aligned: each row's KV cache is ``[padding..., real tokens...]``, with
an attention mask of zeros on the padding and positions counted over real tokens
only (``cumsum(mask) - 1``). That is the convention of :mod:`._types`, so the
training engine's forward pass over ``prompt_ids ++ response_ids`` reproduces the
log-probs reported here.

Sampling is reproducible per sample: row ``i`` draws from its own generator, seeded
from ``(SamplingParams.seed, i)``, so results do not depend on ``max_batch_size``
nor on which rows happen to share a step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from channels import ConfigError

from ._types import FinishedSample, RolloutOutput, SamplingParams

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


@dataclass(kw_only=True)
class _Request:
    """One ``generate`` call: its prompts, parameters and the samples so far."""

    prompts: list[list[int]]
    params: SamplingParams
    seed: int
    device: torch.device
    responses: dict[int, list[int]] = field(default_factory=dict)
    logprobs: dict[int, list[float]] = field(default_factory=dict)
    generators: dict[int, torch.Generator] = field(default_factory=dict)

    def start(self, index: int) -> None:
        """Open the response of prompt ``index`` (and its generator when sampling)."""
        self.responses[index] = []
        self.logprobs[index] = []
        if not self.params.greedy:
            entropy = [self.seed & 0xFFFF_FFFF_FFFF_FFFF, index]
            row_seed = int(np.random.SeedSequence(entropy).generate_state(1, np.uint64)[0])
            generator = torch.Generator(device=self.device)
            self.generators[index] = generator.manual_seed(row_seed)

    def finish(self, index: int) -> FinishedSample:
        """Close the response of prompt ``index`` and report it."""
        self.generators.pop(index, None)
        return FinishedSample(
            index=index,
            response_ids=self.responses.pop(index),
            logprobs=self.logprobs.pop(index),
        )


@dataclass(kw_only=True)
class _Batch:
    """Rows decoding together: their KV cache, attention mask and next inputs.

    Invariant: every row is right-aligned (its mask is zeros then ones), and the
    cache, ``mask`` and the row tensors all hold ``len(indices)`` rows."""

    indices: list[int]
    cache: DynamicCache
    mask: torch.Tensor
    """[B, L] int64 over the cached tokens."""
    next_positions: torch.Tensor
    """[B] position of the token fed at the next step."""
    next_tokens: torch.Tensor
    """[B] the token fed at the next step (the last one sampled)."""

    def __len__(self) -> int:
        return len(self.indices)

    def keep(self, rows: list[int]) -> None:
        """Keep only ``rows`` (positions in this batch), dropping padding nobody needs."""
        if len(rows) == len(self.indices):
            return
        select = torch.tensor(rows, dtype=torch.long, device=self.mask.device)
        self.indices = [self.indices[row] for row in rows]
        mask = self.mask.index_select(0, select)
        # Rows are right-aligned, so the longest row says how many columns are needed.
        start = mask.shape[1] - int(mask.sum(dim=1).max()) if rows else mask.shape[1]
        self.mask = mask[:, start:]
        self.next_positions = self.next_positions.index_select(0, select)
        self.next_tokens = self.next_tokens.index_select(0, select)
        for layer, keys, values in _kv_tensors(self.cache):
            layer.keys = keys.index_select(0, select)[:, :, start:]
            layer.values = values.index_select(0, select)[:, :, start:]

    def extend(self, other: _Batch) -> None:
        """Append the rows of ``other``, left-padding whichever cache is shorter."""
        length = max(self.mask.shape[1], other.mask.shape[1])
        self.mask = torch.cat([_left_pad(self.mask, length), _left_pad(other.mask, length)])
        self.indices = self.indices + other.indices
        self.next_positions = torch.cat([self.next_positions, other.next_positions])
        self.next_tokens = torch.cat([self.next_tokens, other.next_tokens])
        for (layer, keys, values), (_, more_keys, more_values) in zip(
            _kv_tensors(self.cache), _kv_tensors(other.cache), strict=True
        ):
            layer.keys = torch.cat([_left_pad(keys, length), _left_pad(more_keys, length)])
            layer.values = torch.cat([_left_pad(values, length), _left_pad(more_values, length)])


class NativeRolloutEngine:
    """Generates responses with a transformers causal LM, a KV cache and continuous batching.

    Not thread-safe: use one engine from one thread, and do not call
    :meth:`update_weights` while a :meth:`generate_stream` iterator is open (rows
    already in flight would mix old and new weights).

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
        prompt_lists = self._validate(prompts, params)
        samples = {sample.index: sample for sample in self._stream(prompt_lists, params)}
        return _assemble(prompt_lists, [samples[i] for i in range(len(prompt_lists))], params)

    def generate_stream(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> Iterator[FinishedSample]:
        """Generate one response per prompt, yielding each as soon as it completes.

        Prompts are validated before this returns; generation advances as the
        iterator is consumed (one decode step of the whole batch per pull at most).

        Args:
            prompts: Token ids of each prompt (no padding).
            params: How to sample.

        Returns:
            An iterator over the finished samples in completion order; each prompt's
            index appears exactly once.

        Raises:
            ValueError: As :meth:`generate`.
        """
        return self._stream(self._validate(prompts, params), params)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy new weights into the model in place.

        Tensors are copied as they arrive; when one fails, those before it are loaded.

        Args:
            named_tensors: ``(name, tensor)`` pairs named as in ``model.state_dict()``;
                any subset of the parameters may be given.

        Returns:
            The number of tensors loaded.

        Raises:
            ValueError: If a name is not one of the model's or a shape differs.
        """
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

    def _validate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[list[int]]:
        for name in ("pad_token_id", "eos_token_id"):
            token = getattr(params, name)
            if token is not None and not 0 <= token < self._vocab_size:
                raise ConfigError(
                    f"SamplingParams.{name}={token} is outside the model's vocabulary "
                    f"[0, {self._vocab_size})"
                )
        checked = []
        for index, prompt in enumerate(prompts):
            ids = [int(token) for token in prompt]
            if not ids:
                raise ConfigError(f"prompts[{index}] is empty; every prompt needs >= 1 token")
            bad = next((t for t in ids if not 0 <= t < self._vocab_size), None)
            if bad is not None:
                raise ConfigError(
                    f"prompts[{index}] holds token id {bad}, outside the model's vocabulary "
                    f"[0, {self._vocab_size})"
                )
            if len(ids) + params.max_new_tokens > self._max_length:
                raise ConfigError(
                    f"prompts[{index}] has {len(ids)} tokens; with max_new_tokens="
                    f"{params.max_new_tokens} that is {len(ids) + params.max_new_tokens} > the "
                    f"model's max_position_embeddings={self._max_length}; shorten the prompt "
                    "or lower SamplingParams.max_new_tokens"
                )
            checked.append(ids)
        return checked

    def _stream(self, prompts: list[list[int]], params: SamplingParams) -> Iterator[FinishedSample]:
        # Grad mode is switched off inside each model call only, never across a yield:
        # a generator's `with torch.no_grad()` would leak into the consumer's code.
        seed = params.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (), generator=self._generator))
        request = _Request(prompts=prompts, params=params, seed=seed, device=self._device)
        waiting = deque(range(len(prompts)))
        running: _Batch | None = None
        while waiting or running is not None:
            free = self._config.max_batch_size - (len(running) if running is not None else 0)
            if waiting and free > 0:
                joining = [waiting.popleft() for _ in range(min(free, len(waiting)))]
                fresh, logits = self._prefill(joining, request)
                yield from self._advance(fresh, logits, request)
                if running is None:
                    running = fresh
                elif len(fresh):
                    running.extend(fresh)
            if running is not None and len(running):
                yield from self._advance(running, self._decode(running), request)
            if running is not None and not len(running):
                running = None

    @torch.no_grad()
    def _prefill(self, indices: list[int], request: _Request) -> tuple[_Batch, torch.Tensor]:
        """Run the prompts of ``indices`` through the model as one left-padded batch."""
        prompts = [request.prompts[i] for i in indices]
        length = max(len(prompt) for prompt in prompts)
        ids = torch.full((len(prompts), length), request.params.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), length), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, length - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            mask[row, length - len(prompt) :] = 1
        ids, mask = ids.to(self._device), mask.to(self._device)
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        output = self._model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=DynamicCache(config=self._model.config),
            use_cache=True,
            logits_to_keep=1,
        )
        for index in indices:
            request.start(index)
        batch = _Batch(
            indices=list(indices),
            cache=output.past_key_values,
            mask=mask,
            next_positions=mask.sum(dim=1),
            next_tokens=torch.zeros(len(indices), dtype=torch.long, device=self._device),
        )
        return batch, output.logits[:, -1, :].float()

    @torch.no_grad()
    def _decode(self, batch: _Batch) -> torch.Tensor:
        """Feed every row its last sampled token; return the next-token logits [B, V]."""
        ones = torch.ones((len(batch), 1), dtype=batch.mask.dtype, device=batch.mask.device)
        batch.mask = torch.cat([batch.mask, ones], dim=1)
        output = self._model(
            input_ids=batch.next_tokens[:, None],
            attention_mask=batch.mask,
            position_ids=batch.next_positions[:, None],
            past_key_values=batch.cache,
            use_cache=True,
        )
        batch.next_positions = batch.next_positions + 1
        return output.logits[:, -1, :].float()

    def _advance(
        self, batch: _Batch, logits: torch.Tensor, request: _Request
    ) -> list[FinishedSample]:
        """Sample one token per row, record it, and drop the rows that finished."""
        params = request.params
        generators = [request.generators.get(index) for index in batch.indices]
        tokens, logprobs = _sample(logits, params, generators)
        batch.next_tokens = tokens
        finished, keep = [], []
        for row, (index, token, logprob) in enumerate(
            zip(batch.indices, tokens.tolist(), logprobs.tolist(), strict=True)
        ):
            response = request.responses[index]
            response.append(token)
            request.logprobs[index].append(logprob)
            if token == params.eos_token_id or len(response) >= params.max_new_tokens:
                finished.append(request.finish(index))
            else:
                keep.append(row)
        batch.keep(keep)
        return finished


@torch.no_grad()
def _sample(
    logits: torch.Tensor, params: SamplingParams, generators: list[torch.Generator | None]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row; return it and its raw log-prob (temperature 1, unfiltered)."""
    raw_logprobs = F.log_softmax(logits, dim=-1)
    if params.greedy:
        tokens = logits.argmax(dim=-1)
    else:
        probs = _filtered_probs(logits, params)
        picks = []
        for row, generator in enumerate(generators):
            picks.append(torch.multinomial(probs[row], 1, generator=generator))
        tokens = torch.cat(picks)
    return tokens, raw_logprobs.gather(-1, tokens[:, None]).squeeze(-1)


def _filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Sampling distribution after temperature, then top-k, then top-p."""
    scores = logits / params.temperature
    if 0 < params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Drop a token once the more likely ones already reach top_p; the first stays.
        drop_sorted = sorted_probs.cumsum(dim=-1) - sorted_probs >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _kv_tensors(cache: DynamicCache) -> list[tuple[DynamicLayer, torch.Tensor, torch.Tensor]]:
    """Each layer of a full-attention cache with its keys and values ``[B, H, L, D]``."""
    entries = []
    for layer in cache.layers:
        # The constructor rejects non-full-attention models, so every layer is dynamic.
        assert isinstance(layer, DynamicLayer), type(layer)
        assert layer.keys is not None and layer.values is not None
        entries.append((layer, layer.keys, layer.values))
    return entries


def _left_pad(tensor: torch.Tensor, length: int) -> torch.Tensor:
    """Zero-pad the sequence dimension (last for masks, -2 for caches) on the left."""
    dim = 1 if tensor.dim() == 2 else 2
    missing = length - tensor.shape[dim]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


def _assemble(
    prompts: list[list[int]], samples: list[FinishedSample], params: SamplingParams
) -> RolloutOutput:
    """Pad prompts (left) and responses (right) into the tensors of a RolloutOutput."""
    rows, width = len(prompts), max((len(p) for p in prompts), default=0)
    pad = params.pad_token_id
    prompt_ids = torch.full((rows, width), pad, dtype=torch.long)
    prompt_mask = torch.zeros((rows, width), dtype=torch.long)
    response_ids = torch.full((rows, params.max_new_tokens), pad, dtype=torch.long)
    response_mask = torch.zeros((rows, params.max_new_tokens), dtype=torch.long)
    logprobs = torch.zeros((rows, params.max_new_tokens), dtype=torch.float32)
    for row, (prompt, sample) in enumerate(zip(prompts, samples, strict=True)):
        if prompt:
            prompt_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            prompt_mask[row, width - len(prompt) :] = 1
        count = len(sample.response_ids)
        response_ids[row, :count] = torch.tensor(sample.response_ids, dtype=torch.long)
        response_mask[row, :count] = 1
        logprobs[row, :count] = torch.tensor(sample.logprobs, dtype=torch.float32)
    return RolloutOutput(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        logprobs=logprobs,
    )
