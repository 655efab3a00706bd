"""Megatron-core's ``GPTModel`` for a Hugging Face Llama/Qwen2 model, over explicit
process groups, made to look like a transformers model from outside.

:func:`megatron_groups` picks the groups (a DeviceMesh's, or this rank alone) and
:func:`build_gpt` builds the model over them (``pg_collection``: Megatron's global
parallel state stays uninitialised; see :mod:`workers.engines._megatron` for why).
:class:`HFStyleGPT` wraps it: called like a transformers model, with ``config``,
``save_pretrained`` and its weights by Hugging Face names. Imported only when a
Megatron engine is built; megatron-core itself is imported inside the functions.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from workers.engines._errors import EngineConfigError
from workers.engines._megatron_weights import (
    GPTShape,
    ModelKind,
    megatron_shard_to_hf,
    megatron_tensor_to_hf,
    merge_from_tp,
    tp_split_kind,
)
from workers.engines._parallel import check_mesh

__all__ = [
    "HFStyleGPT",
    "MegatronGroups",
    "build_gpt",
    "megatron_groups",
    "padding_idx_of",
    "prepare_process",
]


# ----------------------------------------------------------------- process groups


@dataclass(frozen=True, kw_only=True)
class MegatronGroups:
    """The process groups one engine's Megatron model communicates over."""

    tp: dist.ProcessGroup
    """Tensor parallel (the mesh's "tp")."""
    pp: dist.ProcessGroup
    """Pipeline parallel (the mesh's "pp"; size 1)."""
    alone: dist.ProcessGroup
    """This rank alone: context parallelism, and every group without a mesh."""

    def collection(self) -> Any:
        """Megatron's ``ProcessGroupCollection`` of these groups."""
        from megatron.core.process_groups_config import ProcessGroupCollection

        # embd=None: pipeline stage 0 is also the last, so no embedding group syncs
        # a tied output layer.
        return ProcessGroupCollection(
            tp=self.tp, pp=self.pp, cp=self.alone, tp_cp=self.tp, embd=None, pos_embd=None
        )


def _this_rank_alone() -> dist.ProcessGroup:
    """A group of this rank only; creating it involves no other rank."""
    group = dist.new_group([dist.get_rank()], use_local_synchronization=True)
    assert group is not None  # this rank is its member
    return group


def megatron_groups(mesh: DeviceMesh | None) -> MegatronGroups:
    """The engine's groups: the mesh's, or this rank alone without one."""
    if not (dist.is_available() and dist.is_initialized()):
        raise EngineConfigError(
            "MegatronTrainingEngine needs torch.distributed initialised (Megatron's layers "
            "take process groups even on one rank): call torch.cuda.set_device(local_rank) "
            "and init_process_group('nccl') first"
        )
    alone = _this_rank_alone()
    if mesh is None:
        return MegatronGroups(tp=alone, pp=alone, alone=alone)
    check_mesh(mesh, engine="the Megatron engine (Megatron's pipeline schedules are not driven yet)")
    return MegatronGroups(tp=mesh.get_group("tp"), pp=mesh.get_group("pp"), alone=alone)


