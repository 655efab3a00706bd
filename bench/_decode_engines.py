"""The native engine's decode paths against transformers' ``generate``, for
``python -m bench.generation --device cuda`` (see :mod:`bench.generation`): the
engines, their timed calls and the table; and the models and prompts both of
``bench.generation``'s comparisons use."""

from __future__ import annotations

import copy
import dataclasses
import gc
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import transformers
from transformers import PreTrainedModel

from bench._shapes import SHAPES
from workers.models import TinyModelConfig, build_tiny_model
from workers.rollout import NativeRolloutConfig, NativeRolloutEngine, RolloutOutput, SamplingParams

__all__ = ["DTYPES", "ENGINES", "MODELS", "NATIVE_ENGINES", "check_full", "engines_table", "profile_table",
           "random_prompts", "run_engines"]

MODELS = {
    "small": TinyModelConfig(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                             num_key_value_heads=8, head_dim=64, vocab_size=32000),
    "qwen2.5-0.5b": SHAPES["qwen2.5-0.5b"],
    "tiny": TinyModelConfig(),
}
"""The models ``--model`` chooses from (see :mod:`bench.generation`)."""

NATIVE_ENGINES: dict[str, dict[str, Any]] = {
    "native_graph": {"decode": "static", "cuda_graphs": True},
    "native_graph_uncompiled": {"decode": "static", "cuda_graphs": True, "compile": False},
    "native_static_eager": {"decode": "static", "cuda_graphs": False},
    "native_eager": {"decode": "dynamic"},
}
"""The ``NativeRolloutConfig`` settings of each native engine."""

ENGINES = (*NATIVE_ENGINES, "hf_generate")
"""The engines ``--engines`` chooses from (see :mod:`bench.generation`)."""

DTYPES = ("bfloat16", "float32")
"""The precisions ``--dtypes`` chooses from."""

_GIB = 2**30


def random_prompts(batch: int, *, vocab: int, seed: int, length: int | None = None) -> list[list[int]]:
    """``batch`` prompts of ``length`` tokens (None: 8 to 16), starting with ``<bos>`` (id 1)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [length] * batch if length else torch.randint(8, 17, (batch,), generator=gen).tolist()
    return [[1, *torch.randint(3, vocab, (n - 1,), generator=gen).tolist()] for n in lengths]


def _synced_seconds(fn: Callable[[], object], device: torch.device) -> float:
    """Wall-clock seconds of ``fn()``, including the GPU work it queued."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def check_full(out: RolloutOutput, new_tokens: int) -> None:
    if not bool((out.response_lengths == new_tokens).all()):
        raise RuntimeError(f"every row should generate {new_tokens} tokens with EOS ignored")


def _engine_call(engine: str, lm: PreTrainedModel, prompts: list[list[int]], *, new_tokens: int) -> Callable[[], None]:
    """One generate call of ``engine`` on ``prompts``, raising unless every row
    generated ``new_tokens`` tokens (a comparison of ``len(prompts)`` numbers)."""
    if engine in NATIVE_ENGINES:
        config = NativeRolloutConfig(max_batch_size=len(prompts), **NATIVE_ENGINES[engine])
        native = NativeRolloutEngine(lm, config=config)
        params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, eos_token_id=None, seed=0)
        return lambda: check_full(native.generate(prompts, params), new_tokens)
    input_ids = torch.tensor(prompts, device=next(lm.parameters()).device)  # of one length: no padding
    tokens = lm.generation_config
    # min_new_tokens masks EOS until the last token, so every row runs to the end.
    sampling = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "max_new_tokens": new_tokens,
                "min_new_tokens": new_tokens, "pad_token_id": tokens.pad_token_id, "eos_token_id": tokens.eos_token_id}

    def generate() -> None:
        torch.manual_seed(0)
        out = lm.generate(input_ids, attention_mask=torch.ones_like(input_ids), **sampling)  # type: ignore[operator]
        if out.shape[1] != input_ids.shape[1] + new_tokens:
            raise RuntimeError(f"every row should generate {new_tokens} tokens, got {out.shape[1] - input_ids.shape[1]}")

    return generate


