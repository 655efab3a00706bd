"""The policy's tokenizer as prompts need it: plain text with the tokenizer's own
special tokens, chat messages through its chat template.

A model directory holds either the repository's :class:`~workers.models.CharTokenizer`
(the tiny synthetic-task models) or any tokenizer ``transformers.AutoTokenizer``
loads from local files; :class:`PromptTokenizer` gives both the same surface.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from channels import ConfigError
from workers.models._tokenizer import CharTokenizer
from workers.models._tokenizer_dir import load_tokenizer

__all__ = ["PromptTokenizer", "load_prompt_tokenizer"]

class PromptTokenizer:
    """Encodes prompts for the policy and decodes ids back to text.

    Build with :func:`load_prompt_tokenizer`. It also serves as the
    :class:`~workers.rewards.Decoder` of :func:`~workers.rewards.row_columns`.

    Args:
        tokenizer: a :class:`~workers.models.CharTokenizer` or a transformers tokenizer.
        source: the directory it was loaded from, for messages.

    Raises:
        ConfigError: the tokenizer has no EOS token (generation needs one).
    """

    def __init__(self, tokenizer: Any, *, source: str) -> None:
        self.tokenizer = tokenizer
        self.source = source
        if tokenizer.eos_token_id is None:
            raise ConfigError(f"the tokenizer at {source} has no EOS token (eos_token in "
                              "tokenizer_config.json); generation needs one to stop")

    @property
    def is_char_tokenizer(self) -> bool:
        """Whether this is the repository's :class:`~workers.models.CharTokenizer`."""
        return isinstance(self.tokenizer, CharTokenizer)

    @property
    def eos_token_id(self) -> int:
        """The end-of-sequence id."""
        return int(self.tokenizer.eos_token_id)

    @property
    def pad_token_id(self) -> int:
        """The id prompts are left-padded with: the pad token, or EOS when the
        tokenizer has none (padding is masked out, so any id would do)."""
        pad = self.tokenizer.pad_token_id
        return int(pad) if pad is not None else self.eos_token_id

    @property
    def has_chat_template(self) -> bool:
        """Whether chat-message prompts can be rendered."""
        return not self.is_char_tokenizer and bool(getattr(self.tokenizer, "chat_template", None))

    def encode_text(self, text: str) -> list[int]:
        """Plain text as ids, with the special tokens the tokenizer adds itself
        (e.g. BOS), as the model saw them in training.

        Raises:
            ConfigError: the CharTokenizer's alphabet lacks a character of ``text``.
        """
        if self.is_char_tokenizer:
            return list(self.tokenizer.encode(text))
        return [int(i) for i in self.tokenizer(text)["input_ids"]]

    def encode_chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Chat messages rendered with the chat template, the assistant's turn opened
        (``add_generation_prompt``). The template writes the special tokens itself,
        so none is added on top (no second BOS).

        Args:
            messages: ``[{"role": "user", "content": "..."}, ...]``.

        Returns:
            The ids of the rendered conversation.

        Raises:
            ConfigError: the tokenizer has no chat template, or the template rejects
                the messages (e.g. roles that do not alternate).
        """
        if not self.has_chat_template:
            raise ConfigError(f"the prompt holds chat messages but the model at {self.source} has no chat "
                              "template (chat_template in its tokenizer files); give the prompt as plain text "
                              "or use a model with a chat template")
        from jinja2 import TemplateError

        try:
            # return_dict=False: transformers 5 returns a BatchEncoding otherwise.
            ids = self.tokenizer.apply_chat_template(
                list(messages), add_generation_prompt=True, tokenize=True, return_dict=False)
        except (TemplateError, ValueError, TypeError, KeyError) as e:
            raise ConfigError(f"the chat template of the model at {self.source} failed on these messages "
                              f"({type(e).__name__}: {e})") from None
        if isinstance(ids, Mapping):  # a transformers version that ignores return_dict
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        """Ids back to text.

        Args:
            ids: token ids.
            skip_special_tokens: drop BOS, EOS, padding and the other special tokens.

        Returns:
            The text.
        """
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))


def load_prompt_tokenizer(model_dir: str | Path) -> PromptTokenizer:
    """The tokenizer saved in a model directory (:func:`workers.models.load_tokenizer`),
    as prompts need it.

    Raises:
        ConfigError: the directory does not exist, holds no tokenizer files,
            transformers cannot load them, or the tokenizer has no EOS token.
    """
    return PromptTokenizer(load_tokenizer(model_dir), source=str(Path(model_dir)))
