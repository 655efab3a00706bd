"""Generation throughput: the native rollout engine against vLLM on the CPU, and the
native engine's decode paths against transformers' ``generate`` on CUDA.

Run as ``python -m bench.generation [--device cuda] --json PATH``. Every engine
generates for the same model and prompts a fixed number of new tokens per prompt
(EOS ignored), sampled at temperature 1 with a seed; each call is checked to have
generated them all.

**Native against vLLM** (``--device cpu``, the default): prompts of 8 to 16 tokens,
log-probs returned. vLLM's first call, which warms it up, is timed apart and
excluded; then the two engines' timed calls alternate, so that both see the same
machine load (vLLM runs in this process, and the native engine is measured as fast
after vLLM's start-up as before it); the median of each is reported. The weight
update loads a full, differently seeded model into the running vLLM engine.

**The engines** (``--device cuda``; ``--device cpu --engines ...`` runs them on the
CPU), per batch size (``--batches``) and precision (``--dtypes``): ``native_graph``
(``NativeRolloutConfig(decode="static")``: a static KV cache, the decode step replayed
as a CUDA graph), ``native_graph_compiled`` (the same with ``compile=True``: each
layer's parts around attention compiled by ``torch.compile``), ``native_static_eager``
(``cuda_graphs=False``),
``native_eager`` (``decode="dynamic"``: a growing KV cache) and ``hf_generate``
(``model.generate(do_sample=True, temperature=1, top_k=0, top_p=1)`` as TRL's
``GRPOTrainer`` calls it, ``min_new_tokens`` fixing the length). Each engine's first
call (where graphs are captured) is timed apart (``warmup_s``); then ``--runs`` rounds
call every engine once in turn, so that drift hits all alike, each call between
``torch.cuda.synchronize()``. Reported per engine: the median tokens per second,
milliseconds per decode step (seconds over new tokens: the prefill is spread over the
steps), the speed over ``hf_generate``'s, and ``torch.cuda.max_memory_allocated``
during the warm-up call beside what was allocated before it (the weights, and what
engines warmed earlier keep).

The model (``--model``): ``small`` (the CPU default) is a Llama with a real model's
proportions scaled down to what two CPU cores generate with in seconds (hidden 512,
4 layers, 8 heads of 64, MLP 1408, Llama-2's 32000-token vocabulary: 45.6 M
parameters, 32.8 M of them in the embedding and LM head as in small LMs;
Qwen2.5-0.5B: 136 M of 494 M), so that generation costs matrix products, attention
over the KV cache and sampling over a real vocabulary, which is what an RLHF user
pays for. ``qwen2.5-0.5b`` (the CUDA default) has Qwen2.5-0.5B's shape (630 M
parameters, untied embeddings; ``bench.train_step``'s). ``tiny`` is
``TinyModelConfig()`` (0.33 M parameters), the unit tests' model: a step computes next
to nothing, so it measures each engine's per-step bookkeeping (vLLM's scheduler and
output processing in Python), not generation.

Precision (``--dtype`` against vLLM, ``--dtypes`` for the engines): float32, whose
log-probs match the training engine's within 1e-3 (vLLM's bfloat16 does not), or
bfloat16, the fast setting (vLLM's CPU kernels use AVX512-BF16 / AMX).

Threads (``--threads``, on the CPU): torch's intra-op threads, by default the cores
this process may run on. On a machine shared with other jobs, more OpenMP threads than
free cores is far slower (threads spin at barriers while a sibling is descheduled);
the vLLM comparison records the load average before and after. Numbers from a shared
machine are noisy; compare runs with the same load.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
import transformers
from transformers import PreTrainedModel

from bench._shapes import SHAPES
from workers.models import TinyModelConfig, build_tiny_model, save_tiny_model
from workers.rollout import NativeRolloutConfig, NativeRolloutEngine, RolloutOutput, SamplingParams

MODELS = {
    "small": TinyModelConfig(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                             num_key_value_heads=8, head_dim=64, vocab_size=32000),
    "qwen2.5-0.5b": SHAPES["qwen2.5-0.5b"],
    "tiny": TinyModelConfig(),
}
"""The models ``--model`` chooses from (see the module docstring)."""

NATIVE_ENGINES: dict[str, dict[str, Any]] = {
    "native_graph": {"decode": "static", "cuda_graphs": True},
    "native_graph_compiled": {"decode": "static", "cuda_graphs": True, "compile": True},
    "native_static_eager": {"decode": "static", "cuda_graphs": False},
    "native_eager": {"decode": "dynamic"},
}
"""The ``NativeRolloutConfig`` settings of each native engine."""

ENGINES = (*NATIVE_ENGINES, "hf_generate")
"""The engines ``--engines`` chooses from (see the module docstring)."""

DTYPES = ("bfloat16", "float32")
"""The precisions ``--dtypes`` chooses from."""

_GIB = 2**30


def _prompts(batch: int, *, vocab: int, seed: int, length: int | None = None) -> list[list[int]]:
    """``batch`` prompts of ``length`` tokens (None: 8 to 16), starting with ``<bos>`` (id 1)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [length] * batch if length else torch.randint(8, 17, (batch,), generator=gen).tolist()
    return [[1, *torch.randint(3, vocab, (n - 1,), generator=gen).tolist()] for n in lengths]


