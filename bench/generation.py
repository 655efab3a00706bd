"""Generation throughput of the native and vLLM rollout engines, and vLLM's weight update.

Run as ``python -m bench.generation --json PATH``. Both engines generate for the same
tiny Llama (``workers.models`` factory defaults: 2 layers, 128 wide, head_dim 64):
a batch of prompts, a fixed number of new tokens each with EOS ignored (so every row
generates them all), sampled at temperature 1 with a seed. Each engine is timed over
a few runs and the median reported; vLLM's first call, which warms it up, is timed
apart and excluded. The weight update loads a full, differently seeded model into the
running vLLM engine.

The native engine runs first, before vLLM starts: on CPU vLLM runs in this process and
binds its memory and threads, which must not disturb the native measurement. Numbers
from a shared machine are noisy; compare runs from the same machine.
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

import torch

from workers.models import TinyModelConfig, build_tiny_model, save_tiny_model
from workers.rollout import NativeRolloutConfig, NativeRolloutEngine
from workers.rollout import RolloutOutput, SamplingParams


def _prompts(batch: int, *, vocab: int, seed: int) -> list[list[int]]:
    """``batch`` prompts of 8 to 16 tokens, starting with ``<bos>`` (id 1)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 17, (batch,), generator=gen).tolist()
    return [[1, *torch.randint(3, vocab, (n - 1,), generator=gen).tolist()] for n in lengths]


def _median_seconds(fn: Callable[[], object], runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _check_full(out: RolloutOutput, new_tokens: int) -> None:
    if not bool((out.response_lengths == new_tokens).all()):
        raise RuntimeError(f"every row should generate {new_tokens} tokens with EOS ignored")


def run(*, batch: int, new_tokens: int, runs: int) -> dict[str, float | int]:
    """Time both engines and vLLM's weight update.

    Args:
        batch: Number of prompts per call.
        new_tokens: Tokens generated per prompt.
        runs: Timed calls per measurement (the median is reported).

    Returns:
        The measurements (throughputs in generated tokens per second).
    """
    from workers.rollout import VLLMRolloutConfig, VLLMRolloutEngine

    tiny = TinyModelConfig()
    prompts = _prompts(batch, vocab=tiny.resolved_vocab_size, seed=0)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, eos_token_id=None, seed=0)
    tokens = batch * new_tokens

    native = NativeRolloutEngine(
        build_tiny_model(tiny, seed=0), config=NativeRolloutConfig(max_batch_size=batch)
    )
    _check_full(native.generate(prompts, params), new_tokens)
    native_s = _median_seconds(lambda: native.generate(prompts, params), runs)

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_tiny_model(Path(tmp) / "tiny", tiny, seed=0)
        config = VLLMRolloutConfig(max_model_len=256, max_num_seqs=batch)
        start = time.perf_counter()
        engine = VLLMRolloutEngine(model_dir, config=config)
        startup_s = time.perf_counter() - start
        try:
            start = time.perf_counter()
            _check_full(engine.generate(prompts, params), new_tokens)
            warmup_s = time.perf_counter() - start
            vllm_s = _median_seconds(lambda: engine.generate(prompts, params), runs)
            weights = list(build_tiny_model(tiny, seed=1).state_dict().items())
            update_s = _median_seconds(lambda: engine.update_weights(weights), runs)
        finally:
            engine.close()

    return {
        "native_tokens_per_s": tokens / native_s,
        "vllm_tokens_per_s": tokens / vllm_s,
        "vllm_weight_update_s": update_s,
        "native_generate_s": native_s,
        "vllm_generate_s": vllm_s,
        "vllm_startup_s": startup_s,
        "vllm_warmup_s": warmup_s,
        "batch_size": batch,
        "new_tokens": new_tokens,
        "runs": runs,
    }


def _table(results: dict[str, float | int]) -> str:
    rows = [
        (
            "native",
            f"{results['native_generate_s']:.3f} s",
            f"{results['native_tokens_per_s']:.0f}",
        ),
        ("vllm", f"{results['vllm_generate_s']:.3f} s", f"{results['vllm_tokens_per_s']:.0f}"),
    ]
    lines = [
        f"batch {results['batch_size']} x {results['new_tokens']} new tokens, "
        f"median of {results['runs']} runs",
        f"{'engine':<8}{'generate':>12}{'tokens/s':>12}",
        *(f"{name:<8}{secs:>12}{tps:>12}" for name, secs, tps in rows),
        f"vllm weight update (full model): {results['vllm_weight_update_s'] * 1e3:.1f} ms",
        f"vllm start-up {results['vllm_startup_s']:.1f} s, warm-up call "
        f"{results['vllm_warmup_s']:.1f} s (excluded)",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point: run the benchmark, print a table, write JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results to this JSON file")
    parser.add_argument("--batch", type=int, default=64, help="prompts per call (64)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens per prompt (64)")
    parser.add_argument("--runs", type=int, default=5, help="timed calls per measurement (5)")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    results = run(batch=args.batch, new_tokens=args.new_tokens, runs=args.runs)
    print(_table(results))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
