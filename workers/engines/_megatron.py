"""Megatron-core training engine: :class:`TrainingEngine`'s API on a Megatron ``GPTModel``.

For GPU machines (megatron-core, the ``gpu`` extra), imported only when an engine is
created. The engine takes the model TrainingEngine takes (a Llama/Qwen2 causal LM or
a :class:`~workers.models.ValueModel`), builds a ``GPTModel`` from Megatron's own
layers (the "local" spec: no Transformer Engine or Apex), copies the weights into it
sharded over ``megatron.core.parallel_state``'s tensor-parallel group, and runs
TrainingEngine's heads, objectives, loss aggregation and micro-batching on it.
Data-parallel groups pass their own rows and average gradients once per step, so a
step equals one full-batch step. Pipeline parallelism is rejected for now (it needs
Megatron's pipeline schedules).

The weight conversion (Hugging Face names and layouts to Megatron's, and
tensor-parallel shards) is :mod:`workers.engines._megatron_weights`, re-exported
here.

Megatron's RoPE counts positions from the first column rather than from each row's
first real token; rotary attention depends only on query-key distances and a row's
real tokens are contiguous, so the shift changes no result.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn

from workers.engines import _checkpoint
from workers.engines._checkpoint import Generators
from workers.engines._config import TrainingConfig
from workers.engines._engine import TrainingEngine
from workers.engines._errors import EngineConfigError
from workers.engines._heads import CausalLMHead, ModelHead, ValueHead
from workers.engines._megatron_weights import (
    GPTShape,
    ModelKind,
    hf_to_megatron,
    megatron_tensor_to_hf,
    megatron_to_hf,
    merge_from_tp,
    split_for_tp,
    tp_split_kind,
)
from workers.engines._objectives import LossFn
from workers.engines._parallel import Parallelism

__all__ = [
    "GPTShape",
    "MegatronConfig",
    "MegatronTrainingEngine",
    "hf_to_megatron",
    "megatron_tensor_to_hf",
    "megatron_to_hf",
    "merge_from_tp",
    "split_for_tp",
]


@dataclass(frozen=True, kw_only=True)
class MegatronConfig:
    """Parallel layout and precision of a :class:`MegatronTrainingEngine`."""

    tensor_parallel: int = 1
    """Tensor-parallel size; must divide the head and query-group counts."""
    pipeline_parallel: int = 1
    """Pipeline-parallel size; only 1 is supported for now."""
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the forward and backward (autocast); parameters and optimizer stay
    float32. float32 keeps log-probs within 1e-3 of the rollout engines'."""
    seed: int = 0
    """Seed of Megatron's model-parallel CUDA RNG tracker (dropout; the engine runs
    without dropout, but Megatron's attention needs the tracker)."""

    def __post_init__(self) -> None:
        for name in ("tensor_parallel", "pipeline_parallel"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise EngineConfigError(f"MegatronConfig.{name} must be an int >= 1, got {value!r}")
        if self.pipeline_parallel != 1:
            raise EngineConfigError(
                "MegatronConfig.pipeline_parallel must be 1: pipeline parallelism needs "
                "Megatron's pipeline schedules, which this engine does not drive yet"
            )
        if self.compute_dtype not in ("float32", "bfloat16"):
            raise EngineConfigError(
                f"MegatronConfig.compute_dtype must be 'float32' or 'bfloat16', got "
                f"{self.compute_dtype!r}"
            )


def _import_megatron() -> Any:
    try:
        from megatron.core import parallel_state
    except ImportError as err:
        raise EngineConfigError(
            "MegatronTrainingEngine needs megatron-core: pip install megatron-core "
            "(asyncflow's 'gpu' extra), or use TrainingEngine"
        ) from err
    return parallel_state


def _model_kind(model: nn.Module) -> ModelKind:
    if hasattr(model, "lm_head"):
        return "causal_lm"
    if hasattr(model, "backbone") and hasattr(model, "head"):
        return "value"
    raise EngineConfigError(
        f"MegatronTrainingEngine takes a Llama/Qwen2 causal LM or a ValueModel, got "
        f"{type(model).__name__}"
    )


class _ValueOutputLayer(nn.Linear):
    """``Linear(hidden, 1)`` called the way ``GPTModel`` calls its output layer."""

    def forward(  # type: ignore[override]
        self, hidden: Tensor, *_: Any, **__: Any
    ) -> tuple[Tensor, None]:
        return super().forward(hidden), None


class _HFStyleGPT(nn.Module):
    """A ``GPTModel`` called like a transformers model: ``(input_ids, attention_mask,
    position_ids)`` in, logits ``[B, T, V]`` (causal LM) or values ``[B, T]`` out."""

    def __init__(
        self, gpt: nn.Module, *, kind: ModelKind, vocab_size: int, compute_dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.gpt = gpt
        self.kind = kind
        self.vocab_size = vocab_size
        self.compute_dtype = compute_dtype

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
    ) -> Tensor:
        """Logits over the real vocabulary, or float32 values."""
        rows, length = input_ids.shape
        device = input_ids.device
        real = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        if position_ids is None:
            position_ids = torch.arange(length, device=device).expand(rows, length)
        causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
        # Megatron's mask convention: True = masked out.
        masked_out = ~(causal[None, None] & real.bool()[:, None, None, :])
        low_precision = self.compute_dtype != torch.float32
        with torch.autocast(device.type, dtype=self.compute_dtype, enabled=low_precision):
            out = self.gpt(input_ids, position_ids, masked_out)
        if self.kind == "value":
            return out[..., 0].float()
        return out[..., : self.vocab_size]


def _transformer_config(shape: GPTShape, settings: MegatronConfig, device: torch.device) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim,
        ffn_hidden_size=shape.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=shape.norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=settings.tensor_parallel,
        pipeline_model_parallel_size=settings.pipeline_parallel,
        params_dtype=torch.float32,
        # The weights come from the HF model: skip Megatron's random initialisation.
        perform_initialization=False,
        use_cpu_initialization=device.type == "cpu",
        # Fused kernels need Apex or Transformer Engine; the local spec runs without.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
    )


