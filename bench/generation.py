"""Generation throughput of the native and vLLM rollout engines, and vLLM's weight update.

Run as ``python -m bench.generation --json PATH``. Both engines generate for the same
model: a batch of prompts, a fixed number of new tokens each with EOS ignored (so
every row generates them all), sampled at temperature 1 with a seed, log-probs
returned. vLLM's first call, which warms it up, is timed apart and excluded; then
the two engines' timed calls alternate, so that both see the same machine load
(vLLM runs in this process on CPU, and the native engine is measured as fast after
vLLM's start-up as before it), and the median of each is reported. The weight update
loads a full, differently seeded model into the running vLLM engine.

The model (``--model``):

- ``small`` (default): a Llama with a real model's proportions, scaled down to what
  two CPU cores generate with in seconds: hidden 512, 4 layers, 8 heads of 64,
  MLP 1408, a 32000-token vocabulary (Llama-2's), 45.6 M parameters, of which the
  embedding and LM head hold 32.8 M as in small LMs (Qwen2.5-0.5B: 136 M of 494 M).
  Generation cost is then matrix products, attention over the KV cache and sampling
  over a real vocabulary, which is what an RLHF user pays for.
- ``tiny``: ``TinyModelConfig()`` (2 layers, 128 wide, 19-token vocabulary, 0.33 M
  parameters), the model of the unit tests. A step computes next to nothing, so it
  measures each engine's per-step bookkeeping (vLLM's scheduler and output
  processing in Python), not generation.

Precision (``--dtype``, both engines alike): float32 by default, the setting whose
log-probs match the training engine's within 1e-3 (vLLM's bfloat16 does not);
bfloat16 is the fast setting (vLLM's CPU kernels use AVX512-BF16 / AMX).

Threads (``--threads``, both engines alike): torch's intra-op threads, by default the
cores this process may run on. On a machine shared with other jobs, more OpenMP
threads than free cores is far slower for both engines (threads spin at barriers
while a sibling is descheduled); the load average before and after is recorded.
Numbers from a shared machine are noisy; compare runs with the same load.
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

from workers.models import TinyModelConfig, build_tiny_model, save_tiny_model
from workers.rollout import NativeRolloutConfig, NativeRolloutEngine, RolloutOutput, SamplingParams

MODELS = {
    "small": TinyModelConfig(
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=32000,
    ),
    "tiny": TinyModelConfig(),
}
"""The models ``--model`` chooses from (see the module docstring)."""


def _prompts(batch: int, *, vocab: int, seed: int) -> list[list[int]]:
    """``batch`` prompts of 8 to 16 tokens, starting with ``<bos>`` (id 1)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 17, (batch,), generator=gen).tolist()
    return [[1, *torch.randint(3, vocab, (n - 1,), generator=gen).tolist()] for n in lengths]


def _seconds(fn: Callable[[], object]) -> float:
    return _timed(fn)[0]


def _timed(fn: Callable[[], object]) -> tuple[float, float]:
    """Wall-clock and CPU seconds (this process, all threads) of ``fn()``."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def _check_full(out: RolloutOutput, new_tokens: int) -> None:
    if not bool((out.response_lengths == new_tokens).all()):
        raise RuntimeError(f"every row should generate {new_tokens} tokens with EOS ignored")


def run(
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


def _table(results: dict[str, Any]) -> str:
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
    parser.add_argument("--model", choices=sorted(MODELS), default="small", help="(small)")
    parser.add_argument(
        "--dtype", choices=["float32", "bfloat16"], default="float32", help="(float32)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="torch threads for both engines (the cores this process may use)",
    )
    parser.add_argument("--batch", type=int, default=64, help="prompts per call (64)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens per prompt (64)")
    parser.add_argument("--runs", type=int, default=5, help="timed calls per engine (5)")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    results = run(
        model=args.model,
        dtype=args.dtype,
        threads=args.threads,
        batch=args.batch,
        new_tokens=args.new_tokens,
        runs=args.runs,
    )
    print(_table(results))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
