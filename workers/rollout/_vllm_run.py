"""Stepped generation on a vLLM engine: :class:`GenerationRun` and the request router.

A run's samples are requests of vLLM's ``LLMEngine`` (the V1 engine behind
``vllm.LLM``, ``llm.llm_engine``), driven here instead of by ``LLM.generate``:

- ``add_request(request_id, TokensPrompt(...), SamplingParams(...))`` queues a sample,
  with ``output_kind=RequestOutputKind.DELTA`` so that every step reports each
  running request's new tokens and their log-probs, which the run appends to the
  sample's tokens so far (what ``export`` hands out);
- ``step()`` runs one scheduler step (admit waiting requests, prefill, decode one
  token) and returns those deltas, tagged with the request id given to
  ``add_request`` (vLLM adds a random suffix for its internal id, but outputs and
  aborts use the given one); a finished request's output has ``finished`` set;
- ``abort_request([request_id, ...])`` drops requests (``export``, ``close``, weight
  updates); an aborted request reports nothing more.

Several runs may share one engine: a step of one run steps every request, so the
:class:`RequestRouter` delivers each output to the run that owns its request, and a
run reports samples finished during another run's step at its own next step.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._types import FinishedSample, PartialSample, SamplingParams, budget_of, check_admissible

__all__ = ["RequestRouter", "Tracked", "VLLMRun"]

_UINT64 = 0xFFFF_FFFF_FFFF_FFFF


@dataclass(kw_only=True, eq=False)
class Tracked:
    """A sample as vLLM generates it: the tokens so far, on this side."""

    index: int
    prompt: list[int]
    response: list[int]
    logprobs: list[float]
    budget: int
    """Most response tokens (carried ones included)."""

    def partial(self) -> PartialSample:
        return PartialSample(
            index=self.index,
            prompt=self.prompt,
            response_ids=self.response,
            logprobs=self.logprobs,
            max_new_tokens=self.budget,
        )


class RequestRouter:
    """Owns the requests that runs put into one vLLM ``LLMEngine``.

    Before its weights change or it sleeps, the engine calls :meth:`invalidate`
    (the runs' requests are aborted and the runs refuse to step from then on); when
    it shuts down, :meth:`detach`.

    Args:
        llm_engine: ``vllm.LLM(...).llm_engine``.
        check_prompt: Called with ``(prompt, budget, where)`` for every admitted
            sample; raises if the prompt does not fit the engine with ``budget``
            new tokens.
    """

    def __init__(
        self,
        llm_engine: Any,
        *,
        check_prompt: Callable[[Sequence[int], int, str], None],
    ) -> None:
        self._llm_engine = llm_engine
        self.check_prompt = check_prompt
        self.version = 0
        """Bumped whenever the runs opened so far stop being valid."""
        self._owners: dict[str, VLLMRun] = {}
        """The run of every request vLLM is generating, by request id."""
        self._request_ids = itertools.count()

    def start(self, params: SamplingParams, samples: list[Tracked]) -> VLLMRun:
        """A run of ``samples`` (checked by the caller), their requests queued."""
        run = VLLMRun(self, params)
        self.add(run, samples)
        return run

    def add(self, run: VLLMRun, samples: list[Tracked]) -> None:
        """Queue one request per sample (prompt + response so far) for ``run``."""
        from vllm.inputs import TokensPrompt

        added = []
        try:
            for tracked in samples:
                request_id = str(next(self._request_ids))
                prompt = TokensPrompt(prompt_token_ids=tracked.prompt + tracked.response)
                self._llm_engine.add_request(request_id, prompt, _vllm_params(run.params, tracked))
                added.append(request_id)
                self._owners[request_id] = run
                run._live[request_id] = tracked
        except BaseException:
            for request_id in added:
                del run._live[request_id]
            self.abort(added)
            raise

    def step(self) -> None:
        """One vLLM step; each request's new tokens go to the run that owns it."""
        for output in self._llm_engine.step():
            run = self._owners.get(output.request_id)
            if run is None:  # not one of ours, or aborted after vLLM scheduled it
                continue
            if output.finished:
                del self._owners[output.request_id]
            run._receive(output.request_id, output.outputs[0], output.finished)

    def abort(self, request_ids: list[str]) -> None:
        """Abort the requests among ``request_ids`` that vLLM still generates."""
        live = [rid for rid in request_ids if self._owners.pop(rid, None) is not None]
        if live:
            self._llm_engine.abort_request(live)

    @property
    def closed(self) -> bool:
        """Whether the engine shut down."""
        return self._llm_engine is None

    def invalidate(self) -> None:
        """Abort every request; the runs opened so far refuse to step from now on."""
        self.version += 1
        self.abort(list(self._owners))

    def detach(self) -> None:
        """Forget the engine (it is shutting down); the runs refuse to step."""
        self.version += 1
        self._owners.clear()
        self._llm_engine = None


class VLLMRun:
    """The :class:`~workers.rollout._types.GenerationRun` of a vLLM rollout engine.

    Each sample is one vLLM request; a step is one ``LLMEngine.step()`` (vLLM's
    scheduler admits waiting requests, prefills and decodes).
    """

    def __init__(self, router: RequestRouter, params: SamplingParams) -> None:
        self.params = params
        self._router = router
        self._version = router.version
        self._live: dict[str, Tracked] = {}
        """The run's unfinished requests, by request id."""
        self._done: list[FinishedSample] = []
        """Finished samples not returned by step yet (another run's step may finish them)."""
        self._closed = False

    @property
    def pending(self) -> int:
        """Samples not reported yet: waiting, running, or finished while another run
        on the same engine stepped (the next :meth:`step` returns those)."""
        return len(self._live) + len(self._done)

    def step(self) -> list[FinishedSample]:
        """One engine step (when this run has requests); the samples finished since the
        last step, in completion order."""
        self._check_usable("step")
        if self._live:
            self._router.step()
        done, self._done = self._done, []
        return done

    def export(self) -> list[PartialSample]:
        """Abort every unfinished request and return its sample's tokens so far."""
        exported = [tracked.partial() for tracked in self._live.values()]
        self._router.abort(list(self._live))
        self._live.clear()
        return exported

    def admit(self, samples: Sequence[PartialSample]) -> None:
        """Continue ``samples`` as new requests of prompt + response so far.

        ``max_tokens`` is what is left of the sample's budget (its own
        ``max_new_tokens``, else the run's). vLLM cannot resume a
        request's random stream, so a migrated sampled sample is re-seeded (from the
        run's seed, its index and its length; ``rng_state`` is ignored): it continues
        differently than it would have uninterrupted. Greedy samples are identical.
        ``min_new_tokens`` counts the carried tokens; stop strings are looked for in
        the new tokens' text only (vLLM sees the carried ones as prompt), so one that
        straddles the carried and new tokens is missed, where the native engine
        finds it.
        """
        self._check_usable("admit")
        check_admissible(samples, self.params, (t.index for t in self._live.values()))
        budgets = [budget_of(sample, self.params) for sample in samples]
        for sample, budget in zip(samples, budgets, strict=True):
            self._router.check_prompt(sample.prompt, budget, f"PartialSample index={sample.index}")
        tracked = [
            Tracked(
                index=sample.index,
                prompt=list(sample.prompt),
                response=list(sample.response_ids),
                logprobs=list(sample.logprobs),
                budget=budget,
            )
            for sample, budget in zip(samples, budgets, strict=True)
        ]
        self._router.add(self, tracked)

    def close(self) -> None:
        """Abort the run's requests and drop its unreported samples. Idempotent."""
        if not self._closed:
            self.export()
            self._done.clear()
            self._closed = True

    def _receive(self, request_id: str, completion: Any, finished: bool) -> None:
        """Record a request's new tokens (``completion``: vLLM's delta CompletionOutput)."""
        tracked = self._live[request_id]
        tokens = list(completion.token_ids)
        tracked.response.extend(tokens)
        # logprobs=0 asks for the sampled token's log-prob alone: one entry per position.
        tracked.logprobs.extend(
            position[token].logprob
            for position, token in zip(completion.logprobs, tokens, strict=True)
        )
        if finished:
            del self._live[request_id]
            self._done.append(
                FinishedSample(
                    index=tracked.index, response_ids=tracked.response, logprobs=tracked.logprobs
                )
            )

    def _check_usable(self, action: str) -> None:
        if self._closed:
            raise RuntimeError(f"cannot {action}: this run is closed; start a new one")
        if self._router.closed:
            raise RuntimeError(f"cannot {action}: the engine is closed; create a new engine")
        if self._version != self._router.version:
            raise RuntimeError(
                f"cannot {action}: the engine's weights changed (update_weights or sleep) since "
                "this run started; export() its unfinished samples and admit them into a new run"
            )


def _vllm_params(params: SamplingParams, sample: Tracked) -> Any:
    """vLLM's sampling parameters for ``sample``'s request."""
    from vllm import SamplingParams as VLLMSamplingParams
    from vllm.sampling_params import RequestOutputKind

    greedy = params.greedy
    stop = None if params.ignore_eos else params.eos_token_id
    carried = len(sample.response)
    max_tokens = sample.budget - carried
    # min_tokens masks the stop token ids (ours: eos) and delays stop strings. With
    # ignore_eos and no stop strings it has nothing to do here, and passing it would
    # let vLLM mask the tokenizer's EOS id, which the native engine does not.
    min_tokens = 0
    if params.stop or stop is not None:
        # Carried tokens count; a budget below min_new_tokens wins (vLLM refuses
        # min_tokens > max_tokens).
        min_tokens = min(max(params.min_new_tokens - carried, 0), max_tokens)
    return VLLMSamplingParams(
        n=1,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        temperature=0.0 if greedy else params.temperature,
        top_p=1.0 if greedy else params.top_p,
        top_k=0 if greedy else params.top_k,
        seed=_request_seed(params.seed, sample.index, carried),
        logprobs=0,  # only the sampled token's log-prob
        # EOS handling is ours: stop on params.eos_token_id only (kept in the output),
        # and not at all with params.ignore_eos.
        ignore_eos=True,
        stop_token_ids=None if stop is None else [stop],
        # Stop strings are matched in vLLM's detokenizer, so only requests with stop
        # strings are decoded; the text is cut before the stop string, the token ids
        # keep the token that completed it (see SamplingParams.stop).
        stop=list(params.stop) or None,
        include_stop_str_in_output=False,
        detokenize=bool(params.stop),
        # Every step reports the tokens new since the last one.
        output_kind=RequestOutputKind.DELTA,
    )


def _request_seed(seed: int | None, index: int, carried: int) -> int | None:
    """The vLLM seed of sample ``index`` that already holds ``carried`` tokens.

    ``seed + index`` for a sample that starts (as ``generate`` always seeded its
    rows); a migrated sample gets a seed mixed from all three, so that it does not
    replay the draws of its first tokens.
    """
    if seed is None:
        return None
    if not carried:
        return seed + index
    entropy = [seed & _UINT64, index & _UINT64, carried]
    return int(np.random.SeedSequence(entropy).generate_state(1, np.uint32)[0])