def _build_gpt(
    shape: GPTShape, settings: MegatronConfig, kind: ModelKind, device: torch.device
) -> nn.Module:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    gpt = GPTModel(
        _transformer_config(shape, settings, device),
        get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=shape.padded_vocab_size(settings.tensor_parallel),
        max_sequence_length=shape.max_position_embeddings,
        parallel_output=False,  # gather logits over TP: the heads need the whole vocabulary
        share_embeddings_and_output_weights=kind == "causal_lm" and shape.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(shape.rope_theta),
    )
    if kind == "value":
        gpt.output_layer = _ValueOutputLayer(shape.hidden_size, 1)
    return gpt.to(device)


class _MegatronParallel(Parallelism):
    """Parallelism's data-parallel interface over Megatron's DP group (no DeviceMesh)."""

    def __init__(self, parallel_state: Any, device: torch.device) -> None:
        super().__init__(None, device=device)
        self._ps = parallel_state

    @property
    def dp_size(self) -> int:
        """Number of data-parallel groups."""
        return int(self._ps.get_data_parallel_world_size())

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel group index."""
        return int(self._ps.get_data_parallel_rank())

    def all_reduce_dp(
        self, tensor: Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
    ) -> Tensor:
        """Reduce ``tensor`` in place over the data-parallel group (no-op without DP)."""
        if self.dp_size > 1:
            dist.all_reduce(tensor, op=op, group=self._ps.get_data_parallel_group())
        return tensor


class MegatronTrainingEngine(TrainingEngine):
    """Trains one Llama/Qwen2 model (causal LM or value model) as a Megatron ``GPTModel``.

    :meth:`log_probs`, :meth:`values` and :meth:`train_step` are TrainingEngine's, run
    on the Megatron model behind a transformers-style call; what differs is the
    layout (Megatron's TP layers and groups), gradient synchronisation, the gradient
    norm, checkpoints and weight export. Every rank of the default process group
    calls each method together.

    Args:
        model: a Llama/Qwen2 causal LM or a ``ValueModel``, identical on every rank;
            its weights are copied (sharded) into the Megatron model, it is not kept.
        config: optimizer, schedule and micro-batching settings (as TrainingEngine).
        megatron: the parallel layout and precision.
        head: :class:`CausalLMHead` or :class:`ValueHead`; default by the model's kind.
        loss: the default objective of :meth:`train_step`.

    Raises:
        EngineConfigError: without megatron-core or a default process group, for a
            layout that does not fit the world or the model, or an unsupported model.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        config: TrainingConfig,
        megatron: MegatronConfig | None = None,
        head: ModelHead | None = None,
        loss: LossFn | None = None,
    ) -> None:
        self.megatron = megatron if megatron is not None else MegatronConfig()
        self._ps = _import_megatron()
        self._init_groups()
        self.kind = _model_kind(model)
        self.hf_config = model.config
        self.shape = GPTShape.from_hf_config(model.config)
        self._check_divisible()
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        gpt = _build_gpt(self.shape, self.megatron, self.kind, device)
        self._load_full(gpt, hf_to_megatron(model.state_dict(), self.shape, kind=self.kind))
        # Megatron marks sharded parameters only when it initialises them itself
        # (perform_initialization), so the engine tells them apart by name.
        self._sharded = {
            id(param)
            for name, param in gpt.named_parameters()
            if tp_split_kind(name, self.kind) != "replicated"
        }
        wrapped = _HFStyleGPT(
            gpt,
            kind=self.kind,
            vocab_size=self.shape.vocab_size,
            compute_dtype=getattr(torch, self.megatron.compute_dtype),
        )
        default_head: ModelHead = CausalLMHead() if self.kind == "causal_lm" else ValueHead()
        # Without a mesh TrainingEngine keeps the model as it is (already laid out by
        # Megatron) and builds the optimizer; its DP reductions then go to Megatron's group.
        super().__init__(wrapped, config=config, head=head or default_head, loss=loss)
        self.parallel = _MegatronParallel(self._ps, device)

    # ---------------------------------------------------------------- layout

    def _init_groups(self) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise EngineConfigError(
                "MegatronTrainingEngine needs torch.distributed initialised: call "
                "torch.cuda.set_device(local_rank) and init_process_group('nccl') first"
            )
        tp, pp = self.megatron.tensor_parallel, self.megatron.pipeline_parallel
        if dist.get_world_size() % (tp * pp):
            raise EngineConfigError(
                f"MegatronConfig tensor_parallel * pipeline_parallel = {tp * pp} must divide "
                f"the world size {dist.get_world_size()}"
            )
        ps = self._ps
        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(
                tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp
            )
            if torch.cuda.is_available():
                from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

                model_parallel_cuda_manual_seed(self.megatron.seed)
        elif ps.get_tensor_model_parallel_world_size() != tp:
            raise EngineConfigError(
                f"megatron parallel_state is already initialised with tensor parallel size "
                f"{ps.get_tensor_model_parallel_world_size()}, MegatronConfig asks for {tp}"
            )

    def _check_divisible(self) -> None:
        tp = self.megatron.tensor_parallel
        for name in ("num_heads", "num_kv_heads"):
            if getattr(self.shape, name) % tp:
                raise EngineConfigError(
                    f"MegatronConfig.tensor_parallel={tp} must divide the model's {name}="
                    f"{getattr(self.shape, name)}"
                )

    @property
    def tp_rank(self) -> int:
        """This rank's position in its tensor-parallel group."""
        return int(self._ps.get_tensor_model_parallel_rank())

    def _load_full(self, gpt: nn.Module, full: Mapping[str, Tensor]) -> None:
        """Copy this rank's TP shard of every full Megatron tensor into ``gpt``."""
        tp, rank = self.megatron.tensor_parallel, self.tp_rank
        targets = {n: t for n, t in gpt.state_dict().items() if not n.endswith("_extra_state")}
        if missing := sorted(set(targets) - set(full)):
            raise EngineConfigError(f"no weights for Megatron tensors {missing}")
        with torch.no_grad():
            for name, target in targets.items():
                shard = split_for_tp(
                    name, full[name], tp_size=tp, vocab_size=self.shape.vocab_size, kind=self.kind
                )[rank]
                if tuple(shard.shape) != tuple(target.shape):
                    raise EngineConfigError(
                        f"Megatron tensor {name!r}: shard shape {tuple(shard.shape)} does not "
                        f"match the model's {tuple(target.shape)}"
                    )
                target.copy_(shard)

    # ------------------------------------------------------------------ step

    def _clip_gradients(self) -> float:
        # TrainingEngine scales each DP rank's loss by dp_size / (global normaliser),
        # expecting FSDP's gradient average over DP: average, then the TP-aware norm.
        dp = self.parallel.dp_size
        if dp > 1:
            for param in self.model.parameters():
                if param.grad is not None:
                    self.parallel.all_reduce_dp(param.grad).div_(dp)
        grad_norm = float(self._grad_norm())
        clip = self.config.grad_clip
        if clip and math.isfinite(grad_norm) and grad_norm > clip:
            for param in self.model.parameters():
                if param.grad is not None:
                    param.grad.mul_(clip / (grad_norm + 1e-6))
        return grad_norm

    def _position_limit(self) -> int | None:
        return self.shape.max_position_embeddings

    def _grad_norm(self) -> Tensor:
        """Total gradient norm: each TP shard counted once, replicated tensors once."""
        squares = torch.zeros((), dtype=torch.float64, device=self.device)
        for param in self.model.parameters():
            if param.grad is not None and (id(param) in self._sharded or self.tp_rank == 0):
                squares = squares + param.grad.detach().double().pow(2).sum()
        if self.megatron.tensor_parallel > 1:
            dist.all_reduce(squares, group=self._ps.get_tensor_model_parallel_group())
        return squares.sqrt()

    # ---------------------------------------------------- checkpoints, weights

    def _checkpoint_file(self, path: str | os.PathLike[str]) -> Path:
        return Path(path) / f"tp{self.tp_rank:03d}_of_{self.megatron.tensor_parallel:03d}.pt"

    def save(self, path: str | os.PathLike[str], *, generators: Generators | None = None) -> None:
        """Save model shards, optimizer, step and RNG states (collective).

        Data-parallel rank 0 of each TP rank writes its shard; every rank writes its
        RNG states. Loading needs the same tensor-parallel size (:meth:`export_hf`
        writes a layout-free copy).

        Args:
            path: checkpoint directory, shared by all ranks.
            generators: the caller's own generators, saved with the RNG states.
        """
        directory = Path(path)
        (directory / "rng").mkdir(parents=True, exist_ok=True)
        if self._ps.get_data_parallel_rank() == 0:  # DP ranks hold equal copies
            model, optim = self.model.state_dict(), self.optimizer.state_dict()
            state = {"model": model, "optim": optim, "step": self._step}
            torch.save(state, self._checkpoint_file(directory))
        _checkpoint.save_rng(directory, group=dist.group.WORLD, generators=generators)
        dist.barrier()

    def load(self, path: str | os.PathLike[str], *, generators: Generators | None = None) -> None:
        """Restore what :meth:`save` wrote (same tensor-parallel size; collective).

        Args:
            path: checkpoint directory.
            generators: the caller's generators, restored in place when saved.

        Raises:
            EngineConfigError: if ``path`` holds no checkpoint for this layout.
        """
        file = self._checkpoint_file(path)
        if not file.is_file():
            raise EngineConfigError(
                f"no checkpoint {file.name} in {os.fspath(path)!r}; pass a directory written "
                f"by MegatronTrainingEngine.save with tensor_parallel="
                f"{self.megatron.tensor_parallel}"
            )
        state = torch.load(file, map_location=self.device, weights_only=False)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])
        self._step = int(state["step"])
        _checkpoint.load_rng(path, group=dist.group.WORLD, generators=generators)
        dist.barrier()

    def named_full_weights(self) -> Iterator[tuple[str, Tensor]]:
        """Yield ``(hf_name, full tensor)`` for weight sync into rollout engines.

        Collective: every rank must exhaust the iterator (TP shards are all-gathered).

        Yields:
            Full, detached tensors by Hugging Face names, on the engine's device.
        """
        tp = self.megatron.tensor_parallel
        group = self._ps.get_tensor_model_parallel_group()
        assert isinstance(self.model, _HFStyleGPT)
        for name, tensor in self.model.gpt.state_dict().items():
            if name.endswith("_extra_state"):
                continue
            shards = [tensor.detach()]
            if tp > 1 and tp_split_kind(name, self.kind) != "replicated":
                shards = [torch.empty_like(tensor) for _ in range(tp)]
                dist.all_gather(shards, tensor.detach().contiguous(), group=group)
            full = merge_from_tp(name, shards, vocab_size=self.shape.vocab_size, kind=self.kind)
            yield from megatron_tensor_to_hf(name, full, self.shape, kind=self.kind)

    def export_hf(
        self, path: str | os.PathLike[str], *, save: _checkpoint.ExportWriter | None = None
    ) -> None:
        """Write a Hugging Face directory (global rank 0 writes; collective).

        Args:
            path: output directory.
            save: writes the gathered state dict (default: a model of the source config).
        """
        state = {name: t.cpu() for name, t in self.named_full_weights()}
        if dist.get_rank() == 0 and save is not None:
            Path(path).mkdir(parents=True, exist_ok=True)
            save(state, Path(path))
        elif dist.get_rank() == 0:
            from transformers import AutoModel, AutoModelForCausalLM

            from workers.models import ValueModel

            if self.kind == "value":
                value = ValueModel(AutoModel.from_config(self.hf_config))
                value.load_state_dict(state)
                value.save_pretrained(Path(path))
            else:
                lm = AutoModelForCausalLM.from_config(self.hf_config)
                lm.load_state_dict(state, strict=False)
                lm.save_pretrained(os.fspath(path))
        dist.barrier()
