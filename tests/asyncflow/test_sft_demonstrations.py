"""SFT demonstrations (``[sft] demonstration_share``): a demonstration's tokens and
loss mask are those of the episode of a policy that acts as it does, position by
position; the warm start trains on them and measures episodes; mistakes are
configuration errors that name the key. No Ray is started here."""

from __future__ import annotations

import string
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncflow.train._start_model as start_model
from asyncflow.train import Trainer, load_config
from asyncflow.train._demonstrations import demonstrate, demonstrated, sft_rows
from asyncflow.train._sft import SFTConfig, sft_warm_start
from channels import ConfigError
from workers.data import ArithmeticProblem, ArithmeticTaskConfig, generate_splits, sft_batch
from workers.episodes import MAX_TURNS_LIMIT, Episode, EpisodeConfig, EpisodeRun, episode_rows
from workers.models import (
    CharTokenizer,
    CharTokenizerConfig,
    PromptTokenizer,
    TinyModelConfig,
    load_model,
)
from workers.rollout import FinishedSample, PartialSample, SamplingParams

torch.set_num_threads(1)

EXAMPLE = Path(__file__).parents[2] / "examples" / "arith_tools.toml"
SYMBOLS = (*"0123456789+-*= (),;:'._", *string.ascii_letters)
TOKENIZER = CharTokenizer(CharTokenizerConfig(symbols=SYMBOLS))
TASK = ArithmeticTaskConfig(digits=3, operators=("*",), train_size=64, eval_size=16)
TURNS = ("mul({left},{right})",)


def mul(a: int, b: int) -> int:
    return a * b


def episodes(**changes: Any) -> EpisodeConfig:
    settings: dict[str, Any] = {"env": "workers.episodes:ToolEnv", "settings": {"tools": [mul], "format": "text"},
                                "format": "text", "text_template": "={observation};", "max_turns": 3,
                                "max_tokens": 48}
    return EpisodeConfig(**(settings | changes))


