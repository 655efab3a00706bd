"""Training throughput of the PyTorch-native engine: fp32, bf16, and bf16 with
activation checkpointing.

    python -m bench.train_step --json bench-train-step.json
    python -m bench.train_step --shape qwen2.5-0.5b --rows 64 --tokens 384 --micro-batch 8 --steps 5

A randomly initialised Llama of the chosen shape is built locally (nothing is
downloaded) and ``TrainingEngine.train_step`` runs the PPO/GRPO ``PolicyLoss`` on
synthetic rows: ``rows`` sequences of exactly ``tokens`` tokens (a quarter prompt, the
rest response, no padding), ``micro-batch`` rows per micro-batch. Each mode gets a
fresh model and engine, one untimed step (warm-up) and ``steps`` timed ones.

Reported per mode: tokens per second, TFLOP/s as ``6 * parameters * tokens / s`` (the
model-FLOPs convention: activation checkpointing's extra forward is not counted, so
its figure shows what the recompute costs), seconds per step, and peak memory
(``torch.cuda.max_memory_allocated`` on CUDA; the process's peak resident set on the
CPU, reset before each mode where Linux allows).

Shapes (``--shape``): ``qwen2.5-0.5b`` (hidden 896, 24 layers, 14 heads, 2 KV heads,
MLP 4864, vocabulary 151936, untied embeddings: 630 M parameters), ``qwen2.5-1.5b``
(hidden 1536, 28 layers, 12 heads, 2 KV heads, MLP 8960, tied embeddings: 1.54 B),
``tiny`` (hidden 128, 2 layers, 4 heads, vocabulary 2048: 0.9 M, for the CPU). The
default is qwen2.5-0.5b on CUDA and tiny on the CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaForCausalLM

from bench._shapes import SHAPES
from workers.engines import TrainingConfig, TrainingEngine
from workers.models import TinyModelConfig, tiny_hf_config
from workers.objectives import PolicyLoss

MODES: dict[str, dict[str, Any]] = {
    "fp32": {"precision": "fp32"},
    "bf16": {"precision": "bf16"},
    "bf16_ac": {"precision": "bf16", "activation_checkpointing": True},
}
"""The engine settings each mode runs with."""

_GIB = 2**30


def model_config(shape: TinyModelConfig, *, tokens: int) -> TinyModelConfig:
    """``shape`` with room for sequences of ``tokens`` tokens."""
    return dataclasses.replace(shape, max_position_embeddings=max(tokens, 4096))


def build_model(shape: TinyModelConfig, *, tokens: int, device: torch.device) -> LlamaForCausalLM:
    """A randomly initialised (seed 0) float32 Llama of ``shape`` on ``device``."""
    torch.manual_seed(0)
    with device:  # initialise in place: no host copy of a 1.5 B model
        return LlamaForCausalLM(tiny_hf_config(model_config(shape, tokens=tokens)))


def synthetic_rows(*, rows: int, tokens: int, vocab: int) -> dict[str, torch.Tensor]:
    """``rows`` unpadded sequences of ``tokens`` tokens (a quarter prompt) with the
    fields ``PolicyLoss`` reads; ``old_logprobs`` near a uniform policy's, so that
    ratios start near 1 (the caller may replace them with the model's)."""
    gen = torch.Generator().manual_seed(0)
    prompt = max(1, tokens // 4)
    response = tokens - prompt
    return {
        "prompt_ids": torch.randint(0, vocab, (rows, prompt), generator=gen),
        "prompt_mask": torch.ones(rows, prompt, dtype=torch.long),
        "response_ids": torch.randint(0, vocab, (rows, response), generator=gen),
        "response_mask": torch.ones(rows, response, dtype=torch.long),
        "old_logprobs": torch.full((rows, response), -math.log(vocab)),
        "advantages": torch.randn(rows, response, generator=gen),
    }


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:  # Linux: writing 5 resets the peak resident set (VmHWM) of this process
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _peak_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / _GIB
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / _GIB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / _GIB


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_mode(
    mode: str,
    *,
    shape: TinyModelConfig,
    device: torch.device,
    rows: int,
    tokens: int,
    micro_batch: int,
    steps: int,
) -> dict[str, float]:
    """Time ``steps`` train steps of one mode (after one warm-up step).

    Returns:
        ``tokens_per_s``, ``tflops``, ``peak_gib``, ``s_per_step``.
    """
    _reset_peak(device)
    model = build_model(shape, tokens=tokens, device=device)
    parameters = sum(p.numel() for p in model.parameters())
    config = TrainingConfig(lr=1e-6, micro_batch_size=micro_batch, **MODES[mode])
    engine = TrainingEngine(model, config=config, loss=PolicyLoss())
    batch = synthetic_rows(rows=rows, tokens=tokens, vocab=shape.resolved_vocab_size)
    batch["old_logprobs"] = engine.log_probs(batch, entropy=False)[0].cpu()
    engine.train_step(batch)  # warm-up: allocator, kernels, AdamW's state
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        engine.train_step(batch)
    _sync(device)
    per_step = (time.perf_counter() - start) / steps
    tokens_per_s = rows * tokens / per_step
    result = {
        "tokens_per_s": tokens_per_s,
        "tflops": 6 * parameters * tokens_per_s / 1e12,
        "peak_gib": _peak_gib(device),
        "s_per_step": per_step,
    }
    del engine, model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def run(
    *,
    shape: str,
    device: torch.device,
    rows: int,
    tokens: int,
    micro_batch: int,
    steps: int,
    modes: tuple[str, ...] = tuple(MODES),
    say: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Every mode on one shape.

    Returns:
        ``{"setup": {...}, mode: {tokens_per_s, tflops, peak_gib, s_per_step}, ...}``.

    Raises:
        ValueError: for an unknown shape or mode, or sizes below 1.
    """
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose one of {sorted(SHAPES)}")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"unknown modes {unknown}; choose from {list(MODES)}")
    if min(rows, tokens, micro_batch, steps) < 1 or tokens < 2:
        raise ValueError("rows, micro-batch and steps must be >= 1 and tokens >= 2")
    spec = SHAPES[shape]
    with torch.device("meta"):
        parameters = sum(p.numel() for p in LlamaForCausalLM(tiny_hf_config(model_config(spec, tokens=tokens))).parameters())
    say(f"{shape}: {parameters / 1e6:.1f} M parameters on {device}, {rows} rows x {tokens} tokens, "
        f"micro-batch {micro_batch}, {steps} timed steps")
    record: dict[str, Any] = {
        "setup": {
            "shape": shape,
            "parameters": parameters,
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "rows": rows,
            "tokens": tokens,
            "micro_batch": micro_batch,
            "steps": steps,
            "torch": torch.__version__,
        }
    }
    for mode in modes:
        record[mode] = run_mode(
            mode, shape=spec, device=device, rows=rows, tokens=tokens, micro_batch=micro_batch, steps=steps
        )
        say(f"{mode}: {record[mode]['tflops']:.2f} TFLOP/s")
    return record


def table(record: dict[str, Any]) -> str:
    """The modes as a small text table."""
    lines = [f"{'mode':<10}{'tokens/s':>12}{'TFLOP/s':>10}{'peak GiB':>10}{'s/step':>9}", "-" * 51]
    for mode, r in record.items():
        if mode == "setup":
            continue
        lines.append(
            f"{mode:<10}{r['tokens_per_s']:>12.0f}{r['tflops']:>10.3f}{r['peak_gib']:>10.2f}{r['s_per_step']:>9.3f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON here")
    parser.add_argument("--shape", choices=sorted(SHAPES), help="default: qwen2.5-0.5b on CUDA, tiny on CPU")
    parser.add_argument("--device", help="default: cuda when available, else cpu")
    parser.add_argument("--rows", type=int, default=64, help="sequences per step")
    parser.add_argument("--tokens", type=int, default=384, help="tokens per sequence")
    parser.add_argument("--micro-batch", type=int, default=8, help="rows per micro-batch")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per mode")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {list(MODES)}")
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":  # set_device wants an index: "cuda" alone means the current one
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        torch.cuda.set_device(device)
    shape = args.shape or ("qwen2.5-0.5b" if device.type == "cuda" else "tiny")
    record = run(
        shape=shape,
        device=device,
        rows=args.rows,
        tokens=args.tokens,
        micro_batch=args.micro_batch,
        steps=args.steps,
        modes=tuple(dict.fromkeys(m for m in args.modes.split(",") if m)),
        say=lambda msg: print(f"  .. {msg}", flush=True),
    )
    print(table(record))
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
