"""GPU behaviour of the offload engine (run on a CUDA machine: ``pytest -m cuda``)."""

from __future__ import annotations

import gc
import os
import warnings

import pytest
import torch
from cases import FAMILIES as ALL

import gradseam
from gradseam.testing import Case, assert_same_step, config_id, run_step

pytestmark = pytest.mark.cuda

GPU_CONFIGS = [
    {"gradient_checkpointing": True, "gradient_checkpointing_backend": backend,
     "gradient_checkpointing_offload_attention": attention}
    for backend in ("unsloth", "unsloth-ffn")
    for attention in (False, True)
] + [
    {"gradient_checkpointing_offload_attention": True},
    {"gradient_checkpointing": True, "gradient_checkpointing_backend": "unsloth", "gradient_checkpointing_interval": 2,
     "gradient_checkpointing_segment_stride": 4},
]


def _on_cuda(case: Case) -> Case:
    def build():
        return case.build().cuda()

    def move(v):
        if isinstance(v, torch.Tensor):
            return v.detach().cuda().requires_grad_(v.requires_grad)
        if isinstance(v, (list, tuple)):  # Z-Image takes lists of per-sample tensors
            return type(v)(move(x) for x in v)
        return v

    def inputs(g):
        return {k: move(v) for k, v in case.inputs(g).items()}

    return Case(case.name, build, inputs, case.output, case.seed)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield


MATRIX = [(case, cfg) for case in ALL for cfg in GPU_CONFIGS]


@pytest.mark.parametrize(("case", "config"), MATRIX, ids=[f"{c.name}-{config_id(k)}" for c, k in MATRIX])
def test_gpu_parity_fp32(case, config):
    """Tiny fp32 models on the GPU: offload through pinned buffers and side streams changes nothing."""
    gpu = _on_cuda(case)
    torch.manual_seed(case.seed)
    model = gpu.build()
    reference = run_step(model, gpu)
    handle = gradseam.patch(model, config)
    handle.engine.min_bytes = 0  # tiny models: offload everything so the copies are exercised
    try:
        for _ in range(2):
            assert_same_step(reference, run_step(model, gpu), atol=1e-6, what=f"{case.name} {config}")
        assert handle.engine.copies > 0
    finally:
        handle.remove()


def _synthetic(blocks=4, tokens=2048, dim=1024, dtype=torch.bfloat16):
    """The benchmark stack; fp32 runs use the deterministic math attention so results compare exactly."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from gradseam.synthetic import SyntheticStack, ensure_registered

    ensure_registered()
    torch.manual_seed(0)
    model = SyntheticStack(blocks, dim).cuda().to(dtype).requires_grad_(False)
    x = torch.randn(1, tokens, dim, device="cuda", dtype=dtype)

    def step():
        inp = x.detach().requires_grad_(True)
        if dtype == torch.float32:
            with sdpa_kernel(SDPBackend.MATH):
                model(inp).float().square().mean().backward()
        else:
            model(inp).float().square().mean().backward()
        return inp.grad

    return model, step


def _peak(step) -> int:
    step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def test_offload_lowers_the_activation_peak():
    model, step = _synthetic()
    none = _peak(step)
    peaks = {}
    for name, cfg in {
        "torch": {"gradient_checkpointing": True},
        "unsloth": {"gradient_checkpointing": True, "gradient_checkpointing_backend": "unsloth"},
        "attention": {"gradient_checkpointing_offload_attention": True},
    }.items():
        with gradseam.patch(model, cfg):
            peaks[name] = _peak(step)
    assert peaks["torch"] < none and peaks["attention"] < none
    assert peaks["unsloth"] < peaks["torch"]


def test_pool_makes_no_new_pinned_allocations_after_warmup_and_host_memory_is_flat():
    psutil = pytest.importorskip("psutil")
    model, step = _synthetic()
    cfg = {"gradient_checkpointing": True, "gradient_checkpointing_backend": "unsloth-ffn",
           "gradient_checkpointing_offload_attention": True}
    with gradseam.patch(model, cfg) as handle:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
        pinned = handle.engine.pool.pinned_allocations
        rss = psutil.Process(os.getpid()).memory_info().rss
        for _ in range(50):
            step()
        torch.cuda.synchronize()
        gc.collect()
        assert handle.engine.pool.pinned_allocations == pinned
        assert handle.engine.pool.checked_out == 0
        growth = psutil.Process(os.getpid()).memory_info().rss - rss
        assert growth < 64 * 2**20, f"host memory grew by {growth / 2**20:.1f} MiB over 50 steps"


def test_zero_buckets_uses_really_pageable_memory():
    model, step = _synthetic(blocks=2, tokens=512, dtype=torch.float32)
    seen = []
    with gradseam.patch(model, {"gradient_checkpointing": True, "gradient_checkpointing_backend": "unsloth",
                                "gradient_checkpointing_offload_pin_memory_max_buckets": 0}) as handle:
        acquire = handle.engine.pool.acquire

        def spy(n, dtype):
            buf, key = acquire(n, dtype)
            seen.append(buf.is_pinned())
            return buf, key

        handle.engine.pool.acquire = spy
        got = step()
        assert seen and not any(seen)
        assert handle.engine.pool.pinned_allocations == 0
    expected = step()
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_pinning_failure_falls_back_to_pageable_with_one_warning():
    model, step = _synthetic(blocks=2, tokens=512, dtype=torch.float32)
    expected = step()
    with gradseam.patch(model, {"gradient_checkpointing": True, "gradient_checkpointing_backend": "unsloth"}) as h:
        def refuse(n):
            raise RuntimeError("CUDA error: out of memory (simulated pinned-memory cap)")

        h.engine.pool._allocate = refuse
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            got = step()
            step()
        assert sum("pinned host memory" in str(w.message) for w in record) == 1
        assert h.engine.pool.pageable_allocations > 0
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_in_place_modification_is_still_detected_on_gpu():
    from gradseam.offload import OffloadEngine

    engine = OffloadEngine(4, min_bytes=0)
    x = torch.randn(1024, device="cuda", requires_grad=True)
    with engine.group():
        h = x * 2
        y = h.sin().sum()
    with torch.no_grad():
        h.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_backward_right_after_forward_reuses_sources_and_stays_exact():
    """The last groups' copies may still be running when backward starts: their sources are used as is."""
    model, step = _synthetic(blocks=6, tokens=1024, dtype=torch.float32)
    expected = step()
    cfg = {"gradient_checkpointing": True, "gradient_checkpointing_backend": "unsloth-ffn",
           "gradient_checkpointing_offload_attention": True}
    with gradseam.patch(model, cfg) as handle:
        for _ in range(3):
            torch.testing.assert_close(step(), expected, rtol=0, atol=0)
        stats = handle.engine.stats()
    assert stats["copies"] > 0 and stats["loads"] <= stats["copies"]
    assert stats["checked_out"] == 0
