"""Sampling options of the native engine: ``min_new_tokens``, stop strings, seeds, and
their validation (``SamplingParams`` and the algorithms' ``SamplingConfig``)."""

from __future__ import annotations

import random
from typing import Any

import msgspec
import pytest
import torch
from transformers import PreTrainedModel

from asyncflow.algos import SamplingConfig
from channels import ConfigError
from workers.models import CharTokenizer, TinyModelConfig, build_tiny_model
from workers.rollout import (
    NativeRolloutConfig,
    NativeRolloutEngine,
    RolloutOutput,
    SamplingParams,
)
from workers.rollout._stop import StopStrings

torch.set_num_threads(1)

TOKENIZER = CharTokenizer()
EOS = TOKENIZER.eos_token_id


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    texts = [f"{rng.randint(0, 10 ** rng.randint(1, 5))}+{rng.randint(0, 99)}=" for _ in range(count)]
    return [TOKENIZER.encode(text) for text in texts]


PROMPTS = _prompts(8)


class PairDecoder:
    """A tokenizer whose every token is two characters (``"Aa"``, ``"Bb"``, ...), so
    stop strings can end in the middle of a token."""

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        del skip_special_tokens
        return "".join(chr(65 + i) + chr(97 + i) for i in ids)


@pytest.fixture(scope="module")
def model() -> PreTrainedModel:
    return build_tiny_model(TinyModelConfig(), seed=0)


pytestmark = pytest.mark.usefixtures("decode")
DECODE = "dynamic"
"""The engines' KV cache (``NativeRolloutConfig.decode``): conftest's ``decode`` runs
every test with both."""


def _config(**settings: Any) -> NativeRolloutConfig:
    return NativeRolloutConfig(decode=DECODE, **settings)


def _engine(model: PreTrainedModel, tokenizer: object = TOKENIZER) -> NativeRolloutEngine:
    return NativeRolloutEngine(model, config=_config(max_batch_size=4), tokenizer=tokenizer)  # type: ignore[arg-type]


def _responses(out: RolloutOutput) -> list[list[int]]:
    return [row[mask.bool()].tolist() for row, mask in zip(out.response_ids, out.response_mask, strict=True)]


def _frequent_token(model: PreTrainedModel, params: SamplingParams) -> int:
    """A token that the responses under ``params`` (no EOS) often start with."""
    out = _engine(model).generate(PROMPTS, msgspec.structs.replace(params, eos_token_id=None))
    return int(torch.mode(out.response_ids[:, 0]).values)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_min_new_tokens_keeps_eos_out_of_the_first_tokens(model: PreTrainedModel, temperature: float) -> None:
    base = SamplingParams(max_new_tokens=12, temperature=temperature, seed=3)
    eos = _frequent_token(model, base)
    engine = _engine(model)
    free = engine.generate(PROMPTS, msgspec.structs.replace(base, eos_token_id=eos))
    assert int(free.response_lengths.min()) == 1  # EOS ends some responses at once without it
    held = engine.generate(PROMPTS, msgspec.structs.replace(base, eos_token_id=eos, min_new_tokens=5))
    assert int(held.response_lengths.min()) >= 5
    for response in _responses(held):
        assert eos not in response[:4]
        assert len(response) == 12 or response[-1] == eos
    # Log-probs stay the raw ones: EOS kept its probability in them.
    with torch.no_grad():
        ids = torch.cat([held.prompt_ids, held.response_ids], dim=1)
        mask = torch.cat([held.prompt_mask, held.response_mask], dim=1)
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    width = held.prompt_ids.shape[1]
    raw = torch.log_softmax(logits[:, width - 1 : -1], dim=-1).gather(-1, held.response_ids[..., None])[..., 0]
    torch.testing.assert_close(raw * held.response_mask, held.logprobs, atol=1e-4, rtol=0)


