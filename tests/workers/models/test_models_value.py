"""ValueModel: construction from a causal LM, shapes, padding, save/load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from channels import ConfigError
from workers.models import (
    VALUE_HEAD_FILE,
    TinyModelConfig,
    ValueModel,
    build_tiny_model,
    load_model,
    save_tiny_model,
)

torch.set_num_threads(1)

IDS = torch.tensor([[1, 5, 6, 17, 13, 17, 7, 16], [1, 8, 8, 14, 9, 16, 4, 4]])


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def causal_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = TinyModelConfig(architecture=request.param)
    return save_tiny_model(tmp_path_factory.mktemp(request.param), config, seed=3)


def _values(model: ValueModel, ids: torch.Tensor = IDS, **kwargs: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, **kwargs)


def test_value_model_copies_the_backbone_and_gives_one_value_per_token(causal_dir: Path) -> None:
    causal_lm = load_model(causal_dir)
    value = load_model(causal_dir, kind="value", head_seed=5)
    assert isinstance(value, ValueModel)
    backbone = dict(value.backbone.state_dict())
    for name, tensor in causal_lm.base_model.state_dict().items():
        assert torch.equal(backbone[name], tensor), name
    values = _values(value)
    assert values.shape == IDS.shape
    assert values.dtype == torch.float32
    same_head = ValueModel.from_causal_lm(causal_lm, seed=5)
    assert torch.equal(_values(same_head), values)
    other_head = ValueModel.from_causal_lm(causal_dir, seed=6)
    assert not torch.allclose(_values(other_head), values)


def test_save_then_load_gives_identical_values(causal_dir: Path, tmp_path: Path) -> None:
    value = ValueModel.from_causal_lm(causal_dir, seed=1)
    with torch.no_grad():
        value.head.bias.fill_(0.25)  # a trained head: the bias must round-trip too
    directory = value.save_pretrained(tmp_path / "critic")
    assert (directory / VALUE_HEAD_FILE).is_file()
    for loaded in (ValueModel.from_pretrained(directory), load_model(directory, kind="value")):
        assert torch.equal(_values(loaded), _values(value))
    with pytest.raises(ValueError, match="kind='value'"):
        load_model(directory)


def test_left_padding_does_not_change_values(causal_dir: Path) -> None:
    value = load_model(causal_dir, kind="value")
    short = IDS[:1, :5]
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), short], dim=1)
    mask = (torch.arange(8) >= 3).long()[None]
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    got = _values(value, padded, attention_mask=mask, position_ids=positions)
    torch.testing.assert_close(got[:, 3:], _values(value, short), atol=1e-5, rtol=0)


def test_gradients_reach_head_and_backbone(causal_dir: Path) -> None:
    value = load_model(causal_dir, kind="value")
    value(IDS).pow(2).mean().backward()
    assert value.head.weight.grad is not None
    assert value.backbone.get_input_embeddings().weight.grad is not None


def test_misuse_is_explained(causal_dir: Path) -> None:
    with pytest.raises(ConfigError, match="from_causal_lm"):
        ValueModel.from_pretrained(causal_dir)
    with pytest.raises(ValueError, match="base model"):
        ValueModel(build_tiny_model(TinyModelConfig(num_hidden_layers=1)))