class Scripted:
    """An engine whose turns are given: turn ``t`` of episode ``k`` is ``turns[k][t]``."""

    def __init__(self, turns: Sequence[Sequence[list[int]]]) -> None:
        self.turns = turns
        self.admitted: list[PartialSample] = []

    def start(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> Scripted:
        assert not prompts
        return self

    @property
    def pending(self) -> int:
        return len(self.admitted)

    def admit(self, samples: Sequence[PartialSample]) -> None:
        self.admitted += samples

    def step(self) -> list[FinishedSample]:
        out = []
        for s in self.admitted:
            ids = self.turns[s.index // MAX_TURNS_LIMIT][s.index % MAX_TURNS_LIMIT]
            out.append(FinishedSample(index=s.index, response_ids=ids, logprobs=[-0.5] * len(ids)))
        self.admitted = []
        return out

    def close(self) -> None:
        pass


def _episodes_acting_as(problems: Sequence[ArithmeticProblem], config: EpisodeConfig) -> list[Episode]:
    """The RL runner's episodes of a policy that calls ``mul`` and then answers."""
    eos = TOKENIZER.eos_token_id
    turns = [[[*TOKENIZER.encode(f"mul({p.left},{p.right})", add_bos=False), eos],
              [*TOKENIZER.encode(p.answer, add_bos=False), eos]] for p in problems]
    params = SamplingParams(max_new_tokens=13, eos_token_id=eos, pad_token_id=TOKENIZER.pad_token_id)
    run = EpisodeRun(Scripted(turns), [TOKENIZER.encode(p.prompt) for p in problems],
                     [{"prompt": p.prompt, "answer": p.answer} for p in problems], n=1, params=params, config=config,
                     tokenizer=PromptTokenizer(TOKENIZER, source="test"), where="test")
    ended: list[Episode] = []
    try:
        while run.pending:
            ended += run.advance()
    finally:
        run.close()
    return sorted(ended, key=lambda e: e.index)


def test_a_demonstration_is_the_episode_of_a_policy_that_acts_so_position_by_position() -> None:
    config = episodes()
    problems = list(generate_splits(TASK).train[:6])
    shown = dict(zip(problems[:4], demonstrate(problems[:4], TOKENIZER, TURNS, config), strict=True))
    batch = sft_rows(problems, TOKENIZER, shown)
    played = _episodes_acting_as(problems[:4], config)
    assert [e.index for e in played] == [0, 1, 2, 3]  # one episode per demonstrated problem
    for i, (problem, episode) in enumerate(zip(problems[:4], played, strict=True)):
        assert episode.outcome == "done" and episode.turns == 2 and episode.reward == 1.0
        prompt = TOKENIZER.encode(problem.prompt)
        row = episode_rows({"prompt_ids": torch.tensor([prompt]), "prompt_mask": torch.ones(1, len(prompt))},
                           [episode], width=batch["response_ids"].shape[1], pad=TOKENIZER.pad_token_id, version=0)
        kept = batch["prompt_mask"][i].bool()
        assert batch["prompt_ids"][i][kept].tolist() == prompt
        for column in ("response_ids", "response_mask", "observation_mask"):
            assert batch[column][i].tolist() == row[column][0].tolist(), column
        text = TOKENIZER.decode(episode.tokens, skip_special_tokens=False)
        assert text == f"mul({problem.left},{problem.right})<eos>={problem.answer};{problem.answer}<eos>"
    # Direct answers are what the warm start always taught: sft_batch's rows.
    direct = sft_batch(problems[4:], TOKENIZER)
    width = direct["response_ids"].shape[1]
    assert torch.equal(batch["response_ids"][4:, :width], direct["response_ids"])
    assert torch.equal(batch["response_mask"][4:, :width], direct["response_mask"])
    assert not batch["observation_mask"][4:].any() and not batch["response_mask"][4:, width:].any()


def test_the_share_of_demonstrations_is_spread_over_the_problems() -> None:
    assert demonstrated(10, 0.3) == [1, 4, 8]
    assert len(demonstrated(7000, 0.3)) == 2100
    assert demonstrated(5, 0.0) == [] and demonstrated(5, 1.0) == [0, 1, 2, 3, 4]


class EndsAtOnce:
    def reset(self, row: Mapping[str, Any]) -> None:
        return None

    def step(self, action: str) -> tuple[str, float, bool]:
        return "", 1.0, True


class Raises(EndsAtOnce):
    def step(self, action: str) -> tuple[str, float, bool]:
        raise RuntimeError("the calculator is broken")


class Hangs(EndsAtOnce):
    release = threading.Event()  # set at the test's end: the stuck call's thread ends then

    def step(self, action: str) -> tuple[str, float, bool]:
        self.release.wait(60)
        return "", 1.0, True


def test_an_environment_that_hangs_in_a_demonstration_times_out() -> None:
    began = time.monotonic()
    try:
        with pytest.raises(ConfigError, match=r"the environment took more than \[env\] timeout_s = 0.2 s per call"):
            demonstrate(generate_splits(TASK).train[:2], TOKENIZER, TURNS, episodes(env=Hangs, settings={},
                                                                                     timeout_s=0.2))
        assert time.monotonic() - began < 30  # at its timeout, not when the step gave up
    finally:
        Hangs.release.set()


def test_a_demonstration_the_environment_does_not_play_along_is_a_config_error() -> None:
    problems = generate_splits(TASK).train[:2]
    with pytest.raises(ConfigError, match="ended the episode after turn 1 of 2"):
        demonstrate(problems, TOKENIZER, TURNS, episodes(env=EndsAtOnce, settings={}))
    with pytest.raises(ConfigError, match="raised RuntimeError: the calculator is broken"):
        demonstrate(problems, TOKENIZER, TURNS, episodes(env=Raises, settings={}))
    with pytest.raises(ConfigError, match="reward 0"):  # the answer's reward: exact match with another answer
        demonstrate(problems, TOKENIZER, TURNS,
                    episodes(settings={"tools": [mul], "format": "text", "reward": lambda answer, row: 0.0}))
    with pytest.raises(ConfigError, match="max_turns = 1"):
        demonstrate(problems, TOKENIZER, TURNS, episodes(max_turns=1))
    with pytest.raises(ConfigError, match="max_tokens = 20"):
        demonstrate(problems, TOKENIZER, TURNS, episodes(max_tokens=20))
    with pytest.raises(ConfigError, match=r"not in CharTokenizerConfig\.symbols"):  # the template's ';'
        demonstrate(problems, CharTokenizer(CharTokenizerConfig(symbols=(*"0123456789*=(),", *"mul"))), TURNS,
                    episodes())


def test_bad_demonstration_settings_are_config_errors_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"SFTConfig\.demonstration_share must be in \[0, 1\]"):
        SFTConfig(demonstration_share=1.5)
    with pytest.raises(ConfigError, match=r"SFTConfig\.demonstration_turns is empty"):
        SFTConfig(demonstration_share=0.5)
    with pytest.raises(ConfigError, match=r"sft\.demonstration_turns\[0\] = 'mul\(\{a\},\{b\}\)' cannot be filled"):
        load_config(EXAMPLE, {"sft.demonstration_turns": ["mul({a},{b})"]})
    with pytest.raises(ConfigError, match=r"sft\.demonstration_turns\[0\]: the turn 'mul\(999,999\)' is 13 tokens"):
        load_config(EXAMPLE, {"algorithm.sampling.max_new_tokens": 12})
    with pytest.raises(ConfigError, match=r"sft\.demonstration_turns\[0\]: .*'\[' .*sft\.model\.tokenizer"):
        load_config(EXAMPLE, {"sft.demonstration_turns": ["mul[{left},{right}]"]})
    without_env = tmp_path / "no_env.toml"
    text = EXAMPLE.read_text()
    without_env.write_text(text[:text.index("[env]")] + text[text.index("[sft]"):])
    with pytest.raises(ConfigError, match=r"sft\.demonstration_share = 0\.3 .* add \[env\]"):
        load_config(without_env)
    with pytest.raises(ConfigError, match="add \\[env\\]"):
        sft_warm_start(tmp_path / "sft", SFTConfig(demonstration_share=0.5, demonstration_turns=TURNS), TASK)


def test_the_warm_start_trains_on_demonstrations_and_measures_episodes(tmp_path: Path) -> None:
    model = TinyModelConfig(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=2,
                            head_dim=32, max_position_embeddings=64, tokenizer=TOKENIZER.config)
    config = SFTConfig(model=model, steps=4, batch_size=16, warmup_steps=1, stop_at_train_accuracy=1.0,
                       probe_every=2, probe_size=8, demonstration_share=0.5, demonstration_turns=TURNS)
    metrics = sft_warm_start(tmp_path / "sft", config, TASK, episodes())
    assert metrics["demonstrations"] == 32.0 and metrics["steps"] == 4.0
    assert 0.0 <= metrics["train_accuracy"] <= 1.0 and 0.0 <= metrics["eval_accuracy"] <= 1.0
    assert 1.0 <= metrics["eval_turns"] <= 3.0
    assert load_model(tmp_path / "sft") is not None
    assert CharTokenizer.from_pretrained(tmp_path / "sft").vocab_size == TOKENIZER.vocab_size


def test_the_environment_demonstrated_keys_the_warm_starts_directory(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    trained: list[object] = []

    def fake_sft(out: Path, config: SFTConfig, task: object, episodes: EpisodeConfig | None = None) -> dict[str, float]:
        trained.append(episodes)
        out.mkdir(parents=True)
        return {"loss": 0.0}

    monkeypatch.setattr(start_model, "sft_warm_start", fake_sft)
    out = {"output_dir": str(tmp_path / "out")}
    one = Trainer(load_config(EXAMPLE, out), say=lambda line: None).model_dir()
    other = Trainer(load_config(EXAMPLE, out | {"env.text_template": " -> {observation};"}),
                    say=lambda line: None).model_dir()
    direct = Trainer(load_config(EXAMPLE, out | {"sft.demonstration_share": 0}), say=lambda line: None).model_dir()
    assert len({one, other, direct}) == 3
    first = trained[0]
    assert isinstance(first, EpisodeConfig) and first.text_template == "={observation};"