def test_a_prompt_budget_below_min_new_tokens_still_ends_the_response(model: PreTrainedModel) -> None:
    params = SamplingParams(max_new_tokens=8, temperature=0.0, eos_token_id=EOS, min_new_tokens=6)
    out = _engine(model).generate(PROMPTS[:2], params, max_new_tokens=[3, 8])
    assert out.response_lengths.tolist()[0] == 3
    assert out.response_lengths.tolist()[1] >= 6


def _first_stop(response: list[int], stop: str, decoder: object, min_new_tokens: int = 0) -> list[int]:
    """``response`` cut after the first token (past ``min_new_tokens``) whose text
    completes ``stop``, the way vLLM's detokenizer decides (reference implementation)."""
    for k in range(min_new_tokens + 1, len(response) + 1):
        before, text = decoder.decode(response[: k - 1]), decoder.decode(response[:k])  # type: ignore[attr-defined]
        start = max(len(before) - len(stop) + 1, 0)
        if text.find(stop, start) != -1:
            return response[:k]
    return response


@pytest.mark.parametrize("decoder", [TOKENIZER, PairDecoder()], ids=["chars", "pairs"])
def test_stop_strings_end_responses_after_the_completing_token(model: PreTrainedModel, decoder: object) -> None:
    params = SamplingParams(max_new_tokens=16, temperature=0.0)
    engine = _engine(model, decoder)
    free = _responses(engine.generate(PROMPTS, params))
    # A stop string from the middle of the first response; with pairs it ends inside a token.
    text = decoder.decode(free[0])  # type: ignore[attr-defined]
    stop = text[7:9]
    out = engine.generate(PROMPTS, msgspec.structs.replace(params, stop=[stop, "never"]))
    expected = [_first_stop(response, stop, decoder) for response in free]
    assert _responses(out) == expected
    assert len(expected[0]) < 16
    for row, kept in enumerate(expected):
        assert out.response_mask[row].tolist() == [1] * len(kept) + [0] * (16 - len(kept))
        assert out.response_ids[row, len(kept) :].eq(params.pad_token_id).all()
        assert bool((out.logprobs[row, len(kept) :] == 0).all())
        assert stop in decoder.decode(kept) or kept == free[row]  # type: ignore[attr-defined]
    if isinstance(decoder, PairDecoder):
        # The token that completed the stop string is kept whole, past the stop string.
        assert not decoder.decode(expected[0]).endswith(stop)


def test_stop_strings_are_not_looked_for_within_min_new_tokens(model: PreTrainedModel) -> None:
    params = SamplingParams(max_new_tokens=16, temperature=0.0)
    engine = _engine(model)
    free = _responses(engine.generate(PROMPTS, params))
    stop = TOKENIZER.decode(free[0][1:3])
    out = engine.generate(PROMPTS, msgspec.structs.replace(params, stop=[stop], min_new_tokens=3))
    expected = [_first_stop(response, stop, TOKENIZER, min_new_tokens=3) for response in free]
    assert _responses(out) == expected
    assert len(expected[0]) > 3


def test_stop_string_matching_follows_vllms_rule() -> None:
    decoder = PairDecoder()  # token i is chr(65 + i) + chr(97 + i): 0 -> "Aa", 1 -> "Bb"
    stop = StopStrings(decoder, ["aB"], min_new_tokens=0)
    assert not stop.ended([0])
    assert stop.ended([0, 1])  # "AaBb": completed in the middle of token 1
    late = StopStrings(decoder, ["aB"], min_new_tokens=2)
    # Completed while the response was within min_new_tokens: never looked at again.
    assert not late.ended([0, 1]) and not late.ended([0, 1, 2])
    assert late.ended([0, 1, 2, 0, 1])
    long = StopStrings(decoder, ["CcAaBb"], min_new_tokens=0)
    assert long.ended([5] * 40 + [2, 0, 1]) and not long.ended([5] * 40 + [2, 0])


