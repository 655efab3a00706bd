"""Types shared by every rollout engine (native and vLLM).

A rollout engine turns prompts (lists of token ids) into responses. All engines take
the same :class:`SamplingParams` and return the same :class:`RolloutOutput`, so the
actor role can swap engines without touching the algorithm.

Conventions (the training engine relies on them):

- prompts are left-padded to the batch's longest prompt, responses right-padded to
  ``max_new_tokens``; ``prompt_ids ++ response_ids`` is the training sequence;
- ``logprobs`` are the log-probabilities of the sampled tokens under the model's raw
  distribution (``log_softmax(logits)`` at temperature 1, before top-k/top-p), which
  is what the training engine recomputes; padding positions hold 0.

Besides ``generate``, every engine's ``start`` opens a :class:`GenerationRun`: the
caller steps generation, receives each :class:`FinishedSample` in the step it
completes (streaming), and can move unfinished samples as :class:`PartialSample`
(prompt and tokens so far) from one engine to another (long-tail migration), where
they are prefilled again and continue.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import msgspec
import numpy as np
import torch

from channels import ConfigError


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How to sample responses."""

    max_new_tokens: int = 32
    """Most tokens generated per response (EOS included), and the width responses
    are padded to; a prompt may be given a smaller budget of its own."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1.0 disables it."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 disables it."""
    eos_token_id: int | None = None
    """A response ends after this token (it is kept and masked in), unless
    ``ignore_eos``."""
    ignore_eos: bool = False
    """Keep generating past ``eos_token_id`` (vLLM's meaning): every response runs to
    its token budget (``max_new_tokens``, or the prompt's own budget given to
    ``start``/``generate``), whatever it samples. For benchmarks and tests that need
    responses of known lengths; ``eos_token_id`` still must be a valid id when set."""
    pad_token_id: int = 0
    """Token used to pad prompts (left) and responses (right)."""
    seed: int | None = None
    """Seed for sampling; None draws from the engine's generator. Sample ``i``
    (the caller's index) draws from its own stream derived from ``(seed, i)``, so
    results do not depend on batching; the streams differ between engines."""
    min_new_tokens: int = 0
    """Fewest tokens a response has before EOS or a stop string may end it (vLLM's
    ``min_tokens``): while a response is shorter, ``eos_token_id`` cannot be sampled
    (its logit is masked out of the sampling distribution; ``logprobs`` stay the raw
    ones) and stop strings are not looked for. 0 disables it. A prompt's own token
    budget below it still ends the response at the budget. Ignored for EOS with
    ``ignore_eos`` (EOS ends nothing then). As in vLLM, an engine with a tokenizer
    also masks the tokenizer's EOS id while it masks anything (EOS, or stop strings
    to hold back), whether or not it is ``eos_token_id``."""
    stop: tuple[str, ...] = ()
    """Stop strings (vLLM's ``stop`` with ``include_stop_str_in_output=False``): a
    response ends at the first token whose decoded text completes one of them
    (special tokens skipped when decoding; looked for once the response is longer
    than ``min_new_tokens``, in the text that token adds plus the chars before it).

    Responses are token ids, and token-level training needs exactly the tokens the
    policy sampled: ``response_ids`` end with the token that completed the stop string,
    that token included, masked in, with its log-prob, even when the stop string
    ends in the middle of it (the token's text past the stop string stays part of the
    response). Nothing after that token is generated (where an engine produced more
    tokens in the same step, they are dropped and masked out). So the decoded
    response holds the stop string: cut the text at its first occurrence to get
    vLLM's ``text`` (as a reward function does, for instance). Needs an engine with a
    tokenizer (see each engine)."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ConfigError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"SamplingParams.top_k must be >= 0 (0 disables), got {self.top_k}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ConfigError(
                f"SamplingParams.min_new_tokens must be in 0..max_new_tokens={self.max_new_tokens} "
                f"(0 disables it), got {self.min_new_tokens}"
            )
        if isinstance(self.stop, str) or not isinstance(self.stop, Sequence):
            raise ConfigError(
                f"SamplingParams.stop must be a list of strings, got {self.stop!r}; wrap a "
                "single stop string in a list"
            )
        # Frozen, hashable and the same type whether built in Python or decoded.
        msgspec.structs.force_setattr(self, "stop", tuple(self.stop))
        if any(not isinstance(text, str) or not text for text in self.stop):
            raise ConfigError(
                f"SamplingParams.stop must hold non-empty strings, got {list(self.stop)!r}; "
                "remove the empty ones"
            )

    @property
    def greedy(self) -> bool:
        """Whether sampling reduces to argmax."""
        return self.temperature == 0 or self.top_k == 1


@dataclass(frozen=True, kw_only=True)
class RolloutOutput:
    """A batch of finished responses, as padded tensors (row i answers prompt i).

    An in-process value (tensors never go inside wire Structs)."""

    prompt_ids: torch.Tensor
    """[B, P] int64, left-padded with ``pad_token_id``."""
    prompt_mask: torch.Tensor
    """[B, P] int64, 1 on real prompt tokens."""
    response_ids: torch.Tensor
    """[B, R] int64, right-padded with ``pad_token_id`` (R = max_new_tokens)."""
    response_mask: torch.Tensor
    """[B, R] int64, 1 on generated tokens (EOS included)."""
    logprobs: torch.Tensor
    """[B, R] float32, raw log-probs of the generated tokens, 0 on padding."""

    @property
    def response_lengths(self) -> torch.Tensor:
        """[B] number of generated tokens per row."""
        return self.response_mask.sum(dim=1)

    @classmethod
    def from_samples(
        cls,
        prompts: Sequence[Sequence[int]],
        samples: Sequence[FinishedSample],
        params: SamplingParams,
    ) -> RolloutOutput:
        """Pad prompts (left) and responses (right) into one batch.

        Args:
            prompts: Token ids of each prompt, no padding.
            samples: The response of each prompt, in the same order.
            params: Give the padding id and the response width (``max_new_tokens``).

        Returns:
            The batch, row ``i`` holding ``prompts[i]`` and ``samples[i]``.
        """
        if len(prompts) != len(samples):
            raise ValueError(f"{len(prompts)} prompts but {len(samples)} samples")
        width = max((len(p) for p in prompts), default=0)
        pad, length = params.pad_token_id, params.max_new_tokens
        counts = [len(s.response_ids) for s in samples]
        if max(counts, default=0) > length:
            raise ValueError(f"a response has {max(counts)} tokens, more than max_new_tokens={length}")
        return cls(  # each column padded as lists, then one tensor: no per-row tensor work
            prompt_ids=_rows([[pad] * (width - len(p)) + list(p) for p in prompts], width, torch.long),
            prompt_mask=_rows([[0] * (width - len(p)) + [1] * len(p) for p in prompts], width, torch.long),
            response_ids=_rows([list(s.response_ids) + [pad] * (length - c) for s, c in zip(samples, counts,
                                                                                               strict=True)],
                               length, torch.long),
            response_mask=_rows([[1] * c + [0] * (length - c) for c in counts], length, torch.long),
            logprobs=_rows([list(s.logprobs) + [0.0] * (length - c) for s, c in zip(samples, counts, strict=True)],
                           length, torch.float32),
        )


def _rows(values: list[list[int]] | list[list[float]], width: int, dtype: torch.dtype) -> torch.Tensor:
    """``values`` (rows of ``width`` each) as one ``[rows, width]`` tensor."""
    return torch.tensor(values, dtype=dtype).view(len(values), width)


class FinishedSample(msgspec.Struct, frozen=True, kw_only=True, array_like=True, gc=False):
    """One response, reported by an engine as soon as it completes (for streaming)."""

    index: int
    """The caller's id of the sample: the prompt's row, or the index given to
    ``start`` or carried by an admitted :class:`PartialSample`."""
    response_ids: list[int]
    """Generated tokens (EOS included, no padding); for a migrated sample, the tokens
    it carried followed by the new ones."""
    logprobs: list[float]
    """Raw log-prob of each generated token."""


class PartialSample(msgspec.Struct, frozen=True, kw_only=True, array_like=True, gc=False):
    """An unfinished sample taken out of a :class:`GenerationRun`, to continue elsewhere."""

    index: int
    """The caller's id of the sample, kept through migration."""
    prompt: list[int]
    """Token ids of the prompt, no padding."""
    response_ids: list[int]
    """Tokens generated so far (empty for a sample that never started)."""
    logprobs: list[float]
    """Raw log-prob of each token of ``response_ids``."""
    rng_state: bytes | None = None
    """The sample's sampler state, when the engine that exported it can carry it
    (the native engine's 8-byte row seed of its random stream); None otherwise."""
    max_new_tokens: int | None = None
    """The sample's token budget (response tokens in all, carried ones included);
    None means the admitting run's ``SamplingParams.max_new_tokens``. Engines set it
    on export, so a migrated sample keeps its budget."""


