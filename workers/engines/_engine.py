"""The PyTorch-native training engine: forward passes and optimizer steps on one role's model.

One :class:`TrainingEngine` per role (actor, critic, reference): the model, a head
(causal LM log-probs or value-model values), an objective, AdamW, and a
:class:`Parallelism` that lays the model out over a ``("pp", "dp", "tp")`` DeviceMesh.

Data contract: every rank of the mesh calls each method together (the methods are
collectives); ranks of one data-parallel group pass the same rows, different
data-parallel groups pass their own slices of the global batch, any of which may be
empty. A rank without rows (or with fewer micro-batches than a peer) runs a dummy
row that weighs nothing, so it takes part in every collective. Losses and metrics
are normalised over the global batch: a train step equals one full-batch step on
the union of the slices, whatever the micro-batching and however rows are spread.

Precision (``TrainingConfig.precision``) is a strategy object consulted before the
layout and around each forward (:mod:`workers.engines._precision`). Where the state
lives and how it persists (offloading to host memory between calls, checkpoints,
Hugging Face export, full weights) is the engine's base,
:class:`~workers.engines._state.EngineState`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping
from typing import Literal, overload

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from workers.engines._activation_checkpointing import enable_activation_checkpointing
from workers.engines._batch import (
    build_inputs,
    check_batch,
    row_lengths,
)
from workers.engines._config import TrainingConfig
from workers.engines._errors import EngineConfigError
from workers.engines._heads import CausalLMHead, ModelHead
from workers.engines._layout import ModelLayout, WholeModel
from workers.engines._micro_batches import (
    PreparedStep,
    StepStats,
    agreed_plan,
    collect_outputs,
    micro_batch,
    pad_outputs,
    zero_objective,
)
from workers.engines._offload import Offloader
from workers.engines._optimizer import build_adamw, take_step
from workers.engines._parallel import Parallelism, TensorParallelPlan
from workers.engines._pipelined import PipelineStages
from workers.engines._precision import PrecisionName, precision_strategy, resolve_precision
from workers.engines._state import EngineState
from workers.objectives import LossFn, ModelOutputs


class TrainingEngine(EngineState):
    """Trains (and evaluates) one model with AdamW, micro-batching and a parallel layout.

    Example:
        >>> engine = TrainingEngine(model, config=TrainingConfig(lr=1e-5), loss=PolicyLoss())
        >>> logprobs, entropy = engine.log_probs(batch)
        >>> metrics = engine.train_step(batch | {"old_logprobs": logprobs, "advantages": adv})
        >>> engine.offload()  # free the GPU for generation; engine.reload() before training
        >>> ref = TrainingEngine(ref_model, config=TrainingConfig(), trainable=False)
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
        process_group: dist.ProcessGroup | None = None,
        trainable: bool = True,
    ) -> None:
        """Lay the model out over the mesh and build its optimizer.

        Args:
            model: a causal LM or a value model, identical on every rank (same seed or
                same weights); it is sharded in place.
            config: optimizer, schedule and micro-batching settings.
            mesh: a ``("pp", "dp", "tp")`` DeviceMesh (gloo on CPU, NCCL on GPU; on GPU
                call ``torch.cuda.set_device(local_rank)`` first), or None for one
                process on the model's device. With ``pp`` above 1 each rank keeps
                its pipeline stage's layers (``config.pipeline_chunks`` pieces) and
                the calls run as pipelines (tested over gloo).
            head: :class:`CausalLMHead` (default) or :class:`ValueHead`.
            loss: the default objective of :meth:`train_step`.
            tp_plan: which layers tensor parallelism shards (Llama-style default).
            process_group: the group spanning the mesh's ranks, over which
                :meth:`save`, :meth:`load` and :meth:`export_hf` are collective (a role
                passes its pool's group). Default: the default process group with a
                mesh, no group without one.
            trainable: False for an inference-only engine (a reference or reward
                model): no optimizer is built, the parameters stop requiring gradients,
                :meth:`train_step` raises, activation checkpointing does not apply, and
                under bf16 precision the parameters themselves are cast to bfloat16
                (half the memory; buffers keep their dtype). Outputs stay float32.

        Raises:
            EngineConfigError: for an invalid mesh (names), a model whose head counts
                ``tp`` does not divide, pipeline stages the model cannot fill,
                ``precision="bf16"`` on a GPU without bfloat16, or activation
                checkpointing on a model without transformers' gradient checkpointing.
        """
        self.config = config
        self.parallel = Parallelism(mesh, tp_plan=tp_plan)
        if process_group is None and mesh is not None:
            process_group = dist.group.WORLD
        self.process_group = process_group
        self.device = self.parallel.device_for(model)
        self.trainable = trainable
        replicate = config.replicates(sum(p.numel() for p in model.parameters()))
        self._precision = precision_strategy(
            resolve_precision(config.precision, self.device),
            device=self.device,
            trainable=trainable,
            sharded=self.parallel.shards(replicate=replicate),
        )
        # Order: the dtype and the recompute wrapping are settled on the whole model,
        # before TP and FSDP2 split it (FSDP2 shards whatever dtype it finds).
        self._precision.prepare(model)
        if not trainable:
            model.requires_grad_(False)
        elif config.activation_checkpointing:
            enable_activation_checkpointing(model)
        # Pipeline stages: the rank keeps its stages' layers only, each laid out alone.
        self._layout: ModelLayout = (
            PipelineStages(model, mesh=mesh, chunks=config.pipeline_chunks, reverse=config.pipeline_reversed)
            if mesh is not None and self.parallel.pp_size > 1 else WholeModel(model))
        for part in self._layout.parts():
            self.parallel.parallelize(part, replicate=replicate, mp_policy=self._precision.fsdp_policy(),
                                      units=self._layout.called_apart(part))
        self.model: nn.Module = model  # with stages: cut down to this rank's, same names
        self.head: ModelHead = head if head is not None else CausalLMHead()
        self.loss = loss
        self._planner = config.micro_batch_planner()
        self.optimizer: torch.optim.Optimizer | None = (
            build_adamw(self.model, config, self.device) if trainable else None
        )
        self._offloader = Offloader(self.model, self.optimizer, device=self.device)
        self._step = 0

    @property
    def precision(self) -> PrecisionName:
        """The resolved ``TrainingConfig.precision``: ``"fp32"`` or ``"bf16"``."""
        return self._precision.name

    @property
    def step(self) -> int:
        """Optimizer steps taken (restored by :meth:`load`)."""
        return self._step

    @property
    def infers_alone(self) -> bool:
        """Whether :meth:`log_probs` and :meth:`values` use no other rank: the whole
        model is on this rank (one data-parallel rank, or replicated over them) and
        neither tensor nor pipeline parallelism splits it. A role may then declare
        those methods rank-local (``Role.rank_local``)."""
        p = self.parallel
        return p.tp_size == 1 and p.pp_size == 1 and (p.replicated or p.dp_size == 1)

    # ----------------------------------------------------------------- forward only

    @overload
    def log_probs(
        self, batch: Mapping[str, Tensor], *, temperature: float = 1.0, entropy: Literal[True] = True
    ) -> tuple[Tensor, Tensor]: ...

    @overload
    def log_probs(
        self, batch: Mapping[str, Tensor], *, temperature: float = 1.0, entropy: Literal[False]
    ) -> tuple[Tensor, None]: ...

    def log_probs(
        self, batch: Mapping[str, Tensor], *, temperature: float = 1.0, entropy: bool = True
    ) -> tuple[Tensor, Tensor | None]:
        """Log-probs and entropy of the response tokens, without gradients.

        Args:
            batch: sequence fields (``prompt_ids``, ``prompt_mask``, ``response_ids``,
                ``response_mask``); may have 0 rows.
            temperature: divides the logits (1.0 = the rollout engines' raw log-probs).
            entropy: also compute the entropy (False: None in its place, and one pass
                over the logits fewer).

        Returns:
            ``(logprobs, entropy)``, float32 ``[B, R]`` on the engine's device, 0 on padding.

        Raises:
            EngineConfigError: if the engine's head is not a :class:`CausalLMHead`, the
                batch lacks a field, or a row is longer than the model's
                ``max_position_embeddings`` (raised on every rank alike).
        """
        if not isinstance(self.head, CausalLMHead):
            raise EngineConfigError(
                f"log_probs needs an engine built with head=CausalLMHead(), this one has "
                f"{type(self.head).__name__}"
            )
        head = dataclasses.replace(self.head, temperature=temperature, with_entropy=entropy)
        outputs = self._infer(batch, head)
        return outputs.require("logprobs"), outputs.require("entropy") if entropy else None

    def values(self, batch: Mapping[str, Tensor]) -> Tensor:
        """Value predictions for the response positions, without gradients.

        Args:
            batch: sequence fields; may have 0 rows.

        Returns:
            float32 ``[B, R]``, 0 on padding.

        Raises:
            EngineConfigError: if the head does not produce values (use ``ValueHead()``),
                or as :meth:`log_probs`.
        """
        return self._infer(batch, self.head).require("values")

    def _infer(self, batch: Mapping[str, Tensor], head: ModelHead) -> ModelOutputs:
        self._require_resident("log_probs/values", optimizer=False)
        rows = check_batch(batch)
        batch = self._to_device(batch)
        plan = agreed_plan(self._planner, row_lengths(batch), self.parallel, torch.zeros((), device=self.device),
                           over_dp=not self.parallel.replicated)
        self._check_positions(plan.longest)
        shape = (rows, batch["response_ids"].shape[1])
        results: dict[str, Tensor] = {}
        micros = [(micro_batch(batch, rows_idx), rows_idx) for rows_idx in plan.micro_batches]
        inputs = [build_inputs(micro) for (micro, _), _ in micros]

        def run(module: nn.Module, k: int) -> None:
            (micro, dummy), rows_idx = micros[k]
            with self._precision.context():
                outputs = head(module, inputs[k], entropy_grad=False)
            collect_outputs(results, outputs, None if dummy else rows_idx, micro, shape, self.device)

        was_training = self.model.training
        self._set_training(False)
        try:
            self._layout.forward(inputs, run, context=contextlib.nullcontext)
            results = self._layout.from_last(results)
        finally:
            self._set_training(was_training)
        return ModelOutputs(**results)

    # ----------------------------------------------------------------------- train

    def train_step(
        self, batch: Mapping[str, Tensor], *, loss: LossFn | None = None
    ) -> dict[str, float]:
        """One optimizer step on ``batch`` (this rank's data-parallel slice, maybe empty).

        Micro-batch losses are scaled by the global (all data-parallel ranks, all
        micro-batches) normaliser of the aggregation (the objective's ``loss_agg``, else
        ``TrainingConfig.loss_aggregation``), so the accumulated gradient equals the
        full-batch gradient whatever the layout and the micro-batching. The step is
        skipped on every rank alike when the global loss or the gradient norm is not
        finite (see ``TrainingConfig.skip_non_finite``), and when no rank has a row.

        Args:
            batch: sequence fields plus the fields the objective reads.
            loss: objective for this step; default the engine's ``loss``.

        Returns:
            ``loss``, ``grad_norm`` (before clipping), ``lr``, ``step_skipped`` (1.0 or
            0.0) and the objective's metrics as token means over the global batch; equal
            on every rank.

        Raises:
            EngineConfigError: if no objective is given, the engine is inference-only
                (``trainable=False``) or offloaded (call :meth:`reload`), or as
                :meth:`log_probs`.
        """
        step = self._prepare_step(batch, loss)
        self._layout.train(step.inputs, step.micro_loss, context=self._precision.context)
        return self._finish_step(step)

    def _prepare_step(self, batch: Mapping[str, Tensor], loss: LossFn | None) -> PreparedStep:
        """Everything of :meth:`train_step` before the forwards and backwards."""
        optimizer = self._trainable_optimizer("train_step")
        loss_fn = loss if loss is not None else self.loss
        if loss_fn is None:
            raise EngineConfigError(
                "train_step needs an objective: pass loss= here or to the engine"
            )
        check_batch(batch, loss_fn.required_fields)
        batch = self._to_device(batch)
        aggregation = loss_fn.loss_agg or self.config.loss_aggregation
        mask = batch["response_mask"].to(torch.float32)
        # Sharded: one collective agrees on the micro-batch count, sums the loss
        # normaliser and finds the longest row. Replicated: the forwards talk to no
        # other rank, so each plans alone and the normaliser's sum comes with the
        # gradients' all-reduce (the losses stay unnormalised until then).
        deferred = self.parallel.replicated
        plan = agreed_plan(self._planner, row_lengths(batch), self.parallel, aggregation.parts(mask, mask)[1],
                           over_dp=not deferred)
        self._check_positions(plan.longest)
        normaliser = 1.0 if deferred else max(plan.total, 1.0)
        # FSDP averages gradients over DP ranks; scaling by dp_size turns that into the
        # sum of the ranks' parts of one global mean.
        scale = 1.0 if deferred else self.parallel.dp_size / normaliser

        self._set_training(True)
        optimizer.zero_grad(set_to_none=True)
        stats = StepStats(self.device)
        micros = [micro_batch(batch, rows_idx) for rows_idx in plan.micro_batches]
        inputs = [build_inputs(micro) for micro, _ in micros]

        def micro_loss(module: nn.Module, k: int) -> Tensor:
            micro, dummy = micros[k]
            # Only the forward runs under the precision context (autocast's rule: the
            # backward follows the forward's dtypes); the objective computes in float32.
            with self._precision.context():
                raw = self.head(module, inputs[k], entropy_grad=loss_fn.uses_entropy)
            outputs = pad_outputs(raw, micro["response_ids"].shape[1])
            if dummy:
                # Same forward and backward as a real micro-batch (FSDP's collectives),
                # but zero gradient; the loss still names the metrics every rank reports.
                with torch.no_grad():
                    stats.add(loss_fn(outputs, micro), micro["response_mask"], loss=None)
                return zero_objective(outputs)
            terms = loss_fn(outputs, micro)
            numerator, _ = aggregation.parts(terms.per_token, micro["response_mask"])
            stats.add(terms, micro["response_mask"], loss=numerator / normaliser)
            return numerator * scale

        return PreparedStep(optimizer=optimizer, inputs=inputs, micro_loss=micro_loss, stats=stats,
                            rows=plan.rows, local_normaliser=plan.total if deferred else None)

    def _finish_step(self, step: PreparedStep) -> dict[str, float]:
        """Everything of :meth:`train_step` after the backwards: the gradients reduced
        and clipped, the metrics reduced, the optimizer stepped."""
        # Sharded (FSDP2), the backward reduced the gradients already.
        ridden, rows = None, step.rows
        if step.local_normaliser is not None:  # replicated: the normaliser, rows and metrics ride along
            sums, maxima = step.stats.packed()
            summed, maxed = self.parallel.normalise_gradients(
                self.model, torch.cat([sums.new_tensor([step.local_normaliser, step.rows]), sums]), maxima)
            rows = int(summed[1])
            ridden = step.stats.unpack(summed[2:], maxed, normaliser=max(float(summed[0]), 1.0))
        self._layout.sum_tied_gradients()
        stats = step.stats.reduce(self.parallel) if ridden is None else ridden
        # The last stage computed the loss and metrics.
        reduced = self._layout.from_last(stats)
        # ``loss`` is DP-reduced and the norm covers every shard, so every rank takes the
        # same decision.
        grad_norm = self._layout.clip_gradients(self.config.grad_clip)
        stepped = take_step(step.optimizer, self.config, self._step, loss=reduced["loss"], grad_norm=grad_norm,
                            empty=rows == 0)
        if not stepped["step_skipped"]:
            self._step += 1
        return reduced | stepped

    # ------------------------------------------------------------------- helpers

    def _set_training(self, training: bool) -> None:
        """The model in training or eval mode; ``nn.Module.train`` visits every
        submodule (about 0.35 ms for a small Llama), so only when the mode changes
        (the engine is the only one to set it)."""
        if self.model.training != training:
            self.model.train(training)

    def _to_device(self, batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def _position_limit(self) -> int | None:
        """The model's longest sequence (``config.max_position_embeddings``), if it says."""
        limit = getattr(getattr(self.model, "config", None), "max_position_embeddings", None)
        return limit if isinstance(limit, int) and not isinstance(limit, bool) else None

    def _check_positions(self, longest: int) -> None:
        """Raise if the longest row over the data-parallel ranks (agreed on with the
        plan) outgrows the model's positions: every rank raises, or none does (a rank
        that raised alone would leave its peers waiting in the next collective). A
        replicated model checks its own rows: its forwards wait for no peer, and a
        rank that raises before the gradients' all-reduce poisons its groups on the
        way out, which fails that all-reduce on its peers at once
        (:mod:`workers.host._groups`)."""
        limit = self._position_limit()
        if limit is not None and longest > limit:
            raise EngineConfigError(
                f"a row has {longest} prompt + response tokens, but the model's "
                f"max_position_embeddings is {limit}; shorten the prompts or lower "
                "max_new_tokens so that prompt + response fits"
            )