def test_seeded_sampling_with_options_is_reproducible(model: PreTrainedModel) -> None:
    params = SamplingParams(
        max_new_tokens=16, temperature=1.0, top_k=8, top_p=0.9, seed=5, eos_token_id=EOS,
        min_new_tokens=3, stop=["+"],
    )
    first = _engine(model).generate(PROMPTS, params)
    again = _engine(model).generate(PROMPTS, params)
    assert torch.equal(first.response_ids, again.response_ids)
    assert torch.equal(first.logprobs, again.logprobs)
    other = _engine(model).generate(PROMPTS, msgspec.structs.replace(params, seed=6))
    assert not torch.equal(first.response_ids, other.response_ids)


def test_a_migrated_sample_counts_its_carried_tokens_towards_min_new_tokens(model: PreTrainedModel) -> None:
    eos = _frequent_token(model, SamplingParams(max_new_tokens=12, temperature=0.0))
    params = SamplingParams(max_new_tokens=12, temperature=0.0, eos_token_id=eos, min_new_tokens=4)
    engine = _engine(model)
    whole = _responses(engine.generate(PROMPTS, params))
    run = engine.start(PROMPTS, params)
    run.step()  # prefill + first token, then one decode step
    moved = run.export()
    carried = {partial.index: len(partial.response_ids) for partial in moved}
    assert len(carried) == len(PROMPTS)  # the running samples and the waiting ones
    # A moved sample with tokens ends at EOS sooner after the move than min_new_tokens:
    # had the engine not counted its carried tokens, it would have held EOS out there.
    assert any(
        carried[i] > 0 and whole[i][-1] == eos
        and params.min_new_tokens < len(whole[i]) <= params.min_new_tokens + carried[i]
        for i in carried
    ), (carried, whole)
    other = engine.start([], params)
    other.admit(moved)
    samples = {sample.index: sample.response_ids for sample in _drain(other)}
    assert samples.keys() == carried.keys()
    for index in carried:
        assert samples[index] == whole[index], index


def _drain(run: object) -> list:  # type: ignore[type-arg]
    done = []
    while run.pending:  # type: ignore[attr-defined]
        done += run.step()  # type: ignore[attr-defined]
    return done


def test_options_are_validated_naming_the_field(model: PreTrainedModel) -> None:
    with pytest.raises(ConfigError, match="min_new_tokens"):
        SamplingParams(max_new_tokens=4, min_new_tokens=5)
    with pytest.raises(ConfigError, match="min_new_tokens"):
        SamplingParams(min_new_tokens=-1)
    with pytest.raises(ConfigError, match="stop"):
        SamplingParams(stop=["x", ""])
    with pytest.raises(ConfigError, match="stop"):
        SamplingParams(stop="x")  # type: ignore[arg-type]
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    decoded = msgspec.json.decode(b'{"stop": ["a"], "min_new_tokens": 2}', type=SamplingParams)
    assert decoded.stop == ("a",) and decoded.min_new_tokens == 2
    no_tokenizer = NativeRolloutEngine(model, config=_config())
    with pytest.raises(ConfigError, match=r"stop.*tokenizer"):
        no_tokenizer.start(PROMPTS, SamplingParams(stop=["+"]))


def test_sampling_config_exposes_the_options() -> None:
    config = msgspec.convert({"min_new_tokens": 2, "stop": ["\n\n"]}, SamplingConfig)
    params = config.params(seed=1)
    assert params.min_new_tokens == 2 and params.stop == ("\n\n",)
    with pytest.raises(ConfigError, match=r"sampling\.min_new_tokens"):
        SamplingConfig(max_new_tokens=4, min_new_tokens=5)
    with pytest.raises(ConfigError, match=r"sampling\.stop"):
        SamplingConfig(stop=("",))
    with pytest.raises(msgspec.ValidationError, match="stop"):
        msgspec.convert({"stop": "x"}, SamplingConfig)