class GenerationRun(Protocol):
    """Generation that the caller steps, as returned by an engine's ``start``.

    A run belongs to its engine and stays valid only until the engine's weights
    change (``update_weights``; on vLLM also ``sleep``): after that, :meth:`step`
    and :meth:`admit` raise, while :meth:`export` still hands out the unfinished
    samples (their tokens so far came from the old weights). Not thread-safe.
    """

    def step(self) -> list[FinishedSample]:
        """Run one scheduling step: admit waiting samples, decode one token each.

        Returns:
            The samples that finished in this step, in completion order (often none).

        Raises:
            RuntimeError: If the run is closed or its engine's weights changed.
        """
        ...

    @property
    def pending(self) -> int:
        """Samples not reported yet (waiting or running); 0 when the run is done."""
        ...

    def export(self) -> list[PartialSample]:
        """Remove every unfinished sample from the run and return its state.

        Samples that never started come back with an empty response. Afterwards
        :attr:`pending` is 0 and the run can still :meth:`admit` samples.
        """
        ...

    def admit(self, samples: Sequence[PartialSample]) -> None:
        """Continue ``samples`` in this run: prompt and response so far are prefilled
        again and generation goes on under the run's :class:`SamplingParams`. Each
        one's :class:`FinishedSample` carries the whole response (carried tokens
        first) and all log-probs.

        A sample's budget is its own ``max_new_tokens`` when set, else the run's.

        Raises:
            ValueError: If a sample is finished already (its budget reached, or EOS
                generated without ``ignore_eos``), its budget is outside
                ``1..params.max_new_tokens``, it is malformed, too long for the
                engine, or its index is pending in this run.
            RuntimeError: If the run is closed or its engine's weights changed.
        """
        ...

    def close(self) -> None:
        """Drop whatever is left (vLLM: abort its requests). Idempotent."""
        ...


