"""Hugging Face <-> Megatron-core weights: names, layouts and tensor-parallel shards.

:func:`hf_to_megatron` / :func:`megatron_to_hf` map full Hugging Face tensors to
Megatron's names and layouts and back (q/k/v fused per query group into
``linear_qkv``, gate/up into ``linear_fc1``); :func:`split_for_tp` /
:func:`merge_from_tp` cut full tensors into tensor-parallel shards and join them;
:func:`megatron_shard_to_hf` turns one rank's shard of a split tensor into the
Hugging Face tensors' shards that the PyTorch-native engine's tensor parallelism
gives the same rank (how the actor publishes its weights without gathering them).
Plain tensor code, usable and tested without megatron-core; the engine
(:mod:`workers.engines._megatron`) builds on it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
from torch import Tensor

from workers.engines._errors import EngineConfigError

__all__ = [
    "VOCAB_PAD_MULTIPLE",
    "GPTShape",
    "ModelKind",
    "hf_to_megatron",
    "megatron_shard_to_hf",
    "megatron_tensor_to_hf",
    "megatron_to_hf",
    "merge_from_tp",
    "split_for_tp",
    "tp_split_kind",
]

ModelKind = Literal["causal_lm", "value"]

VOCAB_PAD_MULTIPLE = 128
"""The vocabulary is padded to a multiple of this times the TP size (Megatron's default)."""

_HF_PREFIX: dict[ModelKind, str] = {"causal_lm": "model.", "value": "backbone."}
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")

# ------------------------------------------------------------------ model shape


@dataclass(frozen=True, kw_only=True)
class GPTShape:
    """The sizes both naming schemes need: a Llama/Qwen2 decoder."""

    vocab_size: int
    """Real (unpadded) vocabulary size."""
    hidden_size: int
    """Width of the residual stream."""
    num_layers: int
    """Number of decoder layers."""
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads (query groups)."""
    head_dim: int
    """Size of one head."""
    ffn_hidden_size: int
    """Width of the gated MLP."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    rope_theta: float = 10000.0
    """RoPE base."""
    max_position_embeddings: int = 4096
    """Longest sequence."""
    tie_word_embeddings: bool = False
    """Whether the LM head shares the input embedding."""
    qkv_bias: bool = False
    """Whether q/k/v projections have biases (Qwen2)."""

    @classmethod
    def from_hf_config(cls, config: Any) -> GPTShape:
        """Read the shape from a transformers ``LlamaConfig`` or ``Qwen2Config``.

        Args:
            config: the model's transformers config.

        Returns:
            The shape.

        Raises:
            EngineConfigError: for another architecture or a RoPE scaling other than
                the default.
        """
        model_type = getattr(config, "model_type", None)
        if model_type not in ("llama", "qwen2"):
            raise EngineConfigError(
                f"MegatronTrainingEngine supports Llama and Qwen2 models, got model_type "
                f"{model_type!r}"
            )
        rope = dict(getattr(config, "rope_parameters", None) or {})
        if rope.get("rope_type", "default") != "default":
            raise EngineConfigError(
                f"MegatronTrainingEngine supports the default RoPE only, the config has "
                f"rope_type {rope['rope_type']!r}"
            )
        heads = int(config.num_attention_heads)
        hidden = int(config.hidden_size)
        return cls(
            vocab_size=int(config.vocab_size),
            hidden_size=hidden,
            num_layers=int(config.num_hidden_layers),
            num_heads=heads,
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(config, "head_dim", None) or hidden // heads),
            ffn_hidden_size=int(config.intermediate_size),
            norm_eps=float(config.rms_norm_eps),
            rope_theta=float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))),
            max_position_embeddings=int(config.max_position_embeddings),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2",
        )

    def padded_vocab_size(self, tp_size: int) -> int:
        """The embedding rows Megatron holds: ``vocab_size`` rounded up to ``128 * tp``."""
        multiple = VOCAB_PAD_MULTIPLE * tp_size
        return -(-self.vocab_size // multiple) * multiple


# ------------------------------------------------------- HF <-> Megatron mapping


def _fuse_qkv(q: Tensor, k: Tensor, v: Tensor, shape: GPTShape) -> Tensor:
    """Megatron's ``linear_qkv`` layout: per query group, its q heads, then k, then v."""
    groups, d = shape.num_kv_heads, shape.head_dim
    per_group = shape.num_heads // groups
    rest = q.shape[1:]
    parts = (
        q.reshape(groups, per_group * d, *rest),
        k.reshape(groups, d, *rest),
        v.reshape(groups, d, *rest),
    )
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def _split_qkv(qkv: Tensor, shape: GPTShape) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of :func:`_fuse_qkv`."""
    groups, d = shape.num_kv_heads, shape.head_dim
    per_group = shape.num_heads // groups
    rest = qkv.shape[1:]
    q, k, v = qkv.reshape(groups, (per_group + 2) * d, *rest).split([per_group * d, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _layer_pairs(i: int, shape: GPTShape, hf: str) -> dict[str, str]:
    """One-to-one names of layer ``i``: Megatron name -> HF name."""
    m = f"decoder.layers.{i}."
    return {
        f"{m}input_layernorm.weight": f"{hf}layers.{i}.input_layernorm.weight",
        f"{m}self_attention.linear_proj.weight": f"{hf}layers.{i}.self_attn.o_proj.weight",
        f"{m}pre_mlp_layernorm.weight": f"{hf}layers.{i}.post_attention_layernorm.weight",
        f"{m}mlp.linear_fc2.weight": f"{hf}layers.{i}.mlp.down_proj.weight",
    }


def _global_pairs(shape: GPTShape, kind: ModelKind) -> dict[str, str]:
    """One-to-one names outside the layers: Megatron name -> HF name."""
    hf = _HF_PREFIX[kind]
    pairs = {
        "embedding.word_embeddings.weight": f"{hf}embed_tokens.weight",
        "decoder.final_layernorm.weight": f"{hf}norm.weight",
    }
    if kind == "value":
        pairs |= {"output_layer.weight": "head.weight", "output_layer.bias": "head.bias"}
    elif not shape.tie_word_embeddings:
        pairs["output_layer.weight"] = "lm_head.weight"
    return pairs


def hf_to_megatron(
    state: Mapping[str, Tensor], shape: GPTShape, *, kind: ModelKind = "causal_lm"
) -> dict[str, Tensor]:
    """Full Hugging Face tensors to full Megatron ``GPTModel`` tensors (local layer spec).

    Args:
        state: a HF state dict (``LlamaForCausalLM``/``Qwen2ForCausalLM``, or a
            ``ValueModel`` with ``kind="value"``); extra entries are ignored.
        shape: the model's sizes.
        kind: ``"causal_lm"`` or ``"value"``.

    Returns:
        Megatron names (``decoder.layers.0.self_attention.linear_qkv.weight``, ...) to
        tensors; ``_extra_state`` entries are not included.

    Raises:
        EngineConfigError: naming the first HF tensor that is missing.
    """
    hf = _HF_PREFIX[kind]

    def get(name: str) -> Tensor:
        if name not in state:
            raise EngineConfigError(
                f"the Hugging Face state dict lacks {name!r}; pass the state dict of a "
                f"{'ValueModel' if kind == 'value' else 'Llama/Qwen2 causal LM'}"
            )
        return state[name]

    out = {m: get(h) for m, h in _global_pairs(shape, kind).items()}
    for i in range(shape.num_layers):
        out |= {m: get(h) for m, h in _layer_pairs(i, shape, hf).items()}
        attn, mlp = f"{hf}layers.{i}.self_attn.", f"{hf}layers.{i}.mlp."
        m = f"decoder.layers.{i}."
        for suffix in ("weight", "bias") if shape.qkv_bias else ("weight",):
            q, k, v = (get(f"{attn}{x}_proj.{suffix}") for x in "qkv")
            out[f"{m}self_attention.linear_qkv.{suffix}"] = _fuse_qkv(q, k, v, shape)
        out[f"{m}mlp.linear_fc1.weight"] = torch.cat(
            [get(f"{mlp}gate_proj.weight"), get(f"{mlp}up_proj.weight")]
        )
    return out


def megatron_tensor_to_hf(
    name: str, tensor: Tensor, shape: GPTShape, *, kind: ModelKind = "causal_lm"
) -> list[tuple[str, Tensor]]:
    """One full Megatron tensor to the HF tensors it holds (one, or q/k/v, or gate/up).

    Args:
        name: Megatron name.
        tensor: the full (TP-merged, unpadded) tensor.
        shape: the model's sizes.
        kind: ``"causal_lm"`` or ``"value"``.

    Returns:
        ``(hf_name, tensor)`` pairs; for a tied causal LM the embedding also yields
        ``lm_head.weight``, as ``model.state_dict()`` of a transformers model does.

    Raises:
        EngineConfigError: for a name outside the mapping.
    """
    hf = _HF_PREFIX[kind]
    pairs = _global_pairs(shape, kind)
    if name in pairs:
        out = [(pairs[name], tensor)]
        if kind == "causal_lm" and shape.tie_word_embeddings and "word_embeddings" in name:
            out.append(("lm_head.weight", tensor))
        return out
    match = _LAYER.fullmatch(name)
    if match is not None:
        i, rest = int(match.group(1)), match.group(2)
        one_to_one = _layer_pairs(i, shape, hf)
        if name in one_to_one:
            return [(one_to_one[name], tensor)]
        if rest.startswith("self_attention.linear_qkv."):
            suffix = rest.rsplit(".", 1)[1]
            q, k, v = _split_qkv(tensor, shape)
            attn = f"{hf}layers.{i}.self_attn."
            return [(f"{attn}{p}_proj.{suffix}", t) for p, t in zip("qkv", (q, k, v), strict=True)]
        if rest == "mlp.linear_fc1.weight":
            gate, up = tensor.chunk(2)
            mlp = f"{hf}layers.{i}.mlp."
            return [(f"{mlp}gate_proj.weight", gate), (f"{mlp}up_proj.weight", up)]
    raise EngineConfigError(f"no Hugging Face name for Megatron tensor {name!r}")


def megatron_to_hf(
    state: Mapping[str, Tensor], shape: GPTShape, *, kind: ModelKind = "causal_lm"
) -> dict[str, Tensor]:
    """Inverse of :func:`hf_to_megatron` (``_extra_state`` entries are skipped)."""
    out: dict[str, Tensor] = {}
    for name, tensor in state.items():
        if not name.endswith("_extra_state"):
            out.update(megatron_tensor_to_hf(name, tensor, shape, kind=kind))
    return out


# ----------------------------------------------------------- tensor parallelism


def tp_split_kind(name: str, kind: ModelKind) -> str:
    """How Megatron shards a tensor: vocab, column, fc1 (gate/up), row or replicated."""
    if name == "embedding.word_embeddings.weight" or (
        name == "output_layer.weight" and kind == "causal_lm"
    ):
        return "vocab"
    if ".linear_qkv." in name:
        return "column"
    if name.endswith("mlp.linear_fc1.weight"):
        return "fc1"
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return "row"
    return "replicated"


def split_for_tp(
    name: str, full: Tensor, *, tp_size: int, vocab_size: int, kind: ModelKind = "causal_lm"
) -> list[Tensor]:
    """Cut a full Megatron tensor into the shards of tensor-parallel ranks 0..tp-1.

    Column-parallel tensors (``linear_qkv``; whole query groups per rank, so
    ``num_kv_heads % tp == 0``) split rows, ``linear_fc1`` splits gate and up
    separately, row-parallel tensors (``linear_proj``, ``linear_fc2``) split columns,
    vocabulary tensors are zero-padded to a multiple of ``128 * tp`` rows first, and
    the rest is replicated.

    Args:
        name: Megatron name.
        full: the full tensor.
        tp_size: tensor-parallel size.
        vocab_size: the real vocabulary size.
        kind: ``"causal_lm"`` or ``"value"`` (a value head is replicated).

    Returns:
        ``tp_size`` contiguous tensors.
    """
    how = tp_split_kind(name, kind)
    if how == "vocab":
        padded = -(-vocab_size // (VOCAB_PAD_MULTIPLE * tp_size)) * VOCAB_PAD_MULTIPLE * tp_size
        full = torch.cat([full, full.new_zeros(padded - full.shape[0], *full.shape[1:])])
    if how in ("vocab", "column"):
        return [t.contiguous() for t in full.chunk(tp_size)]
    if how == "fc1":
        gate, up = full.chunk(2)
        return [
            torch.cat(pair) for pair in zip(gate.chunk(tp_size), up.chunk(tp_size), strict=True)
        ]
    if how == "row":
        return [t.contiguous() for t in full.chunk(tp_size, dim=1)]
    return [full] * tp_size


def megatron_shard_to_hf(
    name: str, shard: Tensor, shape: GPTShape, *, tp_size: int, kind: ModelKind = "causal_lm"
) -> list[tuple[str, Tensor]]:
    """A tensor-parallel rank's shard of a split Megatron tensor as its shards of the
    Hugging Face tensors it holds.

    Rank ``j`` holds whole query groups, so its ``linear_qkv`` rows are the rows
    ``j`` of ``tp`` equal parts of q, k and v; its ``linear_fc1`` rows are part ``j``
    of gate and of up; a row-parallel tensor is part ``j`` of ``o_proj`` /
    ``down_proj`` along dim 1. That is the layout the PyTorch-native engine's
    tensor parallelism gives rank ``j`` (q/k/v/gate/up split along dim 0, o/down
    along dim 1), so both engines publish the same weight rows.

    Args:
        name: Megatron name of a column, fc1 or row tensor (see :func:`tp_split_kind`).
        shard: this rank's shard, as :func:`split_for_tp` cuts it.
        shape: the model's (full) sizes.
        tp_size: tensor-parallel size.
        kind: ``"causal_lm"`` or ``"value"``.

    Returns:
        ``(hf_name, shard)`` pairs: q, k, v (weight or bias), gate and up, or one.

    Raises:
        EngineConfigError: for a vocabulary or replicated tensor (not split the Hugging
            Face way: gather it and use :func:`megatron_tensor_to_hf`).
    """
    how = tp_split_kind(name, kind)
    if how in ("vocab", "replicated"):
        raise EngineConfigError(
            f"Megatron tensor {name!r} is {how}, not split like its Hugging Face tensors; "
            "gather it and map it with megatron_tensor_to_hf"
        )
    local = replace(
        shape, num_heads=shape.num_heads // tp_size, num_kv_heads=shape.num_kv_heads // tp_size
    )
    # On the local shape the fused layouts are the full ones, so the full mapping
    # applies; row-parallel names map one to one.
    return megatron_tensor_to_hf(name, shard, local, kind=kind)


def merge_from_tp(
    name: str, shards: list[Tensor], *, vocab_size: int, kind: ModelKind = "causal_lm"
) -> Tensor:
    """Inverse of :func:`split_for_tp`: the full tensor, vocabulary padding removed."""
    how = tp_split_kind(name, kind)
    if how == "vocab":
        return torch.cat(shards)[:vocab_size]
    if how == "column":
        return torch.cat(shards)
    if how == "fc1":
        halves = [s.chunk(2) for s in shards]
        return torch.cat([torch.cat([g for g, _ in halves]), torch.cat([u for _, u in halves])])
    if how == "row":
        return torch.cat(shards, dim=1)
    return shards[0]