def _seconds(fn: Callable[[], object]) -> float:
    return _timed(fn)[0]


def _timed(fn: Callable[[], object]) -> tuple[float, float]:
    """Wall-clock and CPU seconds (this process, all threads) of ``fn()``."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def _synced_seconds(fn: Callable[[], object], device: torch.device) -> float:
    """Wall-clock seconds of ``fn()``, including the GPU work it queued."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _check_full(out: RolloutOutput, new_tokens: int) -> None:
    if not bool((out.response_lengths == new_tokens).all()):
        raise RuntimeError(f"every row should generate {new_tokens} tokens with EOS ignored")


def _engine_call(engine: str, lm: PreTrainedModel, prompts: list[list[int]], *, new_tokens: int) -> Callable[[], None]:
    """One generate call of ``engine`` on ``prompts``, raising unless every row
    generated ``new_tokens`` tokens (a comparison of ``len(prompts)`` numbers)."""
    if engine in NATIVE_ENGINES:
        config = NativeRolloutConfig(max_batch_size=len(prompts), **NATIVE_ENGINES[engine])
        native = NativeRolloutEngine(lm, config=config)
        params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, eos_token_id=None, seed=0)
        return lambda: _check_full(native.generate(prompts, params), new_tokens)
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


def _time_engines(
    lm: PreTrainedModel, prompts: list[list[int]], *, engines: Sequence[str], new_tokens: int, runs: int
) -> list[dict[str, Any]]:
    """Warm each engine up, then time ``runs`` rounds of one call per engine."""
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
            prompts = _prompts(batch, vocab=shape.resolved_vocab_size, seed=0, length=prompt_len)
            for record in _time_engines(lm, prompts, engines=engines, new_tokens=new_tokens, runs=runs):
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


def run_vllm(
    *, model: str, dtype: Literal["float32", "bfloat16"], threads: int, batch: int, new_tokens: int, runs: int
) -> dict[str, Any]:
    """Time both engines and vLLM's weight update.

    Args:
        model: A key of :data:`MODELS`.
        dtype: ``"float32"`` or ``"bfloat16"``, for both engines.
        threads: torch intra-op threads, for both engines.
        batch: Number of prompts per call.
        new_tokens: Tokens generated per prompt.
        runs: Timed calls per engine (the median is reported).

    Returns:
        The measurements (throughputs in generated tokens per second).
    """
    from workers.rollout import VLLMRolloutConfig, VLLMRolloutEngine

    torch.set_num_threads(threads)
    shape = MODELS[model]
    prompts = _prompts(batch, vocab=shape.resolved_vocab_size, seed=0)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, eos_token_id=None, seed=0)
    tokens = batch * new_tokens
    load_before = os.getloadavg()[0]

    lm = build_tiny_model(shape, seed=0).to(getattr(torch, dtype))
    native = NativeRolloutEngine(lm, config=NativeRolloutConfig(max_batch_size=batch))
    _check_full(native.generate(prompts, params), new_tokens)
    native_before_vllm_s = _seconds(lambda: native.generate(prompts, params))

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_tiny_model(Path(tmp) / model, shape, seed=0)
        config = VLLMRolloutConfig(dtype=dtype, max_model_len=256, max_num_seqs=batch)
        start = time.perf_counter()
        engine = VLLMRolloutEngine(model_dir, config=config)
        startup_s = time.perf_counter() - start
        try:
            start = time.perf_counter()
            _check_full(engine.generate(prompts, params), new_tokens)
            warmup_s = time.perf_counter() - start
            native_runs, vllm_runs = [], []
            for _ in range(runs):
                native_runs.append(_timed(lambda: native.generate(prompts, params)))
                vllm_runs.append(_timed(lambda: engine.generate(prompts, params)))
            weights = list(build_tiny_model(shape, seed=1).state_dict().items())
            update_s = statistics.median(
                _seconds(lambda: engine.update_weights(weights)) for _ in range(runs)
            )
        finally:
            engine.close()

    native_s, vllm_s = (statistics.median(wall for wall, _ in r) for r in (native_runs, vllm_runs))
    native_cpu, vllm_cpu = (statistics.median(cpu for _, cpu in r) for r in (native_runs, vllm_runs))
    return {
        "native_tokens_per_s": tokens / native_s,
        "vllm_tokens_per_s": tokens / vllm_s,
        "vllm_weight_update_s": update_s,
        "vllm_over_native": native_s / vllm_s,
        "native_generate_s": native_s,
        "vllm_generate_s": vllm_s,
        "native_generate_s_runs": [wall for wall, _ in native_runs],
        "vllm_generate_s_runs": [wall for wall, _ in vllm_runs],
        # CPU time is less sensitive than wall time to other jobs on a shared machine
        # (with one thread it approaches the wall time of a dedicated core).
        "native_generate_cpu_s": native_cpu,
        "vllm_generate_cpu_s": vllm_cpu,
        "vllm_over_native_cpu": native_cpu / vllm_cpu,
        "native_generate_s_before_vllm": native_before_vllm_s,
        "vllm_startup_s": startup_s,
        "vllm_warmup_s": warmup_s,
        "model": model,
        "parameters": sum(p.numel() for p in lm.parameters()),
        "dtype": dtype,
        "threads": threads,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg()[0],
        "batch_size": batch,
        "new_tokens": new_tokens,
        "runs": runs,
    }