def drain(run: GenerationRun) -> Iterator[FinishedSample]:
    """Step ``run`` until it has reported every sample, yielding each as it finishes."""
    while run.pending:
        yield from run.step()


def run_to_output(run: GenerationRun, prompts: Sequence[Sequence[int]], params: SamplingParams) -> RolloutOutput:
    """Step ``run`` (started on ``prompts`` with the default indices) to its end and
    pad its samples, row ``i`` answering ``prompts[i]``; the run is closed after."""
    try:
        samples = {sample.index: sample for sample in drain(run)}
    finally:
        run.close()
    prompt_lists = [list(prompt) for prompt in prompts]
    return RolloutOutput.from_samples(prompt_lists, [samples[i] for i in range(len(prompt_lists))], params)


def resolve_indices(indices: Sequence[int] | None, count: int) -> list[int]:
    """The caller's ids of ``count`` prompts: ``indices`` checked, or 0..count-1.

    Raises:
        ValueError: If ``indices`` has another length or repeats an id.
    """
    if indices is None:
        return list(range(count))
    resolved = [int(index) for index in indices]
    if len(resolved) != count:
        raise ConfigError(
            f"start got {count} prompts but {len(resolved)} indices; give one index per prompt"
        )
    if len(set(resolved)) != count:
        raise ConfigError("start got repeated indices; each sample needs its own index")
    return resolved


