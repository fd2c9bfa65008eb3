from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

# The CPU tests run tiny models: one thread avoids oversubscribing CI's two cores (10-40x faster).
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run with -m cuda on a GPU machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_warnings():
    # gradseam warns once per message per process; tests that check warnings need a clean slate.
    from gradseam import planning

    planning.warned.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        yield


@pytest.fixture
def checkpoint_calls(monkeypatch):
    """Counts the checkpoint regions gradseam opens (each call of torch.utils.checkpoint by gradseam)."""
    from gradseam.run import chains as strategies

    calls: list[int] = []
    real = strategies.checkpoint

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(strategies, "checkpoint", counting)
    return calls


def builtin_plugins() -> list[str]:
    """The built-in plugins' entry-point names, as pyproject.toml declares them (sorted)."""
    from pathlib import Path

    import tomllib

    data = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    return sorted(data["project"]["entry-points"]["gradseam"])
