"""The prompts of a run, as generation batches, from its ``[data]`` source: the
built-in arithmetic problems or the user's files.

Both give the trainer the same three things: how many training prompts there are,
a batch of them by index (with uids unique over the run), and the fixed held-out
batch. Batches of training indices are drawn by :func:`iter_problem_batches` over
``range(train_size)``, so a run's data order is a function of the seed and of the
number of batches drawn, which checkpoints keep (exact resume);
:class:`TrainBatches` draws them and puts each on the first pool.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from torch import Tensor

from asyncflow.runtime import DataFuture, Session
from asyncflow.train._config import RunConfig
from channels import ConfigError
from workers.data import (
    ArithmeticProblem,
    PromptDataset,
    batch_widths,
    check_fits_context,
    generate_splits,
    iter_problem_batches,
    load_rows,
    prompt_batch,
)
from workers.models import CharTokenizer, load_prompt_tokenizer, read_architecture


class RunPrompts(Protocol):
    """A run's training and held-out prompts."""

    @property
    def train_size(self) -> int:
        """Training prompts (indices ``0 .. train_size - 1``)."""
        ...

    @property
    def context(self) -> int:
        """Tokens the longest prompt and its response may need (for the rollout
        engine's context length)."""
        ...

    def summary(self) -> list[str]:
        """Lines for the run's log (sizes, prompts dropped)."""
        ...

    def train_batch(self, indices: Sequence[int], *, first_uid: int) -> dict[str, Tensor]:
        """The training prompts ``indices``; row ``i`` gets uid ``first_uid + i``."""
        ...

    def eval_batch(self, *, first_uid: int) -> dict[str, Tensor]:
        """The held-out prompts (always the same ones)."""
        ...


@dataclass
class ArithmeticPrompts:
    """The arithmetic source (``[data.arithmetic]``) with the character tokenizer."""

    train: list[ArithmeticProblem]
    eval: list[ArithmeticProblem]
    tokenizer: CharTokenizer
    context: int
    widths: tuple[int, int]
    """Every batch's prompt and answer widths (the longest of all the problems), so
    that the run's batches can be joined."""

    @classmethod
    def build(cls, config: RunConfig, model_dir: str, max_new_tokens: int) -> ArithmeticPrompts:
        splits = generate_splits(config.data.arithmetic)
        tokenizer = CharTokenizer.from_pretrained(model_dir)
        limit = read_architecture(model_dir).max_position_embeddings
        problems = list(splits.train) + list(splits.eval)
        check_fits_context(problems, tokenizer, max_new_tokens=max_new_tokens, max_positions=limit,
                           fix=f"lower {response_key(config)} or data.arithmetic.digits, or start from a model "
                               "with a longer context")
        widths = batch_widths(problems, tokenizer)
        return cls(train=list(splits.train), eval=list(splits.eval)[: config.train.eval_size],
                   tokenizer=tokenizer, context=widths[0] + max_new_tokens, widths=widths)

    @property
    def train_size(self) -> int:
        return len(self.train)

    def summary(self) -> list[str]:
        return [f"task: {len(self.train)} training and {len(self.eval)} held-out arithmetic problems"]

    def train_batch(self, indices: Sequence[int], *, first_uid: int) -> dict[str, Tensor]:
        return prompt_batch([self.train[i] for i in indices], self.tokenizer, first_uid=first_uid,
                            widths=self.widths)

    def eval_batch(self, *, first_uid: int) -> dict[str, Tensor]:
        return prompt_batch(self.eval, self.tokenizer, first_uid=first_uid, widths=self.widths)


@dataclass
class FilePrompts:
    """Prompts from ``data.train`` and ``data.eval``, tokenized with the model's own
    tokenizer (chat messages through its chat template)."""

    train: PromptDataset
    eval: PromptDataset
    eval_rows: list[int]
    context: int

    @classmethod
    def build(cls, config: RunConfig, model_dir: str, max_new_tokens: int) -> FilePrompts:
        d, response = config.data, f"{response_key(config)} ({max_new_tokens})"
        limit = read_architecture(model_dir).max_position_embeddings
        if d.max_prompt_tokens:
            budget, longer = d.max_prompt_tokens, "raise data.max_prompt_tokens or shorten the prompts"
            if budget + max_new_tokens > limit:
                raise ConfigError(f"data.max_prompt_tokens ({budget}) + {response} is more than the model's context "
                                  f"of {limit} tokens; lower one of them")
        else:  # the prompts get what the responses leave of the context
            budget, longer = limit - max_new_tokens, f"lower {response} or shorten the prompts"
            if budget < 1:
                raise ConfigError(f"{response} leaves no room for a prompt in the model's context of {limit} "
                                  "tokens; lower it")
        tokenizer = load_prompt_tokenizer(model_dir)
        sets = [PromptDataset.from_rows(load_rows(file, key=key), tokenizer, prompt_field=d.prompt,
                                        max_prompt_tokens=budget, key=key, source=file, longer=longer)
                for key, file in (("data.train", d.train), ("data.eval", d.eval))]
        train, held_out = sets
        return cls(train=train, eval=held_out, eval_rows=list(range(min(len(held_out), config.train.eval_size))),
                   context=max(train.longest_prompt, held_out.longest_prompt) + max_new_tokens)

    @property
    def train_size(self) -> int:
        return len(self.train)

    def summary(self) -> list[str]:
        return [self.train.describe(), self.eval.describe()
                + f" ({len(self.eval_rows)} evaluated)"]

    def train_batch(self, indices: Sequence[int], *, first_uid: int) -> dict[str, Tensor]:
        return self.train.batch(indices, first_uid=first_uid)

    def eval_batch(self, *, first_uid: int) -> dict[str, Tensor]:
        return self.eval.batch(self.eval_rows, first_uid=first_uid)


def run_prompts(config: RunConfig, model_dir: str, max_new_tokens: int) -> RunPrompts:
    """The run's prompts, from ``[data]``'s source.

    Raises:
        ConfigError: a prompt does not fit the model's context with the responses,
            or a step takes more prompts (``train.prompts_per_step``) than there are.
    """
    prompts: RunPrompts
    if config.data.kind == "files":
        prompts, source = FilePrompts.build(config, model_dir, max_new_tokens), f"data.train = '{config.data.train}'"
    else:
        prompts, source = ArithmeticPrompts.build(config, model_dir, max_new_tokens), "data.arithmetic.train_size"
    if config.train.prompts_per_step > prompts.train_size:
        raise ConfigError(f"train.prompts_per_step = {config.train.prompts_per_step} is more than the "
                          f"{prompts.train_size} training prompts ({source}); lower it or give more prompts")
    return prompts


def response_key(config: RunConfig) -> str:
    """The key that sets how many tokens follow a prompt
    (:func:`~asyncflow.train._config.response_width`)."""
    return "[env] max_tokens" if config.env is not None else "algorithm.sampling.max_new_tokens"


class TrainBatches:
    """The training prompts, one batch at a time, put on the first pool; ``next``
    is also what an algorithm that draws more (``Algorithm.draws``) calls."""

    def __init__(self, session: Session, prompts: RunPrompts, size: int, *, seed: int, skip: int) -> None:
        self.session, self.prompts, self.size = session, prompts, size
        order = iter_problem_batches(range(prompts.train_size), size, seed=seed)
        self._batches = itertools.islice(order, skip, None)
        self.drawn = skip

    async def next(self) -> DataFuture[Any]:
        """The next batch of prompts (uids unique over the run)."""
        indices = next(self._batches)
        self.drawn += 1
        return await self.session.put(self.prompts.train_batch(indices, first_uid=(self.drawn - 1) * self.size))
