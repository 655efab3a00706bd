"""The end-to-end workload through TRL's ``GRPOTrainer`` (the optional ``compare``
extra), for ``bench.e2e``: ``python -m bench._e2e_trl`` prints one JSON record.

Its ``stage_ms`` (milliseconds per timed step) times the trainer's own methods
(``STAGES``, device-synchronised around each call): ``generate`` (sampling),
``reward`` (the reward function), ``log_prob`` (the rest of building the batch:
mostly the reference's forward pass) and ``update`` (the forward and backward
passes and the optimizer step)."""

from __future__ import annotations

import time

_START = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

from bench._e2e_job import E2EJob, digit_reward  # noqa: E402


def grpo_settings(job: E2EJob) -> dict[str, Any]:
    """TRL ``GRPOConfig`` settings for ``job`` (besides the output directory and steps)."""
    micro = min(job.micro_batch, job.rows)
    return {
        # one generation of every sample, then one optimizer step over micro-batches
        "per_device_train_batch_size": micro, "gradient_accumulation_steps": job.rows // micro,
        "num_generations": job.n, "max_completion_length": job.new_tokens,
        "generation_kwargs": {"min_new_tokens": job.new_tokens}, "temperature": 1.0, "beta": job.kl_coef,
        "learning_rate": job.lr, "num_iterations": 1, "logging_steps": 1, "report_to": [],
        "save_strategy": "no", "seed": job.seed, "shuffle_dataset": False, "disable_tqdm": True,
        "dataloader_num_workers": 0, "use_cpu": job.device == "cpu",
        # On the CPU fp32 like asyncflow (bf16 matmuls are emulated on CPUs without
        # AVX-512 BF16: 10x slower); on a GPU bf16 autocast, like asyncflow's default
        # there. No recomputation on either side: gradient checkpointing saves memory
        # this workload does not need and costs time.
        "bf16": job.device == "cuda", "gradient_checkpointing": False,
    }


STAGES = {"generate": "_generate_single_turn", "reward": "_calculate_rewards",
          "batch": "_generate_and_score_completions", "step": "training_step"}
"""The ``GRPOTrainer`` methods timed, by the name the breakdown derives its stages from."""


def _time_stages(trainer: Any, step: Callable[[], int], spent: dict[int, dict[str, float]]) -> None:
    """Wrap ``trainer``'s ``STAGES`` methods to add their seconds to ``spent[step()][name]``."""
    import torch

    sync: Callable[[], None] = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    def timed(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            sync()
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                sync()
                row = spent.setdefault(step(), {})
                row[name] = row.get(name, 0.0) + time.perf_counter() - start
        return call

    for name, attr in STAGES.items():
        setattr(trainer, attr, timed(name, getattr(trainer, attr)))


def stage_ms(spent: dict[int, dict[str, float]], steps: list[int]) -> dict[str, float]:
    """Milliseconds per step of each stage over ``steps`` (see the module docstring)."""
    def mean(name: str) -> float:
        return 1000 * sum(spent.get(k, {}).get(name, 0.0) for k in steps) / len(steps)

    return {"generate": mean("generate"), "reward": mean("reward"),
            "log_prob": mean("batch") - mean("generate") - mean("reward"), "update": mean("step") - mean("batch")}


def measure(job: E2EJob, *, steps: int, warmup: int, threads: int | None,
            model_dir: str | None = None) -> dict[str, Any]:
    """Train ``warmup + steps`` GRPO steps with TRL on the model in ``model_dir``
    (default: one this run saves); the record."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    if threads is not None:
        torch.set_num_threads(threads)
    marks: dict[str, float] = {"imported": time.time() - _START}
    times: list[float] = []

    class _Clock(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
            self.start = time.perf_counter()

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            times.append(time.perf_counter() - self.start)
            if len(times) == 1:
                marks["first_step_done"] = time.time() - _START

    with tempfile.TemporaryDirectory(prefix="trl-e2e-") as tmp, job.model_dir(model_dir) as model_dir:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        tokenizer.padding_side = "left"
        prompts = [tokenizer.decode(row, skip_special_tokens=True) for row in job.prompt_ids().tolist()]
        data = Dataset.from_dict({"prompt": prompts * (warmup + steps)})
        args = GRPOConfig(output_dir=os.path.join(tmp, "out"), max_steps=warmup + steps,
                          **grpo_settings(job))
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        reward: Any = digit_reward
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data,
                              processing_class=tokenizer, callbacks=[_Clock()])
        spent: dict[int, dict[str, float]] = {}
        _time_stages(trainer, lambda: len(times), spent)
        marks["trainer_built"] = time.time() - _START
        trainer.train()
    median = statistics.median(times[warmup:])
    return {"framework": "trl", "device": job.device, "threads": threads if threads is not None else torch.get_num_threads(),
            "s_per_step": median, "tokens_per_s": job.tokens_per_step / median, "steps_s": times,
            "startup_s": marks, "stage_ms": stage_ms(spent, list(range(warmup, warmup + steps)))}


def main(argv: list[str] | None = None) -> None:
    """Run the workload; print its record as JSON on the last line."""
    parser = argparse.ArgumentParser(prog="bench._e2e_trl")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="the workload's device")
    parser.add_argument("--model-dir", help="the workload's model (default: saved by this run)")
    args = parser.parse_args(argv)
    print(json.dumps(measure(E2EJob.on(args.device), steps=args.steps, warmup=args.warmup, threads=args.threads,
                             model_dir=args.model_dir)))


if __name__ == "__main__":
    main()