def _kernel_profile(call: Callable[[], None], device: torch.device, *, new_tokens: int, top: int) -> dict[str, Any]:
    """Where one call's time goes: ``torch.profiler`` over ``call()``, each kernel's
    (on the CPU: each operator's) own time and calls per decode step (the prefill
    spread over the steps, as ``ms_per_step``), the ``top`` largest and the total."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        call()
        if cuda:
            torch.cuda.synchronize(device)

    def own_us(event: Any) -> float:
        return float(event.self_device_time_total if cuda else event.self_cpu_time_total)

    events = sorted((e for e in prof.key_averages() if own_us(e) > 0), key=own_us, reverse=True)
    return {
        "total_ms_per_step": sum(own_us(e) for e in events) / 1e3 / new_tokens,
        "top": [{"name": e.key, "ms_per_step": own_us(e) / 1e3 / new_tokens, "calls_per_step": e.count / new_tokens}
                for e in events[:top]],
    }


def _time_engines(
    lm: PreTrainedModel, prompts: list[list[int]], *, engines: Sequence[str], new_tokens: int, runs: int,
    profile: int = 0,
) -> list[dict[str, Any]]:
    """Warm each engine up, then time ``runs`` rounds of one call per engine; with
    ``profile``, one more call per engine under the profiler (its ``profile``)."""
    device = next(lm.parameters()).device
    cuda = device.type == "cuda"
    calls = {engine: _engine_call(engine, lm, prompts, new_tokens=new_tokens) for engine in engines}
    warmups = {}
    for engine, call in calls.items():
        before = torch.cuda.memory_allocated(device) / _GIB if cuda else None
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        warmup_s = _synced_seconds(call, device)
        peak = torch.cuda.max_memory_allocated(device) / _GIB if cuda else None
        warmups[engine] = {"warmup_s": warmup_s, "peak_memory_gib": peak, "memory_before_gib": before}
    seconds: dict[str, list[float]] = {engine: [] for engine in calls}
    for _ in range(runs):
        for engine, call in calls.items():
            seconds[engine].append(_synced_seconds(call, device))
    profiles = {engine: _kernel_profile(call, device, new_tokens=new_tokens, top=profile)
                for engine, call in calls.items()} if profile else {}
    del calls, call  # the engines, with their KV caches and graphs
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    hf_s = statistics.median(seconds["hf_generate"]) if "hf_generate" in seconds else None
    return [
        {
            "engine": engine,
            "tokens_per_s": len(prompts) * new_tokens / statistics.median(runs_s),
            "ms_per_step": statistics.median(runs_s) / new_tokens * 1e3,
            "over_hf_generate": None if hf_s is None else hf_s / statistics.median(runs_s),
            "seconds_runs": runs_s,
            **warmups[engine],
            **({"profile": profiles[engine]} if engine in profiles else {}),
        }
        for engine, runs_s in seconds.items()
    ]


def run_engines(
    *,
    device: torch.device,
    model: str,
    batches: Sequence[int],
    dtypes: Sequence[str],
    engines: Sequence[str] = ENGINES,
    prompt_len: int,
    new_tokens: int,
    runs: int,
    profile: int = 0,
) -> dict[str, Any]:
    """Time the engines of :data:`ENGINES` for every batch size and precision.

    Args:
        device: Where the model runs (``cuda``, or ``cpu`` for a check).
        model: A key of :data:`MODELS`.
        batches: Prompts per call, one measurement each.
        dtypes: ``"bfloat16"`` and/or ``"float32"``, one measurement each.
        engines: Which engines, in the order they alternate.
        prompt_len: Tokens per prompt.
        new_tokens: Tokens generated per prompt.
        runs: Timed rounds (the median is reported).
        profile: With N > 0, one more call per engine under ``torch.profiler``:
            its N largest kernels (on the CPU: operators) by own time per decode step.

    Returns:
        The setup (``gpu``, ``torch``, ``transformers``, ``model``, ``parameters``,
        ``prompt_len``, ``new_tokens``, ``runs``) and ``results``: one record per
        precision, batch size and engine.

    Raises:
        ValueError: For an unknown model, engine or precision, or sizes below 1.
    """
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; choose one of {sorted(MODELS)}")
    for name, given, known in (("engines", engines, ENGINES), ("dtypes", dtypes, DTYPES)):
        if not given or set(given) - set(known):
            raise ValueError(f"--{name} must name some of {', '.join(known)}; got {', '.join(given) or 'none'}")
    if min(*batches, prompt_len, new_tokens, runs) < 1:
        raise ValueError("--batches, --prompt-len, --new-tokens and --runs must be >= 1")
    shape = MODELS[model]
    shape = dataclasses.replace(shape, max_position_embeddings=max(shape.max_position_embeddings, prompt_len + new_tokens))
    base = build_tiny_model(shape, seed=0)
    results = []
    for dtype in dtypes:
        lm = copy.deepcopy(base)  # a copy in each precision: Module.to converts in place
        lm.to(device, getattr(torch, dtype))  # type: ignore[arg-type]  # (transformers' @wraps hides self)
        for batch in batches:
            prompts = random_prompts(batch, vocab=shape.resolved_vocab_size, seed=0, length=prompt_len)
            for record in _time_engines(lm, prompts, engines=engines, new_tokens=new_tokens, runs=runs,
                                        profile=profile):
                results.append({"device": str(device), "dtype": dtype, "batch": batch, **record})
        del lm
    return {
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "model": model,
        "parameters": sum(p.numel() for p in base.parameters()),
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "runs": runs,
        "results": results,
    }


def profile_table(setup: dict[str, Any]) -> str:
    """Each profiled engine's largest kernels per decode step (``--profile``)."""
    lines = []
    for r in setup["results"]:
        if "profile" not in r:
            continue
        profile = r["profile"]
        lines.append(f"{r['engine']} ({r['dtype']}, batch {r['batch']}): {profile['total_ms_per_step']:.3f} ms of "
                     "kernels per step")
        lines += [f"  {k['ms_per_step']:8.3f} ms {k['calls_per_step']:7.1f} calls  {k['name'][:90]}"
                  for k in profile["top"]]
    return "\n".join(lines)


def engines_table(setup: dict[str, Any]) -> str:
    lines = [
        f"model {setup['model']} ({setup['parameters'] / 1e6:.1f} M parameters) on {setup['gpu'] or 'cpu'}, "
        f"torch {setup['torch']}, transformers {setup['transformers']}: {setup['prompt_len']}-token prompts, "
        f"{setup['new_tokens']} new tokens, median of {setup['runs']} alternating rounds",
        f"{'dtype':<9}{'batch':>6}  {'engine':<20}{'tokens/s':>10}{'ms/step':>9}{'vs hf':>8}{'warm-up s':>11}{'peak GiB':>10}",
    ]
    for r in setup["results"]:
        over = "" if r["over_hf_generate"] is None else f"{r['over_hf_generate']:.2f}x"
        peak = "" if r["peak_memory_gib"] is None else f"{r['peak_memory_gib']:.2f}"
        lines.append(
            f"{r['dtype']:<9}{r['batch']:>6}  {r['engine']:<20}{r['tokens_per_s']:>10.0f}{r['ms_per_step']:>9.2f}"
            f"{over:>8}{r['warmup_s']:>11.2f}{peak:>10}"
        )
    return "\n".join(lines)
