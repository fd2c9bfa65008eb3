"""Errors gradseam raises on purpose; each message says what was wrong and how to fix it."""

from __future__ import annotations

import warnings

PLUGIN_GUIDE = "the plugin guide (docs/plugins.md in the gradseam repository)"


class GradseamError(RuntimeError):
    """Base class of gradseam's own errors."""


class UnsupportedModelError(GradseamError, TypeError):
    """No installed family handles the model's class."""


class UnsupportedStrategyError(GradseamError, ValueError):
    """The family cannot run the requested strategy safely (e.g. no FFN boundary for ``-ffn``)."""


class PluginError(GradseamError):
    """A plugin could not be loaded or registered; nothing of it was registered.

    ``plugin`` and ``distribution`` (None for a plugin registered at runtime) say which, so a tool
    can report failures without parsing the message.
    """

    def __init__(self, message: str, *, plugin: str | None = None, distribution: str | None = None) -> None:
        super().__init__(message)
        self.plugin = plugin
        self.distribution = distribution


class PluginTypeError(PluginError, TypeError):
    """A plugin declared something of the wrong type (``register()`` given a non-Family, a string where
    a tuple belongs); a ``TypeError`` too, so code catching the plain error keeps working."""


class PluginValueError(PluginError, ValueError):
    """A plugin declared a value gradseam cannot use (an empty name, a negative carry position)."""


class PluginConflictError(PluginError):
    """Two plugins claim the same plugin name, family name or model class."""


class PluginWarning(RuntimeWarning):
    """A third-party plugin was skipped, or ``GRADSEAM_PLUGINS`` selects nothing.

    Turn it into an error with ``-W error::gradseam.errors.PluginWarning``.
    """


class GradseamWarning(UserWarning):
    """A setting was accepted but cannot take effect as written; the message says what runs instead."""


warned: set[str] = set()  # messages already given in this process (tests clear it)


def warn_once(message: str) -> None:
    """Warn once per message and process: the same cause on every step would drown a training log."""
    if message not in warned:
        warned.add(message)
        warnings.warn(message, GradseamWarning, stacklevel=3)
