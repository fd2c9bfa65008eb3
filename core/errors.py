"""Errors gradseam raises on purpose; each message says what was wrong and how to fix it."""

from __future__ import annotations

import errno
import os
import sys
import warnings
from typing import Any

PLUGIN_GUIDE = "the plugin guide (docs/plugins.md in the gradseam repository)"


class GradseamError(RuntimeError):
    """Base class of gradseam's own errors."""


class UnsupportedModelError(GradseamError, TypeError):
    """No installed family handles the model's class."""


class UnsupportedStrategyError(GradseamError, ValueError):
    """The family cannot run the requested strategy safely (e.g. no FFN boundary for ``-ffn``)."""


class ConfigFileNotFoundError(FileNotFoundError):
    """A config given as a path (``gradseam.patch(model, "gradseam.json")``) names no file.

    A ``FileNotFoundError`` (``errno``, ``strerror`` and ``filename`` as ``open()`` sets them), so code
    catching the plain error or ``OSError`` keeps working; its message says which path was read
    (and from which directory) and what was expected there.
    """

    def __init__(self, path: str, message: str) -> None:
        super().__init__(errno.ENOENT, os.strerror(errno.ENOENT), path)
        self.message = message

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        return type(self), (self.filename, self.message)


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


warned: set[Any] = set()  # messages (or their keys) already given in this process (tests clear it)

# Packages whose frames sit between a user's line and gradseam: a warning raised in a forward
# reaches gradseam through torch's ``Module.__call__`` and diffusers' ``forward``, and a load
# through diffusers' loaders. Pointing at any of them is as little use as pointing at gradseam.
_PASSED_THROUGH = ("torch", "diffusers", "accelerate", "peft", "pluggy")


def _own_dirs() -> tuple[str, ...]:
    """The directories whose frames are not the user's: gradseam's (core/ and its subpackages,
    adapters/) and those of the libraries in :data:`_PASSED_THROUGH` that are imported (a library
    that is not imported has no frame on the stack)."""
    here = os.path.dirname(os.path.abspath(__file__))
    dirs = [here]
    for name in ("gradseam.adapters", *_PASSED_THROUGH):
        module = sys.modules.get(name)
        file = getattr(module, "__file__", None)
        if file:
            dirs.append(os.path.dirname(os.path.abspath(file)))
    return tuple(d + os.sep for d in dirs)


def _importlib_internal(filename: str) -> bool:
    # the rule warnings.warn applies: it steps over importlib's frames when it counts stacklevel
    return "importlib" in filename and "_bootstrap" in filename


def warn_outside(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` attributed to the first frame outside gradseam: the user's line.

    A fixed ``stacklevel`` is right for one call path only, and gradseam warns from several depths
    (``patch`` directly, the loaders' wrappers, a forward hook inside torch's module call), so a
    fixed level named a gradseam file (``patcher.py:429``) more often than the user's. Walking the
    stack also skips the libraries a call passes through (:data:`_PASSED_THROUGH`) and importlib's
    frames, and counts levels as ``warnings.warn`` does. With no such frame (everything on the
    stack is a library's) the outermost frame is named.
    """
    own = _own_dirs()
    frame, level = sys._getframe(0), 1  # this function's frame: gradseam's by definition
    while True:
        outer = frame.f_back
        while outer is not None and _importlib_internal(outer.f_code.co_filename):
            outer = outer.f_back
        if outer is None:
            break
        frame, level = outer, level + 1
        if not os.path.abspath(frame.f_code.co_filename).startswith(own):
            break
    warnings.warn(message, category, stacklevel=level)


def warn_plugin(message: str) -> None:
    """A :class:`PluginWarning` at the user's line (see :func:`warn_outside`)."""
    warn_outside(message, PluginWarning)


def warn_once(message: str, key: Any = None) -> None:
    """Warn once per message and process, at the user's line (see :func:`warn_outside`).

    Once: the same cause on every step would drown a training log. ``key`` stands for the message where its text
    varies with what stays the same cause (an out-of-memory error names the memory free at each attempt).
    """
    seen = message if key is None else key
    if seen not in warned:
        warned.add(seen)
        warn_outside(message, GradseamWarning)
