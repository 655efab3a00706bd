"""ValueModel from a standard Hugging Face reward model (one-label sequence classifier)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForSequenceClassification,
    LlamaConfig,
    LlamaForSequenceClassification,
    Qwen2Config,
    Qwen2ForSequenceClassification,
)

from channels import ConfigError
from workers.models import VALUE_HEAD_FILE, TinyModelConfig, ValueModel, load_model, save_tiny_model
from workers.models._value_head import is_value_model_dir
from workers.rewards import ModelRewardConfig
from workers.rewards._inputs import ScoreInputs

torch.set_num_threads(1)

PAD = 0
SIZES = dict(vocab_size=40, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=2, num_key_value_heads=1, head_dim=32,
             max_position_embeddings=64, pad_token_id=PAD)


def _classifier(architecture: str, num_labels: int = 1, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    if architecture == "qwen2":
        return Qwen2ForSequenceClassification(Qwen2Config(**SIZES, num_labels=num_labels))
    return LlamaForSequenceClassification(LlamaConfig(**SIZES, num_labels=num_labels))


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def classifier_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp(f"rm_{request.param}")
    _classifier(request.param).save_pretrained(path)
    return path


def test_the_value_at_the_last_token_is_the_classifiers_logit(classifier_dir: Path) -> None:
    classifier = AutoModelForSequenceClassification.from_pretrained(classifier_dir).eval()
    assert is_value_model_dir(classifier_dir)
    value = load_model(classifier_dir, kind="value", head_seed=7)  # the head is the file's
    assert isinstance(value, ValueModel)
    assert torch.equal(value.head.weight, classifier.score.weight)
    assert torch.all(value.head.bias == 0)
    # Right-padded rows of several lengths: HF pools at the last non-pad token.
    lengths = [9, 5, 7]
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 40, (3, 9), generator=gen)
    mask = (torch.arange(9)[None] < torch.tensor(lengths)[:, None]).long()
    ids = ids * mask
    with torch.no_grad():
        logits = classifier(input_ids=ids, attention_mask=mask).logits.squeeze(-1)
        values = value(ids, attention_mask=mask)
    last = torch.tensor(lengths) - 1
    torch.testing.assert_close(values[torch.arange(3), last], logits, atol=1e-6, rtol=1e-5)


def test_the_reward_role_scores_with_the_classifier(classifier_dir: Path) -> None:
    classifier = ValueModel.from_pretrained(classifier_dir)
    scorer = ModelRewardConfig(model_dir=str(classifier_dir)).build(torch.device("cpu"))
    prompt = torch.tensor([[0, 0, 3, 4], [5, 6, 7, 8]])
    response = torch.tensor([[9, 10, 0], [11, 12, 13]])
    inputs = ScoreInputs(prompt_ids=prompt, prompt_mask=(prompt != 0).long(),
                         response_ids=response, response_mask=(response != 0).long())
    scores = scorer(inputs)
    # Each sample alone, unpadded: the value at its last token.
    for row, tokens in enumerate([[3, 4, 9, 10], [5, 6, 7, 8, 11, 12, 13]]):
        with torch.no_grad():
            expected = classifier(torch.tensor([tokens]))[0, -1]
        torch.testing.assert_close(scores[row], expected, atol=1e-5, rtol=1e-5)


def test_a_value_model_saved_from_a_classifier_reloads_alike(classifier_dir: Path, tmp_path: Path) -> None:
    value = ValueModel.from_pretrained(classifier_dir)
    saved = value.save_pretrained(tmp_path / "critic")
    assert (saved / VALUE_HEAD_FILE).is_file()
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        assert torch.equal(ValueModel.from_pretrained(saved)(ids), value(ids))


def test_a_classifier_with_several_labels_is_refused_naming_the_dir(tmp_path: Path) -> None:
    path = tmp_path / "three_labels"
    _classifier("llama", num_labels=3).save_pretrained(path)
    with pytest.raises(ConfigError, match=r"three_labels is a sequence classifier with num_labels=3"):
        load_model(path, kind="value")


def test_a_classifier_is_not_a_causal_lm(classifier_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="kind='value'"):
        load_model(classifier_dir)
    causal = save_tiny_model(tmp_path / "lm", TinyModelConfig())
    assert not is_value_model_dir(causal)
