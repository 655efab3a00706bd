"""The static KV cache of the native engine and its decode step, replayed as CUDA graphs.

A :class:`StaticDecoder` preallocates the keys and values of every layer as one
tensor ``[layers, 2, slots, kv_heads, length, head_dim]``. Slot ``s`` holds one row,
left-aligned: the token at position ``p`` has its keys and values in column ``p``, and
each row is at its own length. A decode step feeds rows ``0..b-1`` their next token
(:attr:`StaticDecoder.tokens`) at their own position (:attr:`StaticDecoder.positions`),
writes its keys and values into that column, and attends to the columns up to it.
Prefill (eager) writes a joining row's prompt into its slot the same way, many tokens
at once. Both run the model's own modules and weights (as :mod:`._lean_decode`) in the
arithmetic of bf16 autocast training (see :meth:`StaticDecoder._forward`); in a decode
step the query heads that share a KV head are passed to SDPA as a sequence of
queries, so grouped-query attention reads each KV head once and copies none.

Steps run over a bucket of rows (the next power of two, at most ``slots``); rows past
the live ones compute on whatever their slot holds and are ignored, so a batch's
arithmetic does not depend on how many rows are live. On CUDA the step of each bucket
is captured once as a CUDA graph and replayed: one launch instead of a dozen kernels
per layer. The step can also be compiled (``torch.compile``, sizes dynamic): each
layer's parts before and after attention, which fuse its norms, rotary embedding and
activation into a few kernels; compiled once, they serve every layer, bucket and
decoder of a model's shape, and a graph then replays their kernels. A graph reads
the parameters where they are, so copying new weights into them keeps it valid;
moving or rebinding them does not, and :class:`DecoderPool` drops a decoder whose
parameters moved (and, once the weights are bound from outside, as the hybrid
engine's are at every transition, stops capturing graphs and compiling).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from ._compiled import Compiled
from ._decode_batch import distinct_sequences

if TYPE_CHECKING:  # transformers' model classes: seconds to import; a generating worker has them
    from transformers import PreTrainedModel

__all__ = ["DecoderPool", "StaticDecoder"]

logger = logging.getLogger(__name__)

_LENGTH_QUANTUM = 64
"""Cache lengths are rounded up to a multiple of this (aligned rows for SDPA's
kernels, and room for samples admitted later)."""


def bucket_of(rows: int, slots: int) -> int:
    """The rows a step of ``rows`` live rows computes: the next power of two, at most ``slots``."""
    return min(1 << max(rows - 1, 0).bit_length(), slots)


class StaticDecoder:
    """A static KV cache of ``slots`` rows of ``length`` tokens and the decode step over it
    (see the module docstring).

    Args:
        model: A model :func:`~._lean_decode.lean_decoder` accepts.
        slots: Rows the cache holds.
        length: Tokens per row (prompt and response); rounded up to a multiple of 64.
        graphs: Replay the step as CUDA graphs (on a CUDA device only).
        compiled: Compile the step's parts around attention with ``torch.compile`` (on
            the first step; if that fails, it is logged and the step runs uncompiled).
    """

    def __init__(self, model: PreTrainedModel, *, slots: int, length: int, graphs: bool,
                 compiled: bool = False) -> None:
        inner: Any = model.model
        parameter = next(model.parameters())
        self.device, self.dtype = parameter.device, parameter.dtype
        self.slots = slots
        self.length = -(-length // _LENGTH_QUANTUM) * _LENGTH_QUANTUM
        self._embed, self._rotary, self._norm, self._head = inner.embed_tokens, inner.rotary_emb, inner.norm, model.lm_head
        self._layers: list[Any] = list(inner.layers)
        attention = self._layers[0].self_attn
        self._head_dim = int(attention.head_dim)
        self._kv_heads = int(model.config.num_key_value_heads)
        self._heads = int(model.config.num_attention_heads)
        self.cache = torch.zeros((len(self._layers), 2, slots, self._kv_heads, self.length, self._head_dim),
                                 dtype=self.dtype, device=self.device)
        self.tokens = torch.zeros(slots, dtype=torch.long, device=self.device)
        """The token each slot feeds at the next step."""
        self.positions = torch.zeros(slots, dtype=torch.long, device=self.device)
        """The position of that token, which is also the cache column it is written to."""
        self._columns = torch.arange(self.length, device=self.device)
        self._graphs = graphs and self.device.type == "cuda"
        self._captured: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool: Any = None
        self._pieces = (
            (Compiled(_queries_keys_values, "the static decode step's part before attention"),
             Compiled(_attended, "the static decode step's part after attention"))
            if compiled else (None, None)
        )
        self.pointers = parameter_pointers(model)
        """Where the parameters were when the decoder was built (its graphs read them there)."""

    def step(self, rows: int) -> torch.Tensor:
        """Decode one token for rows ``0..rows-1``: write their keys and values, and
        return their next-token logits ``[rows, V]`` float32 (valid until the next step)."""
        bucket = bucket_of(rows, self.slots)
        if not self._graphs:
            return self._step(bucket)[:rows]
        captured = self._captured.get(bucket) or self._capture(bucket)
        captured[0].replay()
        return captured[1][:rows]

    @torch.no_grad()
    def prefill(self, start: int, sequences: list[list[int]], *, pad_token_id: int) -> torch.Tensor:
        """Run ``sequences`` through the model into slots ``start..start+len-1`` (eager),
        and return each one's next-token logits ``[len, V]`` float32.

        Each slot's token ``p`` lands in column ``p``; a shorter sequence's padding
        writes columns past its end, which its decode steps overwrite before they
        attend to them. Sequences that repeat one are computed once and their slots
        copied from its (:func:`~._decode_batch.distinct_sequences`)."""
        distinct, source = distinct_sequences(sequences)
        if len(distinct) == len(sequences):
            return self._prefill(start, sequences, pad_token_id=pad_token_id)
        logits = self._prefill(start, distinct, pad_token_id=pad_token_id)
        slots = torch.arange(start, start + len(sequences), device=self.device)
        self.move(torch.tensor(source, device=self.device) + start, slots)
        return logits.index_select(0, torch.tensor(source, device=logits.device))

    def _prefill(self, start: int, sequences: list[list[int]], *, pad_token_id: int) -> torch.Tensor:
        """:meth:`prefill` of every sequence as it comes."""
        width = max(len(sequence) for sequence in sequences)
        ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
        for row, sequence in enumerate(sequences):
            ids[row, : len(sequence)] = torch.tensor(sequence, dtype=torch.long)
        ids = ids.to(self.device)
        positions = torch.arange(width, device=self.device).expand(len(sequences), width)
        hidden = self._forward(slice(start, start + len(sequences)), ids, positions)
        last = torch.tensor([len(sequence) - 1 for sequence in sequences], device=self.device)
        return self._logits(hidden[torch.arange(len(sequences), device=self.device), last])

    def move(self, source: torch.Tensor, target: torch.Tensor) -> None:
        """Copy slots ``source`` to ``target`` (index tensors on the decoder's device:
        cache, token and position)."""
        self.cache.index_copy_(2, target, self.cache.index_select(2, source))
        self.tokens.index_copy_(0, target, self.tokens.index_select(0, source))
        self.positions.index_copy_(0, target, self.positions.index_select(0, source))

    def copy_to(self, other: StaticDecoder, rows: int) -> None:
        """Copy slots ``0..rows-1`` into ``other`` (at least as many slots and columns)."""
        other.cache[:, :, :rows, :, : self.length] = self.cache[:, :, :rows]
        other.tokens[:rows] = self.tokens[:rows]
        other.positions[:rows] = self.positions[:rows]

    def _capture(self, bucket: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Capture the step of ``bucket`` rows (after one eager run on a side stream,
        which also initialises what the kernels need); every bucket shares one memory pool."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._step(bucket)  # writes the same columns the replay will (and compiles)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._step(bucket)
        self._captured[bucket] = (graph, logits)
        return graph, logits

    def _step(self, rows: int) -> torch.Tensor:
        """The decode step of slots ``0..rows-1``: their logits ``[rows, V]`` float32."""
        with torch.no_grad():
            tokens, positions = self.tokens[:rows, None], self.positions[:rows, None]
            hidden = self._forward(slice(0, rows), tokens, positions, self._pieces)
            return self._logits(hidden[:, -1])

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self._head(self._norm(hidden).to(self.dtype))
        return logits.float()

    def _forward(self, slots: slice, tokens: torch.Tensor, positions: torch.Tensor,
                 pieces: tuple[Any, Any] = (None, None)) -> torch.Tensor:
        """Feed ``tokens`` ``[n, T]`` at ``positions`` into ``slots``; the last hidden
        states ``[n, T, H]`` float32.

        Each layer is its part before attention (:func:`_queries_keys_values`), the
        cache write and attention, and its part after (:func:`_attended`); ``pieces``
        are those two parts compiled (the decode step's), or None for the plain ones.
        The arithmetic is that of a training engine's bf16 autocast over the same
        weights: the residual stream and the norms in float32, each matrix product
        and the attention in the weights' dtype, so sampled log-probs are what the
        trainer computes again (a float32 model computes in float32 throughout)."""
        before, after = pieces[0] or _queries_keys_values, pieces[1] or _attended
        rows, count = tokens.shape
        x = self._embed(tokens).float()
        cos, sin = (t[:, None] for t in self._rotary(x, positions))  # [n, 1, T, D]
        # One additive mask for every layer (SDPA would convert a boolean one per call).
        visible = self._columns[None, None, :] <= positions[:, :, None]
        bias = torch.zeros(visible.shape, dtype=self.dtype, device=x.device)
        bias = bias.masked_fill_(~visible, float("-inf"))[:, None]
        column = positions[:, None, :, None].expand(rows, self._kv_heads, count, self._head_dim)
        for number, layer in enumerate(self._layers):
            keys, values = self.cache[number, 0, slots], self.cache[number, 1, slots]
            q, k, v = before(layer, x, cos, sin, self._heads, self._head_dim, self.dtype)
            keys.scatter_(2, column, k)
            values.scatter_(2, column, v)
            x = after(layer, x, self._attention(q, keys, values, bias, layer.self_attn.scaling))
        return x

    def _attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, attend: torch.Tensor,
                   scale: float) -> torch.Tensor:
        """SDPA of ``q`` ``[n, Hq, T, D]`` over the cache; ``[n, Hq, T, D]``."""
        rows, heads, count, dim = q.shape
        if count > 1:  # prefill: SDPA's own grouped-query attention
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=attend, scale=scale, enable_gqa=True)
        # One token: the query heads of a KV head as that head's queries, so no KV head is copied.
        grouped = q.reshape(rows, self._kv_heads, -1, dim)
        out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=attend, scale=scale)
        return out.reshape(rows, heads, 1, dim)


def _queries_keys_values(layer: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
                         head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer's part before attention: the norm of the float32 residual ``x``
    ``[n, T, H]`` and its queries ``[n, Hq, T, D]``, keys and values ``[n, Hkv, T, D]``
    in ``dtype``, RoPE applied to the query and key heads at once
    (``apply_rotary_pos_emb``'s arithmetic)."""
    attn = layer.self_attn
    rows, count = x.shape[0], x.shape[1]
    h = _rms_norm(x, layer.input_layernorm).to(dtype)
    q = attn.q_proj(h).view(rows, count, -1, head_dim)
    k = attn.k_proj(h).view(rows, count, -1, head_dim)
    v = attn.v_proj(h).view(rows, count, -1, head_dim).transpose(1, 2)
    qk = torch.cat([q, k], dim=2).transpose(1, 2)
    qk = (qk * cos + _rotate_half(qk) * sin).to(dtype)
    return qk[:, :heads], qk[:, heads:], v


def _attended(layer: Any, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """A layer's part after attention: the residual ``x`` plus the output projection of
    attention's ``out`` ``[n, Hq, T, D]``, plus the MLP of that one's norm."""
    rows, count = x.shape[0], x.shape[1]
    x = x + layer.self_attn.o_proj(out.transpose(1, 2).reshape(rows, count, -1))
    h = _rms_norm(x, layer.post_attention_layernorm).to(out.dtype)
    mlp = layer.mlp
    return x + mlp.down_proj(mlp.act_fn(mlp.gate_proj(h)) * mlp.up_proj(h))


def _rms_norm(x: torch.Tensor, norm: Any) -> torch.Tensor:
    """Llama's RMS norm of float32 ``x`` as one fused op and the weight's product (float32)."""
    return norm.weight * F.rms_norm(x, x.shape[-1:], eps=norm.variance_epsilon)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def parameter_pointers(model: PreTrainedModel) -> tuple[int, ...]:
    """Where ``model``'s parameters are: their data pointers, in order."""
    return tuple(parameter.data_ptr() for parameter in model.parameters())


class DecoderPool:
    """Lends each run of an engine a :class:`StaticDecoder` and keeps one between runs,
    so that a run as large as the last one reuses its cache and graphs.

    Args:
        model: The engine's model.
        graphs: Whether decoders replay CUDA graphs (``NativeRolloutConfig.cuda_graphs``).
        compiled: Whether decoders compile their step (``NativeRolloutConfig.compile``).
    """

    def __init__(self, model: PreTrainedModel, *, graphs: bool, compiled: bool = False) -> None:
        self._model = model
        self._graphs = graphs
        self._compiled = compiled
        self._idle: StaticDecoder | None = None

    def lend(self, slots: int, length: int) -> StaticDecoder:
        """A decoder of at least ``slots`` rows of ``length`` tokens, for one run alone."""
        idle, self._idle = self._idle, None
        if idle is not None and idle.slots >= slots and idle.length >= length:
            if idle.pointers == parameter_pointers(self._model):
                return idle
        del idle  # its memory is free for the new one
        return StaticDecoder(self._model, slots=slots, length=length, graphs=self._graphs, compiled=self._compiled)

    def give_back(self, decoder: StaticDecoder) -> None:
        """Keep ``decoder`` for the next run (its rows are garbage from now on)."""
        if self._idle is None or decoder.slots * decoder.length >= self._idle.slots * self._idle.length:
            self._idle = decoder

    @property
    def graphs(self) -> bool:
        """Whether the decoders lent from now on replay CUDA graphs."""
        return self._graphs

    @property
    def compiled(self) -> bool:
        """Whether the decoders lent from now on compile their step."""
        return self._compiled

    def clear(self, *, rebound: bool = False) -> None:
        """Drop the idle decoder (the parameters are about to move, or their memory to go).

        ``rebound``: the parameters become tensors given from outside, new ones at each
        bind (the hybrid engine's generation shards); graphs, which read them where
        they were captured, would be captured again for every bind, so decoders run
        their steps eagerly from now on, and uncompiled: the compiled parts were
        never run on bound weights (views of outside buffers, whose layout may
        differ from bind to bind and compile again)."""
        self._idle = None
        if rebound and (self._graphs or self._compiled):
            self._graphs = self._compiled = False
            logger.info("native rollout: weights bound from outside (bind_weights); the static cache's decode "
                        "steps run without CUDA graphs or compiling from now on (each bind would capture them again)")
