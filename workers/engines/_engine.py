"""The PyTorch-native training engine: forward passes and optimizer steps on one role's model.

One :class:`TrainingEngine` per role (actor, critic, reference): the model, a head
(causal LM log-probs or value-model values), an objective, AdamW, and a
:class:`Parallelism` that lays the model out over a ``("pp", "dp", "tp")`` DeviceMesh.

Data contract: every rank of the mesh calls each method together (the methods are
collectives); ranks of one data-parallel group pass the same rows, different
data-parallel groups pass their own slices of the global batch. A train step equals
one full-batch step on the union of the slices, whatever the micro-batching.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from workers.engines import _checkpoint
from workers.engines._batch import (
    FixedSizeMicroBatches,
    MicroBatchPlanner,
    TokenBalancedMicroBatches,
    WholeBatch,
    build_inputs,
    check_batch,
    pad_columns,
    select_rows,
    token_counts,
)
from workers.engines._heads import CausalLMHead, ModelHead
from workers.engines._losses import LossAggregation
from workers.engines._objectives import EngineConfigError, LossFn, ModelOutputs
from workers.engines._parallel import (
    Parallelism,
    TensorParallelPlan,
    clip_grad_norm,
    group_by_layout,
)


def _positive(name: str, value: float | None, *, allow_zero: bool = False) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise EngineConfigError(f"TrainingConfig.{name} must be a number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise EngineConfigError(f"TrainingConfig.{name} must be {bound}, got {value}")


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    """Optimizer, schedule, micro-batching and loss reduction of a training engine."""

    lr: float = 1e-6
    """Peak learning rate of AdamW."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's moment decay rates."""
    weight_decay: float = 0.0
    """Decoupled weight decay, applied to matrices only (not to norms and biases)."""
    eps: float = 1e-8
    """AdamW's denominator epsilon."""
    grad_clip: float | None = 1.0
    """Clip the total gradient norm to this; None or 0 disables clipping."""
    warmup_steps: int = 0
    """Linear warm-up: step s uses ``lr * min(1, (s + 1) / warmup_steps)``."""
    micro_batch_size: int | None = None
    """Rows per micro-batch (gradient accumulation); exclusive with max_tokens_per_micro_batch."""
    max_tokens_per_micro_batch: int | None = None
    """Token-balanced micro-batches of at most this many real tokens each."""
    loss_aggregation: LossAggregation = LossAggregation.TOKEN_MEAN
    """How per-token loss terms are averaged over the global batch."""
    skip_non_finite: bool = True
    """Skip the optimizer step (and report it) when the gradient norm is inf or nan."""

    def __post_init__(self) -> None:
        _positive("lr", self.lr)
        _positive("weight_decay", self.weight_decay, allow_zero=True)
        _positive("eps", self.eps)
        _positive("grad_clip", self.grad_clip, allow_zero=True)
        _positive("warmup_steps", self.warmup_steps, allow_zero=True)
        _positive("micro_batch_size", self.micro_batch_size)
        _positive("max_tokens_per_micro_batch", self.max_tokens_per_micro_batch)
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise EngineConfigError(
                f"TrainingConfig.betas must be two numbers in [0, 1), got {self.betas}"
            )
        if self.micro_batch_size is not None and self.max_tokens_per_micro_batch is not None:
            raise EngineConfigError(
                "TrainingConfig: set micro_batch_size or max_tokens_per_micro_batch, not both"
            )
        object.__setattr__(self, "loss_aggregation", LossAggregation(self.loss_aggregation))

    def micro_batch_planner(self) -> MicroBatchPlanner:
        """The micro-batching strategy these settings select.

        Returns:
            Token-balanced, fixed-size, or whole-batch planning.
        """
        if self.max_tokens_per_micro_batch is not None:
            return TokenBalancedMicroBatches(max_tokens=self.max_tokens_per_micro_batch)
        if self.micro_batch_size is not None:
            return FixedSizeMicroBatches(size=self.micro_batch_size)
        return WholeBatch()

    def lr_at(self, step: int) -> float:
        """Learning rate of optimizer step ``step`` (0-based) under linear warm-up.

        Args:
            step: the step index.

        Returns:
            The learning rate.
        """
        if self.warmup_steps <= 0:
            return self.lr
        return self.lr * min(1.0, (step + 1) / self.warmup_steps)


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, object]]:
    """One AdamW group per (layout, decays) so foreach kernels see homogeneous tensors."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = []
    for decays in (True, False):
        chosen = [p for p in params if (p.ndim >= 2) == decays]
        for layout in group_by_layout(chosen):
            groups.append({"params": layout, "weight_decay": weight_decay if decays else 0.0})
    return groups


class _StepStats:
    """Sums of the loss and per-token metrics of one step, reduced over DP at the end.

    Kept as float64 tensors on the device so that no micro-batch waits for the device.
    """

    def __init__(self, device: torch.device) -> None:
        self._zero = torch.zeros((), dtype=torch.float64, device=device)
        self.loss = self._zero
        self.tokens = self._zero
        self.sums: dict[str, Tensor] = {}

    def add(self, loss: Tensor, metrics: Mapping[str, Tensor], mask: Tensor) -> None:
        self.loss = self.loss + loss.detach().double()
        self.tokens = self.tokens + mask.sum().double()
        for name, value in metrics.items():
            total = (value.detach() * mask).sum().double()
            self.sums[name] = self.sums.get(name, self._zero) + total

    def reduce(self, parallel: Parallelism) -> dict[str, float]:
        names = sorted(self.sums)
        packed = torch.stack([self.loss, self.tokens, *(self.sums[n] for n in names)])
        loss, tokens, *sums = parallel.all_reduce_dp(packed).tolist()
        return {"loss": loss} | {n: s / max(tokens, 1.0) for n, s in zip(names, sums, strict=True)}


class TrainingEngine:
    """Trains (and evaluates) one model with AdamW, micro-batching and a parallel layout.

    Example:
        >>> engine = TrainingEngine(model, config=TrainingConfig(lr=1e-5), loss=PolicyLoss())
        >>> logprobs, entropy = engine.log_probs(batch)
        >>> metrics = engine.train_step(batch | {"old_logprobs": logprobs, "advantages": adv})
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        config: TrainingConfig,
        mesh: DeviceMesh | None = None,
        head: ModelHead | None = None,
        loss: LossFn | None = None,
        tp_plan: TensorParallelPlan | None = None,
    ) -> None:
        """Lay the model out over the mesh and build its optimizer.

        Args:
            model: a causal LM or a value model, identical on every rank (same seed or
                same weights); it is sharded in place.
            config: optimizer, schedule and micro-batching settings.
            mesh: a ``("pp", "dp", "tp")`` DeviceMesh (gloo on CPU, NCCL on GPU; on GPU
                call ``torch.cuda.set_device(local_rank)`` first), or None for one
                process on the model's device.
            head: :class:`CausalLMHead` (default) or :class:`ValueHead`.
            loss: the default objective of :meth:`train_step`.
            tp_plan: which layers tensor parallelism shards (Llama-style default).

        Raises:
            EngineConfigError: for an invalid mesh (names, ``pp > 1``) or a model whose
                head counts ``tp`` does not divide.
        """
        self.config = config
        self.parallel = Parallelism(mesh, tp_plan=tp_plan)
        self.device = self.parallel.device_for(model)
        self.model = self.parallel.parallelize(model)
        self.head: ModelHead = head if head is not None else CausalLMHead()
        self.loss = loss
        self._planner = config.micro_batch_planner()
        self.optimizer = torch.optim.AdamW(
            _param_groups(self.model, config.weight_decay),
            lr=config.lr_at(0),
            betas=config.betas,
            eps=config.eps,
        )
        self._step = 0

    @property
    def step(self) -> int:
        """Optimizer steps taken (restored by :meth:`load`)."""
        return self._step

    # ----------------------------------------------------------------- forward only

    def log_probs(
        self, batch: Mapping[str, Tensor], *, temperature: float = 1.0
    ) -> tuple[Tensor, Tensor]:
        """Log-probs and entropy of the response tokens, without gradients.

        Args:
            batch: sequence fields (``prompt_ids``, ``prompt_mask``, ``response_ids``,
                ``response_mask``).
            temperature: divides the logits (1.0 = the rollout engines' raw log-probs).

        Returns:
            ``(logprobs, entropy)``, float32 ``[B, R]`` on the engine's device, 0 on padding.

        Raises:
            EngineConfigError: if the engine's head is not a :class:`CausalLMHead`, or the
                batch lacks a field.
        """
        if not isinstance(self.head, CausalLMHead):
            raise EngineConfigError(
                f"log_probs needs an engine built with head=CausalLMHead(), this one has "
                f"{type(self.head).__name__}"
            )
        head = dataclasses.replace(self.head, temperature=temperature, with_entropy=True)
        outputs = self._infer(batch, head)
        return outputs.require("logprobs"), outputs.require("entropy")

    def values(self, batch: Mapping[str, Tensor]) -> Tensor:
        """Value predictions for the response positions, without gradients.

        Args:
            batch: sequence fields.

        Returns:
            float32 ``[B, R]``, 0 on padding.

        Raises:
            EngineConfigError: if the head does not produce values (use ``ValueHead()``).
        """
        return self._infer(batch, self.head).require("values")

    def _infer(self, batch: Mapping[str, Tensor], head: ModelHead) -> ModelOutputs:
        rows = check_batch(batch)
        batch = self._to_device(batch)
        width = batch["response_ids"].shape[1]
        results: dict[str, Tensor] = {}
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                for rows_idx in self._plan(batch, rows):
                    micro, dummy = self._micro_batch(batch, rows_idx)
                    outputs = head(self.model, build_inputs(micro), entropy_grad=False)
                    if dummy:
                        continue
                    mask = micro["response_mask"].to(torch.float32)
                    for field in dataclasses.fields(outputs):
                        value = getattr(outputs, field.name)
                        if value is None:
                            continue
                        dest = results.setdefault(
                            field.name, torch.zeros(rows, width, device=self.device)
                        )
                        dest[rows_idx.to(self.device)] = pad_columns(value.float(), width) * mask
        finally:
            self.model.train(was_training)
        return ModelOutputs(**results)

    # ----------------------------------------------------------------------- train

    def train_step(
        self, batch: Mapping[str, Tensor], *, loss: LossFn | None = None
    ) -> dict[str, float]:
        """One optimizer step on ``batch`` (this rank's data-parallel slice).

        Micro-batch losses are scaled by the global (all data-parallel ranks) normaliser
        of the configured aggregation, so the accumulated gradient equals the full-batch
        gradient.

        Args:
            batch: sequence fields plus the fields the objective reads.
            loss: objective for this step; default the engine's ``loss``.

        Returns:
            ``loss``, ``grad_norm`` (before clipping), ``lr``, ``step_skipped`` and the
            objective's metrics as token means over the global batch.

        Raises:
            EngineConfigError: if no objective is given or the batch lacks a field.
        """
        loss_fn = loss if loss is not None else self.loss
        if loss_fn is None:
            raise EngineConfigError(
                "train_step needs an objective: pass loss= here or to the engine"
            )
        rows = check_batch(batch, loss_fn.required_fields)
        batch = self._to_device(batch)
        aggregation = self.config.loss_aggregation
        mask = batch["response_mask"].to(torch.float32)
        local_normaliser = aggregation.parts(mask, mask)[1].to(torch.float64).reshape(1)
        normaliser = float(self.parallel.all_reduce_dp(local_normaliser).clamp(min=1.0))
        # FSDP averages gradients over DP ranks; scaling by dp_size turns that into the
        # sum of the ranks' parts of one global mean.
        scale = self.parallel.dp_size / normaliser

        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        stats = _StepStats(self.device)
        for rows_idx in self._plan(batch, rows):
            micro, dummy = self._micro_batch(batch, rows_idx)
            outputs = self._pad_outputs(
                self.head(self.model, build_inputs(micro), entropy_grad=loss_fn.uses_entropy),
                batch["response_ids"].shape[1],
            )
            terms = loss_fn(outputs, micro)
            numerator, _ = aggregation.parts(terms.per_token, micro["response_mask"])
            (numerator * (0.0 if dummy else scale)).backward()
            if not dummy:
                stats.add(numerator.detach() / normaliser, terms.metrics, micro["response_mask"])
        return stats.reduce(self.parallel) | self._optimizer_step()

    def _optimizer_step(self) -> dict[str, float]:
        grad_norm = clip_grad_norm(self.model.parameters(), self.config.grad_clip)
        lr = self.config.lr_at(self._step)
        skip = self.config.skip_non_finite and not math.isfinite(float(grad_norm))
        if not skip:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
            self._step += 1
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": float(grad_norm), "lr": lr, "step_skipped": float(skip)}

    # ------------------------------------------------------------------- helpers

    def _to_device(self, batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def _plan(self, batch: Mapping[str, Tensor], rows: int) -> list[Tensor]:
        if rows == 0:
            raise EngineConfigError("the batch is empty; every data-parallel rank needs >= 1 row")
        return self._planner.plan(
            token_counts(batch), agree=lambda n: self.parallel.max_over_dp(n, self.device)
        )

    @staticmethod
    def _micro_batch(batch: Mapping[str, Tensor], rows: Tensor) -> tuple[dict[str, Tensor], bool]:
        # A rank with fewer micro-batches than its DP peers still runs the same number
        # of forwards (FSDP's all-gathers are collective), on row 0 with zero weight.
        if rows.numel() == 0:
            return select_rows(batch, torch.zeros(1, dtype=torch.int64)), True
        return select_rows(batch, rows), False

    @staticmethod
    def _pad_outputs(outputs: ModelOutputs, width: int) -> ModelOutputs:
        padded = {
            f.name: pad_columns(getattr(outputs, f.name), width)
            for f in dataclasses.fields(outputs)
            if getattr(outputs, f.name) is not None
        }
        return ModelOutputs(**padded)

    # --------------------------------------------------------- checkpoints, weights

    def save(self, path: str | os.PathLike[str]) -> None:
        """Save model, optimizer, step and RNG state with torch.distributed.checkpoint.

        Collective over the mesh's ranks (which must be the default process group).

        Args:
            path: checkpoint directory, shared by all ranks.
        """
        _checkpoint.save_checkpoint(
            path, model=self.model, optimizer=self.optimizer, step=self._step
        )

    def load(self, path: str | os.PathLike[str]) -> None:
        """Restore what :meth:`save` wrote; the next step continues exactly.

        Args:
            path: checkpoint directory.

        Raises:
            EngineConfigError: if ``path`` holds no checkpoint.
        """
        self._step = _checkpoint.load_checkpoint(path, model=self.model, optimizer=self.optimizer)

    def export_hf(self, path: str | os.PathLike[str]) -> None:
        """Write a Hugging Face model directory loadable with ``from_pretrained``.

        Args:
            path: output directory (written by global rank 0).

        Raises:
            EngineConfigError: if the model is not a Hugging Face ``PreTrainedModel``.
        """
        _checkpoint.export_hf(path, self.model)

    def named_full_weights(self) -> Iterator[tuple[str, Tensor]]:
        """Yield ``(hf_name, full tensor)`` for weight sync into rollout engines.

        Collective: every rank must exhaust the iterator (DTensor shards are gathered).

        Yields:
            Full, detached tensors by the model's own (Hugging Face) names.
        """
        return _checkpoint.named_full_weights(self.model)
