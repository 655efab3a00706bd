"""Episodes on one engine, in-process: token-in/token-out rows, the training engine's
log-probs of the sampled tokens, zero loss weight on observations, overlapped
environment calls, budgets and outcomes."""

from __future__ import annotations

import asyncio
import copy
import re
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from support_hf import save_tiny_hf_llama
from workers.engines import TrainingConfig, TrainingEngine
from workers.episodes import (
    MAX_TURNS_LIMIT,
    OUTCOMES,
    Episode,
    EpisodeConfig,
    EpisodeRun,
    ObservationCodec,
    episode_rows,
)
from workers.models import PromptTokenizer, load_prompt_tokenizer
from workers.objectives import PolicyLoss
from workers.rollout import FinishedSample, NativeRolloutConfig, NativeRolloutEngine, SamplingParams

torch.set_num_threads(1)


class Counter:
    """Says how long each action was; done after ``turns`` turns, 1.0 reward each.
    Counts the calls in flight at once over all episodes (``in_flight_max``)."""

    in_flight = 0
    in_flight_max = 0
    lock = threading.Lock()

    def __init__(self, turns: int = 3, sleep_s: float = 0.0) -> None:
        self.turns, self.sleep_s, self.seen = turns, sleep_s, 0

    async def reset(self, row: Mapping[str, Any]) -> str:
        return f"start {row['uid']}"

    async def step(self, action: str) -> tuple[str, float, bool]:
        with Counter.lock:
            Counter.in_flight += 1
            Counter.in_flight_max = max(Counter.in_flight_max, Counter.in_flight)
        try:
            await asyncio.sleep(self.sleep_s)
        finally:
            with Counter.lock:
                Counter.in_flight -= 1
        self.seen += 1
        return f"len {len(action)}", 1.0, self.seen >= self.turns


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_hf_llama(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> PromptTokenizer:
    return load_prompt_tokenizer(model_dir)


@pytest.fixture(scope="module")
def model(model_dir: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


class Recording:
    """A native engine whose runs record every sample they finish."""

    def __init__(self, model: PreTrainedModel, tokenizer: PromptTokenizer) -> None:
        self.engine = NativeRolloutEngine(copy.deepcopy(model), config=NativeRolloutConfig(max_batch_size=8),
                                          tokenizer=tokenizer.tokenizer)
        self.samples: dict[int, FinishedSample] = {}

    def start(self, prompts: Sequence[Sequence[int]], params: SamplingParams, **kwargs: Any) -> Any:
        run = self.engine.start(prompts, params, **kwargs)
        step = run.step

        def recorded() -> list[FinishedSample]:
            out = step()
            self.samples.update({s.index: s for s in out})
            return out

        run.step = recorded  # type: ignore[method-assign]
        return run


def _prompts(tokenizer: PromptTokenizer, count: int) -> list[list[int]]:
    return [tokenizer.encode_chat([{"role": "user", "content": f"What is {i} + 7?"}]) for i in range(count)]


def _run(engine: Any, tokenizer: PromptTokenizer, config: EpisodeConfig, *, prompts: int = 4, n: int = 2,
         max_new: int = 6, seed: int = 1) -> list[Episode]:
    lists = _prompts(tokenizer, prompts)
    params = SamplingParams(max_new_tokens=max_new, eos_token_id=tokenizer.eos_token_id, seed=seed,
                            pad_token_id=tokenizer.pad_token_id)
    run = EpisodeRun(engine, lists, [{"uid": g} for g in range(prompts)], n=n, params=params, config=config,
                     tokenizer=tokenizer, where="test")
    ended: list[Episode] = []
    try:
        while run.pending:
            ended += run.advance()
    finally:
        run.close()
    assert sorted(e.index for e in ended) == list(range(prompts * n))
    return sorted(ended, key=lambda e: e.index)


def _rows(episodes: list[Episode], tokenizer: PromptTokenizer, width: int, n: int) -> dict[str, torch.Tensor]:
    groups = [episodes[i:i + n] for i in range(0, len(episodes), n)]
    prompts = _prompts(tokenizer, len(groups))
    wide = max(len(p) for p in prompts)
    parts = []
    for prompt, group in zip(prompts, groups, strict=True):
        ids = torch.full((1, wide), tokenizer.pad_token_id, dtype=torch.int64)
        ids[0, wide - len(prompt):] = torch.tensor(prompt)
        mask = torch.zeros((1, wide), dtype=torch.int64)
        mask[0, wide - len(prompt):] = 1
        parts.append(episode_rows({"prompt_ids": ids, "prompt_mask": mask}, group, width=width,
                                  pad=tokenizer.pad_token_id, version=0))
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def test_rows_hold_the_sampled_tokens_and_the_observations_position_by_position(
        model: PreTrainedModel, tokenizer: PromptTokenizer) -> None:
    engine = Recording(model, tokenizer)
    config = EpisodeConfig(env=Counter, settings={"turns": 3}, max_turns=4, max_tokens=96)
    episodes = _run(engine, tokenizer, config)
    codec = ObservationCodec(tokenizer)
    eos = tokenizer.eos_token_id
    for e in episodes:
        assert e.outcome == "done" and e.turns == 3 and e.reward == 3.0
        want, sampled = codec.encode_first(f"start {e.index // 2}"), []
        sampled = [False] * len(want)
        for t in range(e.turns):
            turn = engine.samples[e.index * MAX_TURNS_LIMIT + t]
            want += turn.response_ids
            sampled += [True] * len(turn.response_ids)
            if t < e.turns - 1:
                text = tokenizer.decode(list(turn.response_ids), skip_special_tokens=True)
                obs = codec.encode(f"len {len(text)}", after_eos=turn.response_ids[-1] == eos)
                want += obs
                sampled += [False] * len(obs)
        assert e.tokens == want
        assert e.sampled == sampled

    rows = _rows(episodes, tokenizer, 96, 2)
    for i, e in enumerate(episodes):
        length = len(e.tokens)
        assert rows["response_ids"][i, :length].tolist() == e.tokens
        assert rows["response_mask"][i, :length].tolist() == [int(s) for s in e.sampled]
        assert rows["observation_mask"][i, :length].tolist() == [int(not s) for s in e.sampled]
        assert not rows["response_mask"][i, length:].any() and not rows["observation_mask"][i, length:].any()
        assert rows["turn_rewards"][i].sum() == 3.0 and rows["episode_reward"][i] == 3.0
        assert rows["episode_outcome"][i] == OUTCOMES.index("done")

    # The training engine reads the same sequence: its log-probs of the sampled tokens
    # are the rollout's.
    trainer = TrainingEngine(copy.deepcopy(model), config=TrainingConfig(micro_batch_size=3))
    logprobs, _ = trainer.log_probs(rows)
    sampled_mask = rows["response_mask"].bool()
    torch.testing.assert_close(logprobs[sampled_mask], rows["rollout_logprobs"][sampled_mask], rtol=0, atol=1e-5)
    assert (logprobs[rows["observation_mask"].bool()] == 0).all()


def test_the_chat_wrapping_of_an_observation_is_the_templates(tokenizer: PromptTokenizer) -> None:
    codec = ObservationCodec(tokenizer)
    assert codec.format == "chat"
    text = tokenizer.decode(codec.encode("len 5", after_eos=False), skip_special_tokens=False)
    assert text == "<|im_end|>\n<|im_start|>tool\nlen 5<|im_end|>\n<|im_start|>assistant\n"
    first = tokenizer.decode(codec.encode_first("hello"), skip_special_tokens=False)
    assert first == "<|im_start|>tool\nhello<|im_end|>\n<|im_start|>assistant\n"
    text = ObservationCodec(tokenizer, format="text", text_template=" -> {observation};")
    assert tokenizer.decode(text.encode("7", after_eos=True), skip_special_tokens=False) == " -> 7;"


def test_observation_tokens_carry_no_loss_weight(model: PreTrainedModel, tokenizer: PromptTokenizer) -> None:
    """An update whose advantages are huge on the observations' tokens moves the
    weights exactly as one whose advantages are 0 there."""
    engine = Recording(model, tokenizer)
    config = EpisodeConfig(env=Counter, settings={"turns": 2}, max_turns=2, max_tokens=64)
    rows = _rows(_run(engine, tokenizer, config, prompts=2), tokenizer, 64, 2)
    assert rows["observation_mask"].any()
    generator = torch.Generator().manual_seed(0)
    advantages = torch.randn(rows["response_ids"].shape, generator=generator) * rows["response_mask"]
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    weights = []
    for on_observations in (0.0, 1e3):
        batch = dict(rows, advantages=advantages + on_observations * rows["observation_mask"],
                     old_logprobs=rows["rollout_logprobs"])
        trainer = TrainingEngine(copy.deepcopy(model), config=TrainingConfig(lr=1e-2), loss=PolicyLoss())
        metrics = trainer.train_step(batch)
        assert metrics["step_skipped"] == 0.0 and metrics["grad_norm"] > 0, metrics  # the update happened
        weights.append({k: v.detach().clone() for k, v in trainer.model.state_dict().items()})
    assert weights[0].keys() == initial.keys()
    assert any(not torch.equal(tensor, initial[name]) for name, tensor in weights[0].items())
    for name, tensor in weights[0].items():
        torch.testing.assert_close(weights[1][name], tensor, rtol=0, atol=0, msg=name)


def test_episodes_wait_on_their_environments_together(model: PreTrainedModel, tokenizer: PromptTokenizer) -> None:
    Counter.in_flight_max = 0
    config = EpisodeConfig(env=Counter, settings={"turns": 2, "sleep_s": 0.2}, max_turns=2, max_tokens=64)
    episodes = _run(Recording(model, tokenizer), tokenizer, config, prompts=8, n=2)
    assert all(e.outcome == "done" for e in episodes)
    # 16 episodes: their calls overlap (one at a time would keep this at 1).
    assert Counter.in_flight_max >= 8


class Broken:
    """Per episode (by its prompt's uid): 0 raises at step, 1 hangs, 2 returns junk,
    3 behaves."""

    def __init__(self) -> None:
        self.kind = -1

    def reset(self, row: Mapping[str, Any]) -> None:
        self.kind = int(row["uid"])

    async def step(self, action: str) -> Any:
        if self.kind == 0:
            raise RuntimeError("the tool server is down")
        if self.kind == 1:
            await asyncio.sleep(30)
        if self.kind == 2:
            return "not a tuple"
        return None, 0.5, True


def test_an_environment_that_raises_hangs_or_breaks_its_protocol_ends_only_its_episode(
        model: PreTrainedModel, tokenizer: PromptTokenizer) -> None:
    config = EpisodeConfig(env=Broken, max_turns=3, max_tokens=64, timeout_s=1.0)
    episodes = _run(Recording(model, tokenizer), tokenizer, config, prompts=4, n=1)
    assert [e.outcome for e in episodes] == ["error", "timeout", "error", "done"]
    assert "RuntimeError: the tool server is down" in episodes[0].reason
    assert "took more than 1 s" in episodes[1].reason
    assert "return (observation, reward, done)" in episodes[2].reason
    assert [e.reward for e in episodes] == [0.0, 0.0, 0.0, 0.5]
    rows = _rows(episodes, tokenizer, 64, 1)
    assert rows["turn_rewards"].sum(dim=1).tolist() == [0.0, 0.0, 0.0, 0.5]


def test_on_error_fail_fails_the_call(model: PreTrainedModel, tokenizer: PromptTokenizer) -> None:
    from workers.episodes import EpisodeError

    config = EpisodeConfig(env=Broken, max_turns=3, max_tokens=64, on_error="fail")
    with pytest.raises(EpisodeError, match=r"RuntimeError: the tool server is down.*on_error"):
        _run(Recording(model, tokenizer), tokenizer, config, prompts=1, n=1)


class Chatty:
    """Never done; long observations."""

    def reset(self, row: Mapping[str, Any]) -> None:
        return None

    def step(self, action: str) -> tuple[str, float, bool]:
        return "word " * 12, 0.25, False


@pytest.mark.parametrize(("max_turns", "max_tokens", "outcome"), [(2, 512, "max_turns"), (50, 60, "budget")])
def test_turn_and_token_budgets_end_episodes(model: PreTrainedModel, tokenizer: PromptTokenizer, max_turns: int,
                                             max_tokens: int, outcome: str) -> None:
    config = EpisodeConfig(env=Chatty, max_turns=max_turns, max_tokens=max_tokens)
    episodes = _run(Recording(model, tokenizer), tokenizer, config, prompts=2, n=2)
    for e in episodes:
        assert e.outcome == outcome
        assert len(e.tokens) <= max_tokens
        if outcome == "max_turns":
            assert e.turns == max_turns and e.reward == 0.25 * max_turns


@pytest.mark.parametrize("done", ["false", None, 2, 0.0])
def test_done_that_is_not_a_bool_breaks_the_protocol(done: Any) -> None:
    """``"false"`` would read as True and ``None`` as False: neither is taken."""
    from workers.episodes._env import EnvProtocolError, checked_step

    with pytest.raises(EnvProtocolError, match=rf"Env\.step returned done {re.escape(repr(done))} \(\w+\); "
                                               r"return True or False"):
        checked_step(("ok", 1.0, done), "Env.step")
    import numpy as np

    for ok in (True, False, 1, 0, np.bool_(True)):
        assert checked_step(("ok", 1.0, ok), "Env.step") == ("ok", 1.0, bool(ok))


class AlwaysRaises(Broken):
    async def step(self, action: str) -> Any:
        raise RuntimeError("the tool server is down")


class LongReset(Broken):
    def reset(self, row: Mapping[str, Any]) -> str:
        return "9" * 80


def test_episodes_that_end_alike_are_logged_once_with_their_count(
        model: PreTrainedModel, tokenizer: PromptTokenizer, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="workers.episodes"):
        episodes = _run(Recording(model, tokenizer), tokenizer, EpisodeConfig(env=AlwaysRaises, max_turns=3,
                                                                              max_tokens=64), prompts=4, n=2)
    assert [e.outcome for e in episodes] == ["error"] * 8
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert re.fullmatch(r"test: episode \d ended \(error\): \S*AlwaysRaises\.step raised RuntimeError: the tool "
                        r"server is down", lines[0]), lines
    assert lines[1] == "test: 7 more episode(s) ended (error), as the one above"


def test_a_first_observation_that_leaves_no_turn_is_said(
        model: PreTrainedModel, tokenizer: PromptTokenizer, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="workers.episodes"):
        episodes = _run(Recording(model, tokenizer), tokenizer, EpisodeConfig(env=LongReset, max_turns=3,
                                                                              max_tokens=64), prompts=2, n=1)
    assert [(e.outcome, e.turns) for e in episodes] == [("budget", 0)] * 2
    assert "reset's observation is" in episodes[0].reason and "[env] max_tokens = 64" in episodes[0].reason
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "ended (budget) before its first turn" in lines[0], lines
    assert lines[1] == "test: 1 more episode(s) ended (budget before a turn), as the one above"


def test_a_call_that_cannot_start_for_calls_that_hang_is_not_blamed_for_hanging() -> None:
    from workers.episodes._env import EnvLoop, EnvThreadsBusy

    release = threading.Event()
    loop = EnvLoop(threads=1)
    try:
        stuck = loop.submit(lambda: release.wait(60), timeout_s=0.2)
        queued = loop.submit(lambda: "answered", timeout_s=0.2)
        with pytest.raises(TimeoutError) as hung:
            stuck.result(timeout=30)
        assert not isinstance(hung.value, EnvThreadsBusy)  # it ran, and took too long
        with pytest.raises(EnvThreadsBusy, match=r"did not start within 0.2 s: all 1 threads of the environment "
                                                 r"loop run calls that hang"):
            queued.result(timeout=30)
    finally:
        release.set()
