"""A transformers backbone with a scalar head: the model of critics, reward and cost models.

On disk a value model is a Hugging Face directory written by the backbone's own
``save_pretrained`` (``config.json`` naming e.g. ``LlamaModel``, ``model.safetensors``)
plus :data:`VALUE_HEAD_FILE`, a safetensors file holding the head's ``weight``
``[1, hidden]`` and ``bias`` ``[1]``. ``transformers.AutoModel`` therefore loads the
backbone of a value directory on its own, and a causal-LM directory serves as the
starting point of a new value model (its backbone weights, a fresh seeded head).

A standard Hugging Face reward model, a ``LlamaForSequenceClassification`` or
``Qwen2ForSequenceClassification`` directory with one label, loads as a value model
too: its ``score`` projection becomes the head (zero bias when it has none), so the
value at a sequence's last token equals the classifier's logit for it.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from channels import ConfigError

from ._architecture import read_architecture
from ._checkpoint import check_supported_checkpoint, save_pretrained_here

if TYPE_CHECKING:  # transformers' model classes: seconds to import; imported where a model is built
    from transformers import PretrainedConfig, PreTrainedModel

__all__ = ["VALUE_HEAD_FILE", "ValueModel", "is_value_model_dir"]

VALUE_HEAD_FILE = "value_head.safetensors"
"""Name of the file holding the value head, beside the backbone's files."""

_CLASSIFIER_SUFFIX = "ForSequenceClassification"


def is_value_model_dir(directory: str | Path) -> bool:
    """Whether a directory holds a value model rather than a causal LM.

    Args:
        directory: A local checkpoint directory.

    Returns:
        True when it has :data:`VALUE_HEAD_FILE`, or its ``config.json`` names a
        ``...ForSequenceClassification`` architecture.
    """
    path = Path(directory)
    return (path / VALUE_HEAD_FILE).is_file() or _is_sequence_classifier(path)


def _is_sequence_classifier(path: Path) -> bool:
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    architectures = config.get("architectures") if isinstance(config, dict) else None
    return isinstance(architectures, list) and any(
        isinstance(name, str) and name.endswith(_CLASSIFIER_SUFFIX) for name in architectures
    )


