"""A leaner decode step for Llama-shaped models: the same operations, less plumbing.

One decode step feeds every row one token. Through transformers that is some thirty
module calls per layer, mask construction, and a cache that grows by concatenation
(a copy of every layer's keys and values per token): at the sizes RL runs on CPU
(a batch of 64 rows of a small model) that costs more than the matmuls. A
:class:`LeanDecoder` runs the same operations on the model's own modules and
weights (no copies) and appends to the cache in place, into spare columns. Models
it does not reproduce exactly (:func:`lean_decoder` returns None) keep the
transformers path. Its logits equal the transformers step's bit for bit on the
models it accepts (test_lean_decode.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:  # transformers' model classes: seconds to import; a generating worker has them
    from transformers import PreTrainedModel
    from transformers.cache_utils import DynamicLayer

__all__ = ["LeanDecoder", "lean_decoder"]

_SUPPORTED = {"llama", "qwen2"}
"""``model_type``\\ s whose layers are exactly norm, attention (q, k, v, o), norm,
gated MLP, with default RoPE and no extra norms."""


def lean_decoder(model: PreTrainedModel) -> LeanDecoder | None:
    """A :class:`LeanDecoder` for ``model``, or None where the model is not one it
    reproduces exactly (its decode then stays with transformers)."""
    config = model.config
    if getattr(config, "model_type", None) not in _SUPPORTED:
        return None
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", "default") != "default" or getattr(config, "pretraining_tp", 1) != 1:
        return None
    if getattr(config, "_attn_implementation", "sdpa") != "sdpa":  # the step is sdpa's arithmetic
        return None
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if inner is None or layers is None or any(hasattr(layer.self_attn, "q_norm") for layer in layers):
        return None
    return LeanDecoder(model)


class LeanDecoder:
    """Decode steps of a Llama-shaped ``model`` (see the module docstring), for one
    run: it keeps the spare cache columns of the batch it last stepped.

    Args:
        model: A model :func:`lean_decoder` accepted.
    """

    def __init__(self, model: PreTrainedModel) -> None:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        self._apply_rotary = apply_rotary_pos_emb
        inner = model.model
        self._embed = inner.embed_tokens
        self._rotary = inner.rotary_emb
        self._norm = inner.norm
        self._head = model.lm_head
        self._layers = [_Layer(layer) for layer in inner.layers]

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
             cache_layers: list[DynamicLayer]) -> torch.Tensor:
        """Feed ``tokens`` ``[B]`` at ``positions`` ``[B]``, appending to each layer's
        keys and values; ``mask`` ``[B, L]`` covers the cache after the append (None:
        no padding, every column is attended to, as transformers' step then does). The
        next-token logits ``[B, V]`` float32."""
        rows = tokens.shape[0]
        x = self._embed(tokens[:, None])
        cos, sin = self._rotary(x, positions[:, None])
        attend = None if mask is None else mask.bool()[:, None, None, :]
        for layer, cache in zip(self._layers, cache_layers, strict=True):
            attn, mlp = layer.attn, layer.mlp
            h = layer.norm_in(x)
            q = attn.q_proj(h).view(rows, 1, -1, layer.head_dim).transpose(1, 2)
            k = attn.k_proj(h).view(rows, 1, -1, layer.head_dim).transpose(1, 2)
            v = attn.v_proj(h).view(rows, 1, -1, layer.head_dim).transpose(1, 2)
            q, k = self._apply_rotary(q, k, cos, sin)
            cache.keys, cache.values = layer.append(cache, k, v)
            heads = F.scaled_dot_product_attention(q, cache.keys, cache.values, attn_mask=attend,
                                                   scale=attn.scaling, enable_gqa=q.shape[1] != k.shape[1])
            x = x + attn.o_proj(heads.transpose(1, 2).reshape(rows, 1, -1))
            h = layer.norm_post(x)
            x = x + mlp.down_proj(mlp.act_fn(mlp.gate_proj(h)) * mlp.up_proj(h))
        logits: torch.Tensor = self._head(self._norm(x))
        return logits[:, -1, :].float()


class _Layer:
    """One decoder layer's modules, and room to grow its cache in place."""

    __slots__ = ("attn", "head_dim", "keys", "mlp", "norm_in", "norm_post", "values")

    def __init__(self, layer: Any) -> None:
        # transformers' modules, typed loosely: their attributes are plain nn.Module lookups
        self.norm_in: Any = layer.input_layernorm
        self.norm_post: Any = layer.post_attention_layernorm
        self.attn: Any = layer.self_attn
        self.mlp: Any = layer.mlp
        self.head_dim: int = layer.self_attn.head_dim
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        """The cache tensors last handed out: views into buffers with spare columns."""

    def append(self, cache: DynamicLayer, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cache``'s keys and values with ``k`` and ``v`` ``[B, H, 1, D]`` appended.

        Written in place into a buffer with spare columns while ``cache`` still
        holds what the last call returned; a cache changed since (rows dropped or
        merged by :class:`~._kv_batch.KVBatch`, or another run's) is copied into a
        new buffer first. The results are views of the buffer."""
        keys, values = cache.keys, cache.values
        assert keys is not None and values is not None
        if keys is not self.keys or values is not self.values or not _has_room(keys):
            keys, values = _with_room(keys), _with_room(values)
        self.keys, self.values = _append(keys, k), _append(values, v)
        return self.keys, self.values

def _with_room(cache: torch.Tensor) -> torch.Tensor:
    """``cache`` ``[B, H, L, D]`` copied into a buffer with at least 32 spare columns; a view."""
    length = cache.shape[2]
    spare = cache.new_empty((*cache.shape[:2], max(length, 32), cache.shape[3]))
    return torch.cat([cache, spare], dim=2)[:, :, :length]


def _append(view: torch.Tensor, column: torch.Tensor) -> torch.Tensor:
    """``view`` (from :func:`_with_room`) one column longer, ``column`` ``[B, H, 1, D]``
    written into it in place."""
    length = view.shape[2]
    longer = view.as_strided((*view.shape[:2], length + 1, view.shape[3]), view.stride(), view.storage_offset())
    longer[:, :, length:] = column
    return longer


def _has_room(view: torch.Tensor) -> bool:
    """Whether the buffer under ``view`` (``[B, H, L, D]``, contiguous buffer of
    ``[B, H, capacity, D]``) has a column past ``L``."""
    capacity = view.stride(1) // view.stride(2)
    return view.shape[2] < capacity
