"""Errors gradseam raises on purpose; each message says what was wrong and how to fix it."""

from __future__ import annotations

PLUGIN_GUIDE = "the plugin guide (docs/plugins.md in the gradseam repository)"


class GradseamError(RuntimeError):
    """Base class of gradseam's own errors."""


class UnsupportedModelError(GradseamError, TypeError):
    """No installed family handles the model's class."""


class UnsupportedStrategyError(GradseamError, ValueError):
    """The family cannot run the requested strategy safely (e.g. no FFN boundary for ``-ffn``)."""


class PluginConflictError(GradseamError):
    """Two plugins claim the same family name or model class."""
