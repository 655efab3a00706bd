"""The training engine's error type (an asyncflow ConfigError) and its enum-field check."""

from __future__ import annotations

import enum
from typing import TypeVar

from channels import ConfigError

E = TypeVar("E", bound=enum.Enum)


class EngineConfigError(ConfigError):
    """A training-engine setting or input is invalid; the message names the field and the fix.

    A :class:`channels.ConfigError` (hence an ``AsyncflowError`` and a ``ValueError``),
    so user mistakes surface like every other asyncflow configuration error.
    """


def enum_field(field: str, kind: type[E], value: object) -> E:
    """``value`` as a member of ``kind`` (members and their values are accepted).

    Args:
        field: the setting's name for the message (``"TrainingConfig.loss_aggregation"``).
        kind: the enum.
        value: what the user passed.

    Returns:
        The member.

    Raises:
        EngineConfigError: naming the field and the allowed values.
    """
    try:
        return kind(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in kind)
        raise EngineConfigError(f"{field} must be one of {allowed}, got {value!r}") from None