class ValueModel(nn.Module):
    """A transformers base model (no LM head) followed by ``Linear(hidden, 1)``.

    Args:
        backbone: A transformers base model such as ``LlamaModel`` or ``Qwen2Model``.
        seed: Seed of the head's random initialisation (normal with the backbone's
            ``initializer_range``, zero bias).

    Raises:
        ValueError: If ``backbone`` is a model with an LM head rather than a base model.
    """

    def __init__(self, backbone: PreTrainedModel, *, seed: int = 0) -> None:
        super().__init__()
        if backbone.base_model is not backbone:
            raise ValueError(
                f"ValueModel needs a base model, got {type(backbone).__name__}; pass "
                "model.base_model, or use ValueModel.from_causal_lm(model)"
            )
        self.backbone = backbone
        hidden_size = backbone.config.hidden_size
        self.head = nn.Linear(hidden_size, 1, dtype=torch.float32)
        generator = torch.Generator().manual_seed(seed)
        std = float(getattr(backbone.config, "initializer_range", 0.02))
        with torch.no_grad():
            self.head.weight.normal_(0.0, std, generator=generator)
            self.head.bias.zero_()

    @property
    def config(self) -> PretrainedConfig:
        """The backbone's transformers config."""
        return self.backbone.config

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Compute one value per position.

        Args:
            input_ids: ``[B, T]`` token ids.
            attention_mask: ``[B, T]``, 1 on real tokens (left or right padding).
            position_ids: ``[B, T]`` positions; None lets the backbone count from 0,
                which is wrong for left-padded rows (pass ``cumsum(mask) - 1``).

        Returns:
            ``[B, T]`` float32 values.
        """
        output = self.backbone(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
        )
        hidden = output.last_hidden_state.to(self.head.weight.dtype)
        return self.head(hidden).squeeze(-1).float()

    @classmethod
    def from_causal_lm(cls, source: str | Path | PreTrainedModel, *, seed: int = 0) -> ValueModel:
        """Start a value model from a causal LM's backbone and a fresh head.

        Args:
            source: A causal LM (its backbone is copied, the LM head dropped), or a
                local checkpoint directory of a supported architecture.
            seed: Seed of the head's initialisation.

        Returns:
            A float32 value model in eval mode.

        Raises:
            ValueError: If a directory's architecture is not supported.
        """
        from transformers import PreTrainedModel

        if isinstance(source, PreTrainedModel):
            backbone = copy.deepcopy(_base_model(source))
        else:
            backbone = _load_backbone(Path(source))
        return cls(backbone.float(), seed=seed).eval()

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> ValueModel:
        """Load a value model: one written by :meth:`save_pretrained`, or a
        sequence classifier with one label (see the module's docstring).

        Args:
            directory: A directory holding the backbone files and :data:`VALUE_HEAD_FILE`,
                or a ``...ForSequenceClassification`` checkpoint.

        Returns:
            A float32 value model in eval mode.

        Raises:
            ConfigError: If the directory is neither; if a classifier's ``num_labels``
                is not 1; if the architecture is not supported.
            ValueError: If the head does not match the backbone.
        """
        path = Path(directory)
        if not (path / VALUE_HEAD_FILE).is_file():
            if _is_sequence_classifier(path):
                return cls._from_sequence_classifier(path)
            raise ConfigError(
                f"{path} has no {VALUE_HEAD_FILE} and is not a sequence classifier; to start "
                "a value model from a causal LM use ValueModel.from_causal_lm(path) or "
                "load_model(path, kind='value')"
            )
        model = cls(_load_backbone(path))
        head = load_file(str(path / VALUE_HEAD_FILE))
        expected = {name: tuple(t.shape) for name, t in model.head.state_dict().items()}
        found = {name: tuple(t.shape) for name, t in head.items()}
        if found != expected:
            raise ValueError(
                f"{path / VALUE_HEAD_FILE} holds {found}, but the backbone needs {expected}"
            )
        model.head.load_state_dict(head)
        return model.eval()

    @classmethod
    def _from_sequence_classifier(cls, path: Path) -> ValueModel:
        hf_config = check_supported_checkpoint(path)
        if hf_config.num_labels != 1:
            raise ConfigError(
                f"{path} is a sequence classifier with num_labels={hf_config.num_labels}; a "
                "reward, cost or critic model needs exactly one (a scalar score per sequence)"
            )
        from transformers import AutoModelForSequenceClassification

        classifier = AutoModelForSequenceClassification.from_pretrained(
            path, local_files_only=True, dtype=torch.float32
        )
        score = getattr(classifier, "score", None)
        if not isinstance(score, nn.Linear):
            raise ConfigError(
                f"{path}: {type(classifier).__name__} has no Linear 'score' projection to "
                "use as the value head"
            )
        model = cls(_base_model(classifier).float())
        with torch.no_grad():
            model.head.weight.copy_(score.weight)
            if score.bias is None:
                model.head.bias.zero_()
            else:
                model.head.bias.copy_(score.bias)
        return model.eval()

    def save_pretrained(self, directory: str | Path) -> Path:
        """Write the backbone (HF format) and the head into ``directory``.

        Args:
            directory: Target directory (created if needed).

        Returns:
            The directory.
        """
        path = Path(directory)
        save_pretrained_here(self.backbone, path)
        head = {name: t.detach().contiguous().cpu() for name, t in self.head.state_dict().items()}
        save_file(head, str(path / VALUE_HEAD_FILE), metadata={"format": "pt"})
        return path


def _load_backbone(path: Path) -> PreTrainedModel:
    from transformers import AutoModel, AutoModelForCausalLM

    read_architecture(path)
    if (path / VALUE_HEAD_FILE).is_file():
        return AutoModel.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    # A causal-LM directory: load the whole model and keep its base model, rather than
    # loading AutoModel and having transformers report the LM head as unexpected.
    causal_lm = AutoModelForCausalLM.from_pretrained(
        path, local_files_only=True, dtype=torch.float32
    )
    return _base_model(causal_lm)


def _base_model(model: PreTrainedModel) -> PreTrainedModel:
    from transformers import PreTrainedModel

    base = model.base_model
    if not isinstance(base, PreTrainedModel):
        raise ValueError(
            f"{type(model).__name__}.base_model is a {type(base).__name__}, not a transformers "
            "model; ValueModel needs a transformers backbone"
        )
    return base