def _engines_table(setup: dict[str, Any]) -> str:
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


def _vllm_table(results: dict[str, Any]) -> str:
    rows = [
        ("native", results["native_generate_s"], results["native_tokens_per_s"]),
        ("vllm", results["vllm_generate_s"], results["vllm_tokens_per_s"]),
    ]
    lines = [
        f"model {results['model']} ({results['parameters'] / 1e6:.1f} M parameters, "
        f"{results['dtype']}), {results['threads']} threads, batch {results['batch_size']} x "
        f"{results['new_tokens']} new tokens, median of {results['runs']} alternating runs",
        f"{'engine':<8}{'generate':>12}{'tokens/s':>12}",
        *(f"{name:<8}{secs:>10.3f} s{tps:>12.0f}" for name, secs, tps in rows),
        f"vllm / native: {results['vllm_over_native']:.2f}x wall-clock, "
        f"{results['vllm_over_native_cpu']:.2f}x CPU time",
        f"vllm weight update (full model): {results['vllm_weight_update_s'] * 1e3:.1f} ms",
        f"vllm start-up {results['vllm_startup_s']:.1f} s, warm-up call "
        f"{results['vllm_warmup_s']:.1f} s (excluded)",
        f"load average {results['load_average_before']:.2f} before, "
        f"{results['load_average_after']:.2f} after",
    ]
    cores = len(os.sched_getaffinity(0))
    if results["load_average_after"] > cores + 0.5:  # the load counts this run's threads
        lines.append(
            f"warning: more runnable threads than the {cores} cores (other jobs); wall-clock "
            "numbers are unreliable: compare CPU times, or lower --threads"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point: run the benchmark, print a table, write JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results to this JSON file")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="(cpu)")
    parser.add_argument("--model", choices=sorted(MODELS), help="(small on cpu, qwen2.5-0.5b on cuda)")
    parser.add_argument("--engines", help=f"comma-separated, of {','.join(ENGINES)} (all on cuda; none on cpu: vLLM)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="vLLM's (float32)")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help=f"the engines' ({','.join(DTYPES)})")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="torch threads on the cpu (the cores this process may use)")
    parser.add_argument("--batch", type=int, default=64, help="vLLM's prompts per call (64)")
    parser.add_argument("--batches", default="64,256", help="the engines' prompts per call (64,256)")
    parser.add_argument("--prompt-len", type=int, default=128, help="the engines' tokens per prompt (128)")
    parser.add_argument("--new-tokens", type=int, help="tokens per prompt (64 on cpu, 256 on cuda)")
    parser.add_argument("--runs", type=int, help="timed calls per engine (5 against vLLM, else 3)")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    torch.set_num_threads(args.threads)
    if cuda or args.engines:
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        results = run_engines(
            device=device, model=args.model or ("qwen2.5-0.5b" if cuda else "small"),
            batches=[int(b) for b in args.batches.split(",")], dtypes=args.dtypes.split(","),
            engines=args.engines.split(",") if args.engines else ENGINES, prompt_len=args.prompt_len,
            new_tokens=args.new_tokens or (256 if cuda else 64), runs=args.runs or 3,
        )
        print(_engines_table(results))
    else:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        results = run_vllm(
            model=args.model or "small", dtype=args.dtype, threads=args.threads, batch=args.batch,
            new_tokens=args.new_tokens or 64, runs=args.runs or 5,
        )
        print(_vllm_table(results))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