def resolve_budgets(
    max_new_tokens: Sequence[int] | None, count: int, params: SamplingParams
) -> list[int]:
    """The token budget of each of ``count`` prompts: ``max_new_tokens`` checked, or
    ``params.max_new_tokens`` for all.

    Raises:
        ValueError: If ``max_new_tokens`` has another length than the prompts, or a
            budget is not an int in ``1..params.max_new_tokens`` (naming the prompt).
    """
    if max_new_tokens is None:
        return [params.max_new_tokens] * count
    budgets = list(max_new_tokens)
    if len(budgets) != count:
        raise ConfigError(
            f"got {count} prompts but {len(budgets)} max_new_tokens; give one budget per prompt"
        )
    for i, budget in enumerate(budgets):
        check_budget(budget, params, f"max_new_tokens[{i}] (prompt {i})")
    return [int(budget) for budget in budgets]


def check_budget(budget: object, params: SamplingParams, where: str) -> None:
    """Refuse a token budget that is not an int in ``1..params.max_new_tokens``."""
    if (
        isinstance(budget, bool)
        or not isinstance(budget, int | np.integer)
        or not 1 <= int(budget) <= params.max_new_tokens
    ):
        raise ConfigError(
            f"{where} is {budget!r}; a budget must be an int in 1..{params.max_new_tokens} "
            "(SamplingParams.max_new_tokens, the response width): lower the budget or "
            "raise SamplingParams.max_new_tokens"
        )


def budget_of(sample: PartialSample, params: SamplingParams) -> int:
    """``sample``'s token budget in a run sampling with ``params``."""
    return params.max_new_tokens if sample.max_new_tokens is None else sample.max_new_tokens


def ends_response(token: int, length: int, budget: int, params: SamplingParams) -> bool:
    """Whether a response of ``length`` tokens whose last is ``token`` is finished."""
    return length >= budget or (not params.ignore_eos and token == params.eos_token_id)


def check_admissible(
    samples: Sequence[PartialSample], params: SamplingParams, pending: Iterable[int]
) -> None:
    """Refuse samples that cannot continue under ``params`` in a run.

    Args:
        samples: The samples to admit.
        params: The run's sampling parameters.
        pending: The indices the run still holds.

    Raises:
        ValueError: Naming the sample and why (finished, malformed, budget outside
            ``1..params.max_new_tokens``, index taken).
    """
    taken = set(pending)
    for sample in samples:
        where = f"PartialSample index={sample.index}"
        response = sample.response_ids
        if sample.index in taken:
            raise ConfigError(f"{where} is already pending in this run; indices must be unique")
        taken.add(sample.index)
        if not sample.prompt:
            raise ConfigError(f"{where} has an empty prompt; every prompt needs >= 1 token")
        if len(sample.logprobs) != len(response):
            raise ConfigError(
                f"{where} has {len(response)} response tokens but {len(sample.logprobs)} "
                "log-probs; give one log-prob per token"
            )
        if sample.max_new_tokens is not None:
            check_budget(sample.max_new_tokens, params, f"{where} max_new_tokens")
        budget = budget_of(sample, params)
        if len(response) >= budget:
            raise ConfigError(
                f"{where} is finished: it has {len(response)} tokens and its budget "
                f"(max_new_tokens) is {budget}; report it instead of admitting it"
            )
        eos = params.eos_token_id
        if not params.ignore_eos and eos is not None and eos in response:
            raise ConfigError(
                f"{where} is finished: its response holds eos_token_id={params.eos_token_id}; "
                "report it instead of admitting it"
            )