def prepare_process(seed: int, tp_rank: int) -> None:
    """What Megatron keeps per process rather than per model: its scratch buffer and
    the CUDA RNG tracker (see the module text)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    try:
        parallel_state.get_global_memory_buffer()
    except AssertionError:
        # Its one public initialiser is initialize_model_parallel (collective over the
        # world); the buffer itself is layout-free scratch memory.
        parallel_state._set_global_memory_buffer()
    model_parallel_cuda_manual_seed(seed, tp_rank=tp_rank, ep_rank=0, etp_rank=0)


# -------------------------------------------------------------------- the model


class _ValueOutputLayer(nn.Linear):
    """``Linear(hidden, 1)`` called the way ``GPTModel`` calls its output layer."""

    def forward(  # type: ignore[override]
        self, hidden: Tensor, *_: Any, **__: Any
    ) -> tuple[Tensor, None]:
        return super().forward(hidden), None


class HFStyleGPT(nn.Module):
    """A ``GPTModel`` that looks like a transformers model from outside.

    Called like one: ``(input_ids, attention_mask, position_ids)`` in, logits
    ``[B, T, V]`` (causal LM) or values ``[B, T]`` out. It also answers what roles
    ask of one: ``config`` (the source model's), ``save_pretrained`` (a full state
    dict written as the source architecture), and its weights by Hugging Face names
    (:meth:`named_full_weights`, :meth:`named_tp_shards`); its own parameters keep
    Megatron's names and tensor-parallel shards.
    """

    def __init__(
        self,
        gpt: nn.Module,
        *,
        kind: ModelKind,
        hf_config: Any,
        hf_names: list[str],
        shape: GPTShape,
        tp_group: dist.ProcessGroup,
    ) -> None:
        super().__init__()
        self.gpt = gpt
        self.kind = kind
        self.config = hf_config
        self.hf_names = hf_names
        """The source model's parameter names, in its order."""
        self.shape = shape
        self.tp_group = tp_group

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
        # The engine's precision strategy enters autocast around this call (bf16).
        out = self.gpt(input_ids, position_ids, masked_out)
        if self.kind == "value":
            return out[..., 0].float()
        return out[..., : self.shape.vocab_size]

    def _gpt_tensors(self) -> Iterator[tuple[str, Tensor]]:
        for name, tensor in self.gpt.state_dict().items():
            if not name.endswith("_extra_state"):
                yield name, tensor.detach()

    def _full(self, name: str, tensor: Tensor) -> Tensor:
        """The full tensor of this rank's shard (all-gathered over TP when split)."""
        tp = self.tp_group.size()
        shards = [tensor]
        if tp > 1 and tp_split_kind(name, self.kind) != "replicated":
            shards = [torch.empty_like(tensor) for _ in range(tp)]
            dist.all_gather(shards, tensor.contiguous(), group=self.tp_group)
        return merge_from_tp(name, shards, vocab_size=self.shape.vocab_size, kind=self.kind)

    def named_full_weights(self) -> Iterator[tuple[str, Tensor]]:
        """Full tensors by Hugging Face names (see
        :meth:`MegatronTrainingEngine.named_full_weights`; collective over TP)."""
        for name, tensor in self._gpt_tensors():
            yield from megatron_tensor_to_hf(name, self._full(name, tensor), self.shape, kind=self.kind)

    def named_tp_shards(self) -> Iterator[tuple[str, Tensor, bool]]:
        """This rank's tensor-parallel shard of every Hugging Face parameter, laid out
        as the PyTorch-native engine's tensor parallelism lays it out.

        Collective over the tensor-parallel group (vocabulary tensors, which Megatron
        pads and splits otherwise, are gathered). Parameters come in the source
        model's order, a tied LM head once (as its embedding).

        Yields:
            ``(hf_name, tensor, split)``: ``split`` says the tensor is this rank's
            part of a parameter split over the tensor-parallel ranks; otherwise it is
            the whole parameter.
        """
        tp = self.tp_group.size()
        out: dict[str, tuple[Tensor, bool]] = {}
        for name, tensor in self._gpt_tensors():
            if tp_split_kind(name, self.kind) in ("vocab", "replicated"):
                pairs = megatron_tensor_to_hf(name, self._full(name, tensor), self.shape, kind=self.kind)
                out.update((hf, (t, False)) for hf, t in pairs)
            else:
                pairs = megatron_shard_to_hf(name, tensor, self.shape, tp_size=tp, kind=self.kind)
                out.update((hf, (t, tp > 1)) for hf, t in pairs)
        for name in self.hf_names:
            tensor, split = out[name]
            yield name, tensor, split

    def save_pretrained(
        self,
        directory: str | os.PathLike[str],
        *,
        state_dict: Mapping[str, Tensor],
        safe_serialization: bool = True,
        is_main_process: bool = True,
    ) -> None:
        """Write ``state_dict`` (full tensors by Hugging Face names, as
        :meth:`MegatronTrainingEngine.named_full_weights` yields them) as a model of
        the source architecture, from this process, in safetensors.

        The keyword-only flags are those :func:`~workers.models.save_pretrained_here`
        passes to a transformers model; this process writes either way.
        """
        from transformers import AutoModel, AutoModelForCausalLM

        from workers.models import ValueModel, save_pretrained_here

        # Built on the meta device: the tensors written are state_dict's, the model
        # only says what to write them as.
        if self.kind == "value":
            with torch.device("meta"):
                value = ValueModel(AutoModel.from_config(self.config))
            # A ValueModel writes its own tensors (a backbone directory and a head file).
            value.load_state_dict(state_dict, assign=True)
            value.save_pretrained(Path(directory))
            return
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(self.config)
        save_pretrained_here(model, directory, state_dict=state_dict)


def padding_idx_of(model: nn.Module) -> int | None:
    """The source model's embedding ``padding_idx`` (a token whose embedding row gets no
    gradient from the lookup), or None."""
    embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    return None if embedding is None else embedding.padding_idx


def _keep_padding_row(embedding: nn.Module, padding_idx: int) -> None:
    """Give Megatron's word embedding ``nn.Embedding(padding_idx=...)``'s gradient: the
    lookups of ``padding_idx`` contribute none (its row still learns as a tied LM head).

    The gradient of the embedding's output is zeroed where the input is that token;
    the lookup is the only thing between the two, so this is the row's lookup part.
    """

    def hook(_: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> None:
        if output.requires_grad:
            padded = (inputs[0] == padding_idx).unsqueeze(-1)
            output.register_hook(lambda grad: grad.masked_fill(padded, 0.0))

    embedding.register_forward_hook(hook)


def _transformer_config(shape: GPTShape, tp: int, device: torch.device) -> Any:
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
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=1,
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


def build_gpt(
    shape: GPTShape,
    kind: ModelKind,
    device: torch.device,
    groups: MegatronGroups,
    *,
    padding_idx: int | None,
) -> nn.Module:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    tp = groups.tp.size()
    gpt = GPTModel(
        _transformer_config(shape, tp, device),
        get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=shape.padded_vocab_size(tp),
        max_sequence_length=shape.max_position_embeddings,
        parallel_output=False,  # gather logits over TP: the heads need the whole vocabulary
        share_embeddings_and_output_weights=kind == "causal_lm" and shape.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(shape.rope_theta),
        pg_collection=groups.collection(),
    )
    if kind == "value":
        gpt.output_layer = _ValueOutputLayer(shape.hidden_size, 1)
    if padding_idx is not None:
        _keep_padding_row(gpt.embedding.word_embeddings, padding_idx)
    return gpt.to(device)
