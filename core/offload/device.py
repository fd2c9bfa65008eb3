"""Where an offload engine may run: on CUDA models, or on the CPU standing in for a GPU in tests.

Offloading a CPU model's activations to CPU memory is pointless, so gradseam refuses the offload
options on the CPU. The conformance kit and the test suite need the engine's exact logic without a
GPU, though: :func:`cpu_test_mode` lets the CPU stand in (host copies are made as for a GPU;
streams and events become no-ops). Kept apart from the engine so the engine holds no test switch.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from .engine import OffloadEngine
from .stores import STORES

_cpu_test_mode: list[int] = []  # a stack of min_bytes values while active


@contextmanager
def cpu_test_mode(min_bytes: int = 0) -> Iterator[None]:
    """Let offload strategies run on a CPU model, copying into host buffers as a GPU run would.

    For tests only: on a real CPU model offloading is pointless, so outside this block gradseam
    refuses the offload options there.
    """
    _cpu_test_mode.append(min_bytes)
    try:
        yield
    finally:
        _cpu_test_mode.pop()


def engine_for(destination: str, max_buckets: int) -> OffloadEngine:
    """An engine copying into the store of ``destination`` ("host"), sized by ``max_buckets``."""
    store = STORES[destination](max_buckets, test_mode=bool(_cpu_test_mode))
    if _cpu_test_mode:
        return OffloadEngine(store, min_bytes=_cpu_test_mode[-1], device_test_mode=True)
    return OffloadEngine(store)


def cpu_allowed() -> bool:
    return bool(_cpu_test_mode)
