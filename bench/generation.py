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
(``NativeRolloutConfig(decode="static")``: a static KV cache, each layer's parts
around attention compiled by ``torch.compile`` where Triton is installed, the decode
step replayed as a CUDA graph), ``native_graph_uncompiled`` (the same with
``compile=False``), ``native_static_eager``
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
engines warmed earlier keep). ``--profile N`` adds one more call per engine under
``torch.profiler`` and reports where a step's time goes: the total and the N largest
kernels (on the CPU: operators) by their own time and calls per decode step (JSON:
each record's ``profile``, ``total_ms_per_step`` and ``top``).

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
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch

from bench._decode_engines import (
    DTYPES,
    ENGINES,
    MODELS,
    check_full,
    engines_table,
    profile_table,
    random_prompts,
    run_engines,
)
from workers.models import build_tiny_model, save_tiny_model
from workers.rollout import NativeRolloutConfig, NativeRolloutEngine, SamplingParams


def _seconds(fn: Callable[[], object]) -> float:
    return _timed(fn)[0]


def _timed(fn: Callable[[], object]) -> tuple[float, float]:
    """Wall-clock and CPU seconds (this process, all threads) of ``fn()``."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


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
    prompts = random_prompts(batch, vocab=shape.resolved_vocab_size, seed=0)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, eos_token_id=None, seed=0)
    tokens = batch * new_tokens
    load_before = os.getloadavg()[0]

    lm = build_tiny_model(shape, seed=0).to(getattr(torch, dtype))
    native = NativeRolloutEngine(lm, config=NativeRolloutConfig(max_batch_size=batch))
    check_full(native.generate(prompts, params), new_tokens)
    native_before_vllm_s = _seconds(lambda: native.generate(prompts, params))

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_tiny_model(Path(tmp) / model, shape, seed=0)
        config = VLLMRolloutConfig(dtype=dtype, max_model_len=256, max_num_seqs=batch)
        start = time.perf_counter()
        engine = VLLMRolloutEngine(model_dir, config=config)
        startup_s = time.perf_counter() - start
        try:
            start = time.perf_counter()
            check_full(engine.generate(prompts, params), new_tokens)
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
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="the engines' N largest kernels per decode step, from one more call each (0: none)")
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
            new_tokens=args.new_tokens or (256 if cuda else 64), runs=args.runs or 3, profile=args.profile,
        )
        print(engines_table(results))
        if args.profile:
            print(profile_table(results))
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
