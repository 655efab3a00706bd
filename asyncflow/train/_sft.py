"""SFT warm start: a tiny model trained to answer the arithmetic source's problems,
saved for RL; and its greedy held-out accuracy.

:func:`sft_warm_start` is what the CLI's SFT command runs: it builds a tiny random
causal LM (:mod:`workers.models`), trains it with :class:`TrainingEngine` and
:class:`NLLLoss` on batches of the train split (loss on ``answer <eos>`` only, or
on a demonstration's turns: :mod:`asyncflow.train._demonstrations`), and writes an
ordinary Hugging Face directory (weights, config, generation config and
tokenizer) that the actor, the reference and the rollout engines load.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Literal

import msgspec
import torch
from torch import nn

from asyncflow.train._demonstrations import (
    Demonstration,
    demonstrate,
    demonstrated,
    evaluate_episodes,
    fill_turn,
    sft_rows,
)
from channels import ConfigError
from workers.data import (
    ArithmeticProblem,
    ArithmeticTaskConfig,
    check_fits_context,
    decode_responses,
    generate_splits,
    iter_problem_batches,
    sft_batch,
)
from workers.engines import TrainingConfig, TrainingEngine
from workers.episodes import EpisodeConfig
from workers.models import CharTokenizer, TinyModelConfig, build_tiny_model
from workers.objectives import NLLLoss
from workers.rewards import arithmetic_reward
from workers.rollout import NativeRolloutConfig, NativeRolloutEngine, SamplingParams


class SFTConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How :func:`sft_warm_start` trains: the model and the training run (the
    problems are the run's ``[data.arithmetic]``)."""

    model: TinyModelConfig = msgspec.field(default_factory=TinyModelConfig)
    """Shape of the tiny model built at random and trained."""
    steps: int = 2000
    """Most optimizer steps (early stopping usually ends the run far sooner)."""
    batch_size: int = 64
    """Examples per step."""
    lr: float = 1e-3
    """Peak AdamW learning rate."""
    warmup_steps: int = 20
    """Linear warm-up steps."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay (matrices only)."""
    stop_at_train_accuracy: float | None = 0.2
    """Stop once greedy accuracy on ``probe_size`` train problems reaches this; 0 (or
    None) trains for ``steps``, without probes. RL needs room to improve, and a set
    accuracy (rather than a set step count) keeps the start robust across seeds: the
    step at which a tiny model learns to carry varies by hundreds of steps from seed
    to seed."""
    probe_size: int = 500
    """Train problems (the first ones of the split) the early-stopping check decodes."""
    probe_every: int = 25
    """Steps between early-stopping checks."""
    max_seconds: float | None = None
    """Stop early once training has run this long (None: no time limit)."""
    evaluate: bool = True
    """Measure greedy accuracy on the held-out split at the end."""
    decode_batch_size: int = 512
    """Rows decoded at once by the probes and the final evaluation."""
    seed: int = 0
    """Seed of the model's initialisation and of the batch order."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the warm start trains (in the calling process): ``"auto"`` takes the
    first CUDA GPU when there is one (in bf16: ``TrainingConfig``'s ``"auto"``
    precision), else the CPU. Its device memory is released when it ends."""
    demonstration_share: float = 0.0
    """Share of the train problems taught as an episode with the run's ``[env]``
    instead of a direct answer: the turns of ``demonstration_turns``, each followed
    by the environment's observation (encoded as the run's episodes encode it),
    then the answer; the loss is on the turns only. With demonstrations, the
    early-stopping probe and the evaluation run greedy episodes (their accuracy is
    the RL run's held-out measure). 0: every problem is a direct answer."""
    demonstration_turns: tuple[str, ...] = ()
    """A demonstration's turns before the answer, templates of the problem's
    ``{left}``, ``{operator}`` and ``{right}``: ``["mul({left},{right})"]`` calls
    the tool ``mul`` of ``[env] class = "workers.episodes:ToolEnv"``."""

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "probe_size", "probe_every", "decode_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"SFTConfig.{name} must be an int >= 1, got {value!r}")
        for name in ("warmup_steps",):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"SFTConfig.{name} must be an int >= 0, got {value!r}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ConfigError(f"SFTConfig.lr must be a finite number > 0, got {self.lr!r}")
        target = self.stop_at_train_accuracy
        if target is not None and not 0 <= target <= 1:
            raise ConfigError(
                f"SFTConfig.stop_at_train_accuracy must be in [0, 1] (0: no early stopping), got {target!r}"
            )
        if self.max_seconds is not None and not self.max_seconds > 0:
            raise ConfigError(
                f"SFTConfig.max_seconds must be > 0 or None, got {self.max_seconds!r}"
            )
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"SFTConfig.device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if isinstance(self.demonstration_share, bool) or not 0 <= self.demonstration_share <= 1:
            raise ConfigError(f"SFTConfig.demonstration_share must be in [0, 1], got {self.demonstration_share!r}")
        if self.demonstration_share and not self.demonstration_turns:
            raise ConfigError("SFTConfig.demonstration_turns is empty: a demonstration needs the turns before "
                              "the answer, e.g. [\"mul({left},{right})\"]; or set demonstration_share = 0")
        example = ArithmeticProblem(left=1, operator="+", right=2)
        for k, turn in enumerate(self.demonstration_turns):
            if not isinstance(turn, str) or not turn:
                raise ConfigError(f"SFTConfig.demonstration_turns[{k}] must be a non-empty string, got {turn!r}")
            fill_turn(turn, example, key=f"SFTConfig.demonstration_turns[{k}]")

    def torch_device(self) -> torch.device:
        """The device :attr:`device` names here.

        Raises:
            ConfigError: ``"cuda"`` on a machine without a CUDA GPU.
        """
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("SFTConfig.device = 'cuda' but this machine has no CUDA GPU; use 'auto' or 'cpu'")
        cuda = self.device == "cuda" or (self.device == "auto" and torch.cuda.is_available())
        return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")


