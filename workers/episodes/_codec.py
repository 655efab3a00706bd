"""Observations as tokens: what follows a turn in the episode's one token sequence.

The model's turns are never decoded and encoded again: each turn's tokens stay
exactly as the engine sampled them, and only the observation's own text is
encoded, once, with its wrapping:

- ``"chat"``: the chat template's wrapping of a message of ``observation_role``
  (``"tool"`` by default), found once by rendering a conversation with and without
  such a message. What the template writes after an assistant message (ChatML's
  ``<|im_end|>\\n``) comes first, less the end-of-turn token when the turn sampled
  it; then the wrapped observation and the opening of the next assistant turn.
- ``"text"``: ``text_template`` (``"{observation}"`` by default) filled in and
  encoded without special tokens, for models without a chat template (the
  repository's character-level models).
"""

from __future__ import annotations

from typing import Any, Literal

from channels import ConfigError
from workers.models import PromptTokenizer

__all__ = ["ObservationCodec"]

ObservationFormat = Literal["auto", "chat", "text"]
"""How observations are wrapped: ``"auto"`` is ``"chat"`` for a tokenizer with a
chat template, ``"text"`` otherwise."""

_MARK = "\u2063OBSERVATION\u2063"
_ASSISTANT = "\u2063ACTION\u2063"


class ObservationCodec:
    """Encodes observations for one policy's tokenizer (see the module docstring).

    Raises:
        ConfigError: ``"chat"`` for a tokenizer without a chat template, a template
            that cannot render a message of ``observation_role``, or a
            ``text_template`` without ``{observation}``.
    """

    def __init__(self, tokenizer: PromptTokenizer, *, format: ObservationFormat = "auto",
                 observation_role: str = "tool", text_template: str = "{observation}") -> None:
        self.tokenizer = tokenizer
        self.format: Literal["chat", "text"] = (
            ("chat" if tokenizer.has_chat_template else "text") if format == "auto" else format)
        if "{observation}" not in text_template:
            raise ConfigError(f"[env] text_template = {text_template!r} has no '{{observation}}' to fill in")
        self.text_template = text_template
        self._before = self._after = self._closing = ""
        if self.format == "chat":
            if not tokenizer.has_chat_template:
                raise ConfigError(f"[env] format = 'chat' but the model at {tokenizer.source} has no chat "
                                  "template; use format = 'text'")
            self._before, self._after, self._closing = _wrapping(tokenizer.tokenizer, observation_role)
        self._eos_text = tokenizer.decode([tokenizer.eos_token_id], skip_special_tokens=False)

    def encode(self, observation: str, *, after_eos: bool) -> list[int]:
        """The tokens that follow a turn: ``observation`` wrapped as the format says;
        ``after_eos``: the turn ended with the end-of-turn token (the chat format
        then does not write it again)."""
        if self.format == "text":
            return self._encode(self.text_template.format(observation=observation))
        closing = self._closing
        if after_eos and closing.startswith(self._eos_text):
            closing = closing[len(self._eos_text):]
        return self._encode(closing + self._before + observation + self._after)

    def encode_first(self, observation: str) -> list[int]:
        """The tokens of ``reset``'s observation, after the prompt (the prompt already
        opened the assistant's turn, so a chat observation's wrapping is the same as
        after a turn, without the closing of one)."""
        if not observation:
            return []
        if self.format == "text":
            return self._encode(self.text_template.format(observation=observation))
        return self._encode(self._before + observation + self._after)

    def _encode(self, text: str) -> list[int]:
        if not text:
            return []
        t = self.tokenizer.tokenizer
        if self.tokenizer.is_char_tokenizer:
            return list(t.encode(text, add_bos=False))
        return [int(i) for i in t(text, add_special_tokens=False)["input_ids"]]


def _wrapping(tokenizer: Any, role: str) -> tuple[str, str, str]:
    """``(before, after, closing)``: the text a chat template writes around an
    observation message's content, and after an assistant message's content."""
    from jinja2 import TemplateError

    def render(messages: list[dict[str, str]], generation_prompt: bool) -> str:
        return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt))

    base = [{"role": "user", "content": "question"}, {"role": "assistant", "content": _ASSISTANT}]
    try:
        before_turn = render(base, False)
        with_observation = render([*base, {"role": role, "content": _MARK}], True)
    except (TemplateError, ValueError, TypeError, KeyError) as e:
        raise ConfigError(f"the chat template cannot render a {role!r} message after an assistant's "
                          f"({type(e).__name__}: {e}); set [env] observation_role to a role it knows "
                          "(e.g. 'user') or use format = 'text'") from None
    if not with_observation.startswith(before_turn) or _MARK not in with_observation:
        raise ConfigError("the chat template renders a conversation differently once a message is added "
                          "(it is not a prefix of the longer one); use format = 'text'")
    closing = before_turn.split(_ASSISTANT, 1)[1]
    added = with_observation[len(before_turn):]
    before, after = added.split(_MARK, 1)
    return before, after, closing
