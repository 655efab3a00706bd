"""A model cut into pipeline stages: each stage a shell of the model that runs only
its own decoder layers.

Works on the transformers layout the engines train: a body (``LlamaModel``,
``Qwen2Model``, ...) with ``embed_tokens``, ``layers`` and ``norm``, held by a
top-level model that adds heads (``lm_head``; a value model's ``head``). A stage's
shell is a copy of the model's small parts (config, rotary tables) that holds the
original modules of its part, so parameters keep their names
(``model.layers.5.mlp...``) and the model's own forward still runs:

- decoder layers of other stages are :class:`_Skip` (the hidden states pass through);
- after the first stage, ``embed_tokens`` is an :class:`Inbox` that returns the
  hidden states received from the previous stage;
- before the last stage, the final norm and the heads pass their input through, so
  the body's output is the stage's hidden states.

The last stage runs the model's own forward (the engine's heads call it as they
call a whole model); the others run the body.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import Tensor, nn

from workers.engines._errors import EngineConfigError

__all__ = ["Inbox", "Stage", "layer_bounds", "split_stages", "tied_heads"]


class _Skip(nn.Module):
    """A decoder layer another stage runs: its input passes through."""

    def __init__(self, attention_type: Any) -> None:
        super().__init__()
        if attention_type is not None:  # Qwen2-style bodies pick the mask by it
            self.attention_type = attention_type

    def forward(self, hidden_states: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return hidden_states


class _Through(nn.Module):
    """The final norm or a head, before the last stage: its input passes through."""

    def forward(self, hidden_states: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return hidden_states


class Inbox(nn.Module):
    """Stands for ``embed_tokens`` after the first stage: returns the hidden states
    put in it (once) instead of embedding the token ids."""

    def __init__(self) -> None:
        super().__init__()
        self._hidden: Tensor | None = None

    def put(self, hidden: Tensor) -> None:
        """The next forward's input."""
        self._hidden = hidden

    def forward(self, input_ids: Tensor) -> Tensor:
        hidden, self._hidden = self._hidden, None
        if hidden is None:
            raise AssertionError("a later pipeline stage ran without its input hidden states")
        return hidden


class Stage:
    """One virtual stage of a model on this rank.

    Attributes:
        index: the virtual stage (0 embeds the tokens; the last adds the heads).
        module: the stage's shell of the model (its parameters keep their names).
        body: the shell's body (``module.model`` or ``module.backbone``).
        inbox: where the previous stage's hidden states go (None on stage 0).
        last: whether this stage ends the model.
    """

    def __init__(self, index: int, module: nn.Module, body: nn.Module, *, last: bool) -> None:
        self.index = index
        self.module = module
        self.body = body
        self.last = last
        embed = body.get_submodule("embed_tokens")
        self.inbox = embed if isinstance(embed, Inbox) else None

    def hidden(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor) -> Tensor:
        """The stage's output hidden states (a stage before the last)."""
        out = self.body(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                        use_cache=False)
        return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


def _body_name(model: nn.Module) -> str:
    for name, child in model.named_children():
        layers = getattr(child, "layers", None)
        if isinstance(layers, nn.ModuleList) and hasattr(child, "embed_tokens") and hasattr(child, "norm"):
            return name
    raise EngineConfigError(
        f"pipeline stages need a model whose body (a direct child) has embed_tokens, layers and norm, "
        f"as transformers' Llama-style models do; {type(model).__name__} has none"
    )


def tied_heads(model: nn.Module) -> list[str]:
    """The heads of ``model`` whose weight is its input embedding's (tied
    embeddings: ``lm_head`` of a model with ``tie_word_embeddings``)."""
    body = model.get_submodule(_body_name(model))
    embed = body.get_submodule("embed_tokens")
    return [name for name, child in model.named_children()
            if child is not body and getattr(child, "weight", None) is embed.weight]


def layer_bounds(layers: int, stages: int) -> list[tuple[int, int]]:
    """``[first, end)`` layers of each of ``stages`` virtual stages, as even as can be
    (earlier stages take one more)."""
    if layers < stages:
        raise EngineConfigError(
            f"a model of {layers} decoder layers cannot fill {stages} pipeline stages (pp x pipeline_chunks); "
            "use fewer stages or chunks"
        )
    base, extra = divmod(layers, stages)
    bounds, first = [], 0
    for s in range(stages):
        end = first + base + (1 if s < extra else 0)
        bounds.append((first, end))
        first = end
    return bounds


@contextmanager
def _without(module: nn.Module, names: list[str]) -> Iterator[None]:
    """``module``'s children ``names`` replaced by placeholders for the block (a deep
    copy then copies only the small rest)."""
    saved = {name: getattr(module, name) for name in names}
    for name in names:
        setattr(module, name, _Through())
    try:
        yield
    finally:
        for name, child in saved.items():
            setattr(module, name, child)


def split_stages(model: nn.Module, *, rank: int, ranks: int, chunks: int = 1) -> list[Stage]:
    """This rank's stages of ``model`` (one per chunk: virtual stages ``rank``,
    ``rank + ranks``, ...), and the model itself cut down in place to the parts
    they run (the same modules, under the same names: the rank's parameters in one
    module, not to be called).

    Args:
        model: a transformers-layout model (see the module docstring), identical on
            every rank. Tied input and output embeddings stay one parameter on a
            rank that runs both the first and the last stage; otherwise the first
            stage's embedding and the last stage's head each hold a copy (see
            :func:`tied_heads`).
        rank: this rank's pipeline stage.
        ranks: the pipeline's stages (the mesh's ``pp``).
        chunks: virtual stages per rank (interleaved 1F1B when above 1).

    Raises:
        EngineConfigError: for a model without that layout, fewer layers than
            virtual stages.
    """
    body_name = _body_name(model)
    body = model.get_submodule(body_name)
    heads = [name for name, _ in model.named_children() if name != body_name]
    embed = body.get_submodule("embed_tokens")
    layers = list(body.get_submodule("layers").children())
    total = ranks * chunks
    bounds = layer_bounds(len(layers), total)
    stages = []
    for chunk in range(chunks):
        index = chunk * ranks + rank
        first, end = bounds[index]
        with _without(body, ["layers", "embed_tokens", "norm"]), _without(model, heads):
            shell = copy.deepcopy(model)
        shell_body = shell.get_submodule(body_name)
        shell_body.layers = nn.ModuleList(
            layers[i] if first <= i < end else _Skip(getattr(layers[i], "attention_type", None))
            for i in range(len(layers))
        )
        shell_body.embed_tokens = embed if index == 0 else Inbox()
        last = index == total - 1
        shell_body.norm = body.get_submodule("norm") if last else _Through()
        for name in heads:
            setattr(shell, name, getattr(model, name) if last else _Through())
        stages.append(Stage(index, shell, shell_body, last=last))
    # The caller's model keeps what this rank runs, under the same names: the one
    # module its optimizer, checkpoints and weight export see.
    owned = {i for stage in stages for i in range(*bounds[stage.index])}
    body.layers = nn.ModuleList(
        layer if i in owned else _Skip(getattr(layer, "attention_type", None)) for i, layer in enumerate(layers)
    )
    if not any(stage.index == 0 for stage in stages):
        body.embed_tokens = _Through()
    if not any(stage.last for stage in stages):
        body.norm = _Through()
        for name in heads:
            setattr(model, name, _Through())
    return stages