def sft_warm_start(model_dir_out: str | Path, config: SFTConfig, task: ArithmeticTaskConfig,
                   episodes: EpisodeConfig | None = None) -> dict[str, float]:
    """Build a tiny model, train it on ``task``'s train split, and save it.

    Uses the calling process's torch thread settings; nothing is downloaded.

    Args:
        model_dir_out: Output directory (created if needed) for the Hugging Face model
            and its tokenizer.
        config: Model and training settings.
        task: The problems (the train split is learnt; the held-out split is
            evaluated when ``config.evaluate`` is set).
        episodes: The run's episode settings (``[env]``), which demonstrations
            (``config.demonstration_share``) are episodes of.

    Returns:
        ``loss`` (mean of the last 10 steps), ``steps``, ``train_seconds`` (probes
        included), ``num_parameters``, ``train_accuracy`` (the last probe; -1 without
        early stopping) and, when ``evaluate`` is set, ``eval_accuracy`` (greedy, on the
        held-out split) and ``eval_seconds``; with demonstrations also
        ``demonstrations`` (how many) and, when ``evaluate`` is set, ``eval_turns``
        (turns per held-out episode).

    Raises:
        ConfigError: If a prompt plus its answer (or its demonstration) does not fit
            the model's context, or the demonstrations cannot be made (see
            :func:`~asyncflow.train._demonstrations.demonstrate`).
    """
    tokenizer = CharTokenizer(config.model.tokenizer)
    splits = generate_splits(task)
    max_new_tokens = task.max_answer_chars + 1
    shown = _demonstrations(splits.train, tokenizer, config, episodes)
    check_fits_context(
        splits.train + splits.eval,
        tokenizer,
        max_new_tokens=episodes.max_tokens if shown and episodes is not None else max_new_tokens,
        max_positions=config.model.max_position_embeddings,
    )
    device = config.torch_device()
    model = build_tiny_model(config.model, seed=config.seed)
    nn.Module.to(model, device)  # in place (transformers' annotation of .to confuses type checkers)
    engine = TrainingEngine(
        model,
        config=TrainingConfig(
            lr=config.lr, warmup_steps=config.warmup_steps, weight_decay=config.weight_decay
        ),
        loss=NLLLoss(),
    )
    # The rollout engine shares the model: probes decode the weights being trained.
    rollout = NativeRolloutEngine(
        model, config=NativeRolloutConfig(max_batch_size=config.decode_batch_size)
    )
    if shown and episodes is not None:  # accuracy is the episodes', as the RL run measures it
        turn = max(max(d.longest_turn for d in shown.values()), max_new_tokens)
        evaluate: Evaluate = partial(evaluate_episodes, rollout, tokenizer=tokenizer, episodes=episodes,
                                     max_new_tokens=turn)
    else:
        evaluate = partial(evaluate_greedy, rollout, tokenizer=tokenizer, max_new_tokens=max_new_tokens)
    metrics = _train(engine, evaluate, splits.train, tokenizer, config, shown)
    metrics["num_parameters"] = float(sum(p.numel() for p in model.parameters()))
    if shown:
        metrics["demonstrations"] = float(len(shown))
    model.eval()
    _save(Path(model_dir_out), engine, tokenizer)
    if config.evaluate:
        start = time.perf_counter()
        result = evaluate(splits.eval)
        metrics["eval_accuracy"] = result["accuracy"]
        if "mean_turns" in result:
            metrics["eval_turns"] = result["mean_turns"]
        metrics["eval_seconds"] = time.perf_counter() - start
    if device.type == "cuda":  # the RL workers want this memory back
        del engine, rollout, model
        torch.cuda.empty_cache()
    return metrics


