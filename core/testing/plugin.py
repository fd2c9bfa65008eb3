"""The kit as a pytest plugin: its ``compiled`` marker, and its compiled rows left out unless ``-m`` asks.

``gradseam.testing`` is a pytest plugin (these hooks are re-exported by the package, whose module is
what pytest registers). A :class:`~gradseam.testing.ConformanceSuite` registers it when pytest collects
the suite, so a plugin's test file needs no setup: the marker is declared (no
``PytestUnknownMarkWarning``, ``--strict-markers`` passes) and the compiled rows are deselected unless
``-m`` selects them. Listing it in a conftest.py (``pytest_plugins = ["gradseam.testing"]``) or
``-p gradseam.testing`` registers it earlier, the same way. The kit does not import pytest until
pytest calls it.
"""

from __future__ import annotations

import sys
from typing import Any

COMPILED_MARK = "compiled"
MARKERS = (
    f"{COMPILED_MARK}: the gradseam conformance kit's compiled-backend rows (5-90 s each on a CPU); left out "
    "unless -m selects them: -m compiled runs them alone, -m 'compiled or not compiled' everything",
)
PLUGIN_NAME = "gradseam.testing"
# set on ConformanceSuite (and so on every suite class): how the hooks tell the kit's tests from others without
# importing the suite, which registers this plugin (the arrow runs from the suite to here)
SUITE_ATTRIBUTE = "gradseam_conformance_suite"


def pytest_configure(config: Any) -> None:
    """Declare the kit's markers."""
    for line in MARKERS:
        config.addinivalue_line("markers", line)


def _kit_compiled_row(item: Any) -> bool:
    cls = getattr(item, "cls", None)
    return (isinstance(cls, type) and getattr(cls, SUITE_ATTRIBUTE, False) is True
            and item.get_closest_marker(COMPILED_MARK) is not None)


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    """Deselect the kit's compiled rows unless ``-m`` was given (on the command line or in ``addopts``):
    then the expression decides, as for any marker."""
    if config.getoption("markexpr", ""):
        return
    compiled = [item for item in items if _kit_compiled_row(item)]
    if compiled:
        config.hook.pytest_deselected(items=compiled)
        items[:] = [item for item in items if not _kit_compiled_row(item)]
        config.stash[_deselected()] = len(compiled)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: Any, config: Any) -> None:
    """Say how many compiled rows were left out, and how to run them."""
    left_out = config.stash.get(_deselected(), 0)
    if left_out:
        terminalreporter.write_line(
            f"gradseam.testing: {left_out} compiled-backend row(s) deselected; run them with -m compiled "
            "(or -m 'compiled or not compiled' for everything)"
        )


_KEYS: list[Any] = []


def _deselected() -> Any:
    """The stash key for the count of deselected rows (made on first use: the kit does not import pytest)."""
    if not _KEYS:
        import pytest

        _KEYS.append(pytest.StashKey[int]())
    return _KEYS[0]


def use_as_pytest_plugin(config: Any) -> None:
    """Register the kit (the ``gradseam.testing`` package, which holds these hooks) with pytest, once, if
    nothing registered it yet (pytest then calls its ``pytest_configure`` at once)."""
    manager = config.pluginmanager
    kit = sys.modules[PLUGIN_NAME]
    if not manager.is_registered(kit) and manager.get_plugin(PLUGIN_NAME) is None:
        manager.register(kit, PLUGIN_NAME)
