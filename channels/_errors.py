"""The project's exception hierarchy.

It lives in ``channels`` because that is the lowest layer: every other package may
import it, and ``asyncflow`` re-exports it.
"""

from __future__ import annotations


class AsyncflowError(Exception):
    """Base class of every error asyncflow raises on purpose."""


class ConfigError(AsyncflowError, ValueError):
    """A user-supplied configuration or argument is invalid (the message names it)."""


class SchemaError(AsyncflowError, ValueError):
    """Rows do not match the fields, dtypes or shapes they were declared with."""


class MissingFieldError(SchemaError, KeyError):
    """A method reads a field that its input does not carry."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class TransportError(AsyncflowError):
    """Moving rows between workers failed."""


class ChannelError(AsyncflowError):
    """Base class of channel errors."""


class ClosedResourceError(ChannelError):
    """This end of the channel was closed by its owner and can no longer be used."""


class BrokenResourceError(ChannelError):
    """The other side of the channel is gone: every receiver closed (or, for a remote
    channel, its process died), or the sending process died (:class:`SenderDiedError`)."""


class EndOfStream(ChannelError):
    """Every sender closed and every buffered item was received."""


class WouldBlock(ChannelError):
    """A ``*_nowait`` operation could not complete without waiting."""


class SenderDiedError(BrokenResourceError):
    """The process that owns a remote channel's buffer (its sending side) died; the
    message carries Ray's account of the death."""


USER_CODE_ERRORS: tuple[type[BaseException], ...] = (Exception, SystemExit, KeyboardInterrupt)
"""What user code (a role method, a reward function, an environment) may raise that
ends the call it runs in, not the process: ``sys.exit()`` or a ``KeyboardInterrupt``
raised in a worker's compute thread is the user's error, reported like any other."""