Evaluate = Callable[[Sequence[ArithmeticProblem]], dict[str, float]]
"""Greedy accuracy on some problems (direct answers, or episodes)."""


def _demonstrations(train: Sequence[ArithmeticProblem], tokenizer: CharTokenizer, config: SFTConfig,
                    episodes: EpisodeConfig | None) -> dict[ArithmeticProblem, Demonstration]:
    """The train problems taught as demonstrations, each with its episode."""
    if not config.demonstration_share:
        return {}
    if episodes is None:
        raise ConfigError(f"sft.demonstration_share = {config.demonstration_share} teaches episodes with the "
                          "run's environment, and the run has none: add [env] or set demonstration_share = 0")
    problems = [train[i] for i in demonstrated(len(train), config.demonstration_share)]
    return dict(zip(problems, demonstrate(problems, tokenizer, config.demonstration_turns, episodes), strict=True))


def _train(
    engine: TrainingEngine,
    evaluate: Evaluate,
    train: Sequence[ArithmeticProblem],
    tokenizer: CharTokenizer,
    config: SFTConfig,
    shown: dict[ArithmeticProblem, Demonstration],
) -> dict[str, float]:
    """The SFT loop, stopping at ``steps``, the probe's target or ``max_seconds``."""
    batches = iter_problem_batches(train, config.batch_size, seed=config.seed)
    probe = train[: config.probe_size]
    losses: list[float] = []
    train_accuracy = -1.0
    start = time.perf_counter()
    for step in range(1, config.steps + 1):
        problems = next(batches)
        batch = sft_rows(problems, tokenizer, shown) if shown else sft_batch(problems, tokenizer)
        losses.append(engine.train_step(batch)["loss"])
        if not math.isfinite(losses[-1]):  # the weights are no longer numbers: nothing worth saving
            raise ConfigError(f"the SFT warm start diverged: loss {losses[-1]} at step {step} (the loss was "
                              f"{losses[0]:.3g} at step 1); lower sft.lr ({config.lr:g})")
        if config.max_seconds is not None and time.perf_counter() - start >= config.max_seconds:
            break
        if config.stop_at_train_accuracy and step % config.probe_every == 0:
            train_accuracy = evaluate(probe)["accuracy"]
            if train_accuracy >= config.stop_at_train_accuracy:
                break
    return {
        "loss": sum(losses[-10:]) / len(losses[-10:]),
        "steps": float(len(losses)),
        "train_seconds": time.perf_counter() - start,
        "train_accuracy": train_accuracy,
    }


def _save(path: Path, engine: TrainingEngine, tokenizer: CharTokenizer) -> None:
    path.mkdir(parents=True, exist_ok=True)
    engine.export_hf(path)
    generation_config = getattr(engine.model, "generation_config", None)
    if generation_config is not None:
        generation_config.save_pretrained(path)
    tokenizer.save_pretrained(path)


def evaluate_greedy(
    engine: NativeRolloutEngine,
    problems: Sequence[ArithmeticProblem],
    tokenizer: CharTokenizer,
    *,
    max_new_tokens: int,
) -> dict[str, float]:
    """Greedy-decode every problem once and score it with :func:`workers.rewards.arithmetic_reward`.

    Args:
        engine: The policy's rollout engine (its ``max_batch_size`` sets the batch).
        problems: The split to evaluate, usually the held-out eval split.
        tokenizer: The model's tokenizer.
        max_new_tokens: Generation limit; the longest answer plus one (for ``<eos>``)
            suffices.

    Returns:
        ``accuracy`` (fraction exactly right), ``num_problems`` and
        ``mean_response_tokens``.

    Raises:
        ConfigError: If ``problems`` is empty or a prompt does not fit the context.
    """
    if not problems:
        raise ConfigError("evaluate_greedy got no problems; the split is empty")
    check_fits_context(
        problems,
        tokenizer,
        max_new_tokens=max_new_tokens,
        max_positions=int(engine.model.config.max_position_embeddings),
    )
    params = SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=0.0,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    output = engine.generate([tokenizer.encode(p.prompt) for p in problems], params)
    responses = decode_responses(output.response_ids, output.response_mask, tokenizer)
    scores = arithmetic_reward(
        [p.prompt for p in problems], responses, [p.answer for p in problems]
    )
    return {
        "accuracy": sum(scores) / len(scores),
        "num_problems": float(len(scores)),
        "mean_response_tokens": float(output.response_lengths.float().mean()),
    }
