"""GPU behaviour of the offload engine (run on a CUDA machine: ``pytest -m cuda``)."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import warnings

import pytest
import torch
from cases import FAMILIES as ALL
from cases import FLUX, WAN
from torch import nn

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
    # whole blocks whose attention kernels are kept: in pinned host memory, and on the GPU
    {"gradient_checkpointing": True, "gradient_checkpointing_offload_attention": True},
    {"gradient_checkpointing": True, "gradient_checkpointing_backend": "unsloth", "gradient_checkpointing_interval": 2,
     "gradient_checkpointing_offload_attention": True},
    {"gradient_checkpointing": True, "gradient_checkpointing_keep_attention": True},
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
    # cuDNN's fastest convolution backward sums with atomics: two unpatched runs of Wan Animate's
    # face encoder differed by 9.5e-7 in one gradient, enough to fail a 1e-6 comparison at random.
    saved = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    yield
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved


MATRIX = [(case, cfg) for case in ALL for cfg in GPU_CONFIGS]


def _new_families() -> list[Case]:
    from test_family_cosmos import COSMOS
    from test_family_ernie_image import ERNIE
    from test_family_flux3 import FLUX3_EDIT
    from test_family_hidream import HIDREAM
    from test_family_hunyuanimage import HUNYUANIMAGE
    from test_family_hunyuanvideo import HUNYUANVIDEO
    from test_family_hunyuanvideo_framepack import FRAMEPACK
    from test_family_ideogram4 import IDEOGRAM4
    from test_family_image2 import FLUX2, QWEN
    from test_family_kandinsky5 import KANDINSKY5
    from test_family_longcat_image import LONGCAT
    from test_family_lumina2 import LUMINA2
    from test_family_minimax_h3 import MINIMAX_H3
    from test_family_omnigen import OMNIGEN
    from test_family_qwenimage21 import QWEN21
    from test_family_sd3_sana import SANA, SANA_VIDEO, SD3
    from test_family_skyreels_v2 import SKYREELS_V2_DF
    from test_family_video2 import HV15, LTXV, VACE
    from test_family_wan_animate import WAN_ANIMATE

    return [FLUX2, QWEN, QWEN21, SD3, SANA, SANA_VIDEO, HV15, LTXV, VACE, COSMOS, ERNIE, FLUX3_EDIT, HIDREAM,
            HUNYUANIMAGE, HUNYUANVIDEO, FRAMEPACK, IDEOGRAM4, KANDINSKY5, LONGCAT, LUMINA2, MINIMAX_H3, OMNIGEN,
            SKYREELS_V2_DF, WAN_ANIMATE]


# The families added later: every offload mechanism once (region inputs with kept kernels, FFN inputs
# with attention seams, attention seams alone, kept kernels with whole blocks)
NEW_GPU_CONFIGS = [GPU_CONFIGS[i] for i in (1, 3, 4, 6)]
MATRIX += [(case, cfg) for case in _new_families() for cfg in NEW_GPU_CONFIGS]


# The compiled backends (inductor on the GPU) on every representative family: within the compiled
# tolerance of the eager model in fp32 (docs/reliability.md), and offloading what they keep changes nothing.
COMPILED = [{"gradient_checkpointing": True, "gradient_checkpointing_backend": b} for b in ("compile", "unsloth-compile")]


def _compiled_steps(case: Case, configs: list[dict | None]) -> tuple[list[list], list[int]]:
    """Two steps of each config (None: unpatched) on a fresh, freshly compiled model, and the bytes each one's engine
    moved to host memory (0 without an engine; every saved tensor offloaded, however small)."""
    steps, moved = [], []
    for config in configs:
        torch._dynamo.reset()
        torch.manual_seed(case.seed)
        model = case.build()
        handle = gradseam.patch(model, config) if config else None
        engine = handle.engine if handle is not None else None
        if engine is not None:
            engine.min_bytes = 0
        try:
            steps.append([run_step(model, case, count_bytes=False) for _ in range(2)])
            moved.append(engine.stats()["offloaded_bytes"] if engine is not None else 0)
            if engine is not None:
                assert engine.copies > 0
        finally:
            if handle is not None:
                handle.remove()
    return steps, moved


@pytest.mark.parametrize("case", [FLUX, WAN], ids=lambda c: c.name)
def test_gpu_compiled_backends_fp32(case):
    (reference, kept, moved), _ = _compiled_steps(_on_cuda(case), [None, *COMPILED])
    # Each configuration ran the same step twice: what those two runs differ by is this GPU's own
    # run-to-run spread (efficient attention's backward sums with atomics). Offloading changes no bit, so
    # unsloth-compile matches compile exactly where the kernels are deterministic, and within four times
    # that spread where they are not (a plain bitwise check failed once for Wan in the suite under -n 8,
    # then passed three times alone).
    spread = 4 * max(_spread(*runs) for runs in (reference, kept, moved))
    for a, b, c in zip(reference, kept, moved):
        assert_same_step(a, b, atol=max(1e-5, spread), what=f"{case.name} compile vs eager")
        assert_same_step(b, c, atol=spread, what=f"{case.name} unsloth-compile vs compile")


def test_gpu_budget_0_offloads_only_each_blocks_inputs_and_trains_like_eager():
    """Memory budget 0 under inductor (Wan 2.1 14B's 12 GiB row runs five blocks so, docs/benchmarks.md): the
    partitioner keeps a compiled block's inputs only, so ``unsloth-compile`` moves less to host memory than at the
    default budget, and the step is the eager one within the compiled tolerance and this GPU's own spread."""
    budgets = [{**COMPILED[1], "gradient_checkpointing_memory_budget": b} for b in (0.1, 0.0)]
    (eager_steps, default_steps, zero_steps), (_, default_moved, zero_moved) = _compiled_steps(_on_cuda(WAN),
                                                                                             [None, *budgets])
    assert 0 < zero_moved < default_moved, (zero_moved, default_moved)
    spread = 4 * max(_spread(*runs) for runs in (eager_steps, default_steps, zero_steps))
    for eager, compiled in zip(eager_steps, zero_steps):
        assert_same_step(eager, compiled, atol=max(1e-5, spread), what="wan unsloth-compile at budget 0 vs eager")


# Blocks a user compiles after patching (diffusers' compile_repeated_blocks): the offload backends' regions run inside
# the compiled frame, and the engine's copies (issued when a region's group closes) must stay out of the graph.
USER_COMPILED = [GPU_CONFIGS[i] for i in (1, 2)]  # unsloth + attention offload, unsloth-ffn


@pytest.mark.parametrize("config", USER_COMPILED, ids=config_id)
def test_gpu_blocks_compiled_after_patching_offload_eagerly_and_train_like_compiled_unpatched(config):
    """Inductor refused the engine's record_stream when dynamo traced a region's group closing into the block's graph
    (``gradseam advise``'s ``compiled: unsloth + attention offload`` rung on Flux dev, an H200): the copies now run
    outside it, and the step matches the same blocks compiled without gradseam within the GPU's spread."""
    gpu = _on_cuda(WAN)
    steps = []
    for patched in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(WAN.seed)
        model = gpu.build()
        handle = gradseam.patch(model, config) if patched else None
        if handle is not None:
            handle.engine.min_bytes = 0  # the tiny model's tensors are under the engine's size floor
        model.compile_repeated_blocks()
        try:
            steps.append([run_step(model, gpu, count_bytes=False) for _ in range(2)])
            if handle is not None:
                assert handle.engine is not None and handle.engine.copies > 0
        finally:
            if handle is not None:
                handle.remove()
    (want, again), (got, _) = steps
    assert_same_step(want, got, atol=max(1e-5, 4 * _spread(want, again)), what="compiled blocks, patched vs not")
    torch._dynamo.reset()


@pytest.mark.parametrize(("case", "config"), MATRIX, ids=[f"{c.name}-{config_id(k)}" for c, k in MATRIX])
def test_gpu_parity_fp32(case, config):
    """Tiny fp32 models on the GPU: offload through pinned buffers and side streams changes nothing.

    Within 1e-6, or within four times the spread of two unpatched runs where that is larger: some GPU
    backward kernels sum with atomics (efficient attention; cuDNN's, which the fixture makes
    deterministic), and on the H200 two unpatched runs of Wan Animate differed by 9.5e-7 in one
    gradient, failing a plain 1e-6 comparison at random (docs/reliability.md).
    """
    from gradseam.testing import count_kernels

    gpu = _on_cuda(case)
    torch.manual_seed(case.seed)
    model = gpu.build()
    with count_kernels() as unpatched:
        reference = run_step(model, gpu)
    atol = max(1e-6, 4 * _spread(reference, run_step(model, gpu)))
    handle = gradseam.patch(model, config)
    if handle.engine is not None:
        handle.engine.min_bytes = 0  # tiny models: offload everything so the copies are exercised
    try:
        for _ in range(2):
            with count_kernels() as patched:
                assert_same_step(reference, run_step(model, gpu), atol=atol, what=f"{case.name} {config}")
            if handle.plan.strategy.kept.value and not any(r.fallbacks for r in handle.regions()):
                assert unpatched[0] > 0 and patched[0] == unpatched[0], (unpatched, patched)  # never recomputed
        assert handle.engine is None or handle.engine.copies > 0
    finally:
        handle.remove()


def _spread(a, b) -> float:
    """The largest difference between two runs of the same step (outputs and every gradient)."""
    pairs = [*zip(a.outputs, b.outputs), *((v, b.input_grads[k]) for k, v in a.input_grads.items()),
             *((v, b.param_grads[k]) for k, v in a.param_grads.items())]
    return max(((x - y).abs().max().item() for x, y in pairs), default=0.0)


def _synthetic(blocks=4, tokens=2048, dim=1024, dtype=torch.bfloat16):
    """The benchmark stack; fp32 runs use the deterministic math attention so results compare exactly."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from gradseam.tools.synthetic import SyntheticStack, ensure_registered

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
        pinned = handle.engine.store.pinned_allocations
        rss = psutil.Process(os.getpid()).memory_info().rss
        for _ in range(50):
            step()
        torch.cuda.synchronize()
        gc.collect()
        assert handle.engine.store.pinned_allocations == pinned
        assert handle.engine.store.checked_out == 0
        growth = psutil.Process(os.getpid()).memory_info().rss - rss
        assert growth < 64 * 2**20, f"host memory grew by {growth / 2**20:.1f} MiB over 50 steps"


def test_zero_buckets_uses_really_pageable_memory():
    model, step = _synthetic(blocks=2, tokens=512, dtype=torch.float32)
    seen = []
    with gradseam.patch(model, {"gradient_checkpointing": True, "gradient_checkpointing_backend": "unsloth",
                                "gradient_checkpointing_offload_pin_memory_max_buckets": 0}) as handle:
        acquire = handle.engine.store.acquire

        def spy(n, dtype):
            buf, key = acquire(n, dtype)
            seen.append(buf.is_pinned())
            return buf, key

        handle.engine.store.acquire = spy
        got = step()
        assert seen and not any(seen)
        assert handle.engine.store.pinned_allocations == 0
    expected = step()
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_pinning_failure_falls_back_to_pageable_with_one_warning():
    model, step = _synthetic(blocks=2, tokens=512, dtype=torch.float32)
    expected = step()
    with gradseam.patch(model, {"gradient_checkpointing": True, "gradient_checkpointing_backend": "unsloth"}) as h:
        def refuse(n):
            raise RuntimeError("CUDA error: out of memory (simulated pinned-memory cap)")

        h.engine.store._allocate = refuse
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            got = step()
            step()
        assert sum("pinned host memory" in str(w.message) for w in record) == 1
        assert h.engine.store.pageable_allocations > 0
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_in_place_modification_is_still_detected_on_gpu():
    from gradseam.offload import OffloadEngine, host_store

    engine = OffloadEngine(host_store(4), min_bytes=0)
    x = torch.randn(1024, device="cuda", requires_grad=True)
    with engine.group():
        h = x * 2
        y = h.sin().sum()
    with torch.no_grad():
        h.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_a_groups_copies_wait_once_and_share_one_event_on_gpu(monkeypatch):
    """Twelve saved tensors in one group: one stream wait and one event for the batch (each cost CPU time per
    tensor before), every byte back exact after the sources are let go."""
    from gradseam.offload import OffloadEngine, host_store

    engine = OffloadEngine(host_store(4), min_bytes=0)
    waits = []
    real_wait = torch.cuda.Stream.wait_stream
    monkeypatch.setattr(torch.cuda.Stream, "wait_stream", lambda self, other: (waits.append(1), real_wait(self, other))[1])
    xs = [torch.randn(1 << 16, device="cuda", requires_grad=True) for _ in range(12)]
    with engine.group() as group:
        y = sum((x * (i + 1)).sin().sum() for i, x in enumerate(xs))
    stored = [ref() for ref in group.stored]
    assert len(stored) == 12 and len(waits) == 1 and len({id(s.copied) for s in stored}) == 1
    with engine.group():  # a newer group: the first one's sources go, backward reloads them from host memory
        (xs[0] * 5).exp().sum()
    assert all(s.src is None for s in stored)
    y.backward()
    for i, x in enumerate(xs):
        torch.testing.assert_close(x.grad, (i + 1) * (x * (i + 1)).cos(), rtol=0, atol=0)
    assert engine.stats()["loads"] == 12


def test_the_cpu_runs_at_most_two_offload_groups_ahead_of_the_gpu():
    """Groups whose GPU work is long (~0.1 s each): when the loop of eight ends, the GPU has finished the work
    queued up to the close of the group GROUPS_AHEAD before the last (the CPU waited for it) and not the last group's."""
    from gradseam.offload import OffloadEngine, host_store
    from gradseam.offload.engine import GROUPS_AHEAD

    engine = OffloadEngine(host_store(4), min_bytes=0)
    x = torch.randn(1 << 16, device="cuda")
    held, marks = [], []
    torch.cuda.synchronize()
    for _ in range(8):
        mark = torch.cuda.Event()
        mark.record()  # before this group's GPU work
        marks.append(mark)
        with engine.group(hooks=False) as group:
            torch.cuda._sleep(200_000_000)
            held.append(engine.pack(group, x * 2, set()))
    assert GROUPS_AHEAD == 2 and marks[-GROUPS_AHEAD - 1].query() and not marks[-1].query()
    torch.cuda.synchronize()
    assert all(torch.equal(engine.unpack(p), x * 2) for p in held)


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


# -- out of memory while reloading (a real CUDA OOM) -----------------------------------------------


class _Nothing(nn.Module):
    """Replaces the FFN side: ``x * 0`` saves nothing, so each block keeps only attention tensors."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 0


def _attention_only(tokens: int):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model, _ = _synthetic(blocks=4, tokens=tokens, dim=1024, dtype=torch.float32)
    for block in model.blocks:
        block.ffn = _Nothing()

    def step(x: torch.Tensor, squeeze=None) -> torch.Tensor:
        inp = x.detach().requires_grad_(True)
        with sdpa_kernel(SDPBackend.MATH):
            out = model(inp)
            if squeeze is not None:
                out.register_hook(squeeze)
            out.square().mean().backward()
        return inp.grad

    return model, step


def test_oom_while_reloading_is_the_normal_error_with_a_hint_and_a_smaller_step_works():
    """Attention-only blocks with attention offload: when backward starts, the last block's
    tensors are still on the GPU, so the first large allocation backward makes is the reload of
    the block before it. Capping the process's GPU memory right then makes exactly that reload
    fail with a real CUDA OOM."""
    model, step = _attention_only(4096)
    big = torch.randn(1, 4096, 1024, device="cuda")
    small = torch.randn(1, 1024, 1024, device="cuda")
    expected_small = step(small)
    unit = big.numel() * big.element_size()  # one activation of the big step (16 MiB)
    total = torch.cuda.get_device_properties(0).total_memory

    def squeeze(grad: torch.Tensor) -> None:
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + 3 * unit) / total)

    cfg = {"gradient_checkpointing_offload_attention": True}
    with gradseam.patch(model, cfg) as handle:
        try:
            with pytest.raises(torch.OutOfMemoryError) as caught:
                step(big, squeeze)
            message = str(caught.value)
            del caught  # its traceback holds the failed step's graph
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0)
        gc.collect()
        assert "CUDA out of memory" in message  # PyTorch's own message comes first...
        assert "[gradseam] out of GPU memory while reloading offloaded activations" in message  # ...then the hint
        assert "smaller batch or resolution" in message and "'unsloth'" in message
        assert handle.engine.store.checked_out == 0  # nothing leaked from the failed step
        got = step(small)  # the next, smaller step works and is exact
        assert handle.engine.copies > 0
    torch.testing.assert_close(got, expected_small, rtol=0, atol=0)


def test_reload_oom_surfaces_even_when_injected_at_the_copy():
    """The same path without depending on the allocator's layout: the reload's allocation raises."""
    import gradseam.offload.engine as offload

    model, step = _attention_only(2048)
    x = torch.randn(1, 2048, 1024, device="cuda")
    expected = step(x)

    class FailingReload:
        def __getattr__(self, name):
            return getattr(torch, name)

        def empty(self, *args, **kwargs):
            if args and args[0] > 0 and str(kwargs.get("device", "")).startswith("cuda"):
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 MiB (injected)")
            return torch.empty(*args, **kwargs)

    with gradseam.patch(model, {"gradient_checkpointing_offload_attention": True}) as handle:
        offload.torch = FailingReload()
        try:
            with pytest.raises(torch.OutOfMemoryError, match=r"(?s)injected.*\[gradseam\] out of GPU memory"):
                step(x)
        finally:
            offload.torch = torch
        gc.collect()
        assert handle.engine.store.checked_out == 0
        torch.testing.assert_close(step(x), expected, rtol=0, atol=0)


# -- dropout and RNG in recomputed regions ------------------------------------------------------

DROPOUT_GPU = ["torch", "torch-ffn", "unsloth", "unsloth-ffn", "unsloth-interval2-stride4",
               "torch-ffn+attention-offload"]


def _dropout_matches_eager(case: Case, config: dict, *, atol: float, what: str) -> None:
    """Two seeded steps of ``case`` with dropout under ``config`` against the unpatched model: the same
    masks (outputs and gradients to ``atol``), and the CUDA RNG where the unpatched step leaves it."""
    from test_numerics import seeded_step, with_dropout

    gpu = _on_cuda(case)
    reference = seeded_step(with_dropout(case).cuda(), gpu, 123)
    after_reference = torch.cuda.get_rng_state()
    other = seeded_step(with_dropout(case).cuda(), gpu, 124)
    assert not torch.equal(reference.outputs[0], other.outputs[0])  # the dropout is real
    torch._dynamo.reset()
    model = with_dropout(case).cuda()
    handle = gradseam.patch(model, config)
    if handle.engine is not None:
        handle.engine.min_bytes = 0  # tiny models: offload everything
    try:
        got = seeded_step(model, gpu, 123)
        after = torch.cuda.get_rng_state()
        again = seeded_step(model, gpu, 123)
    finally:
        handle.remove()
    assert torch.equal(after, after_reference)
    assert_same_step(reference, got, atol=atol, what=f"{case.name} {what} with dropout")
    assert_same_step(reference, again, atol=atol, what=f"{case.name} {what} with dropout, second step")


@pytest.mark.parametrize("name", DROPOUT_GPU)
@pytest.mark.parametrize("case", [FLUX, WAN], ids=["flux", "wan"])
def test_dropout_in_recomputed_regions_on_gpu(case, name):
    """CUDA's Philox generator: the recompute replays the forward's masks, and afterwards the
    CUDA RNG is where the unpatched step leaves it."""
    from test_numerics import CONFIGS

    _dropout_matches_eager(case, CONFIGS[name], atol=1e-6, what=name)


@pytest.mark.parametrize("budget", [0.1, 0.05])
@pytest.mark.parametrize("backend", ["compile", "unsloth-compile"])
@pytest.mark.parametrize("case", [FLUX, WAN], ids=["flux", "wan"])
def test_dropout_in_compiled_blocks_on_gpu(case, backend, budget):
    """Inductor under a budget below 1: dropout is saved, never recomputed with fresh draws, and draws from
    torch's generator as eager does, so the step matches eager to the compiled tolerance and the CUDA RNG
    is where the unpatched step leaves it (gradseam.run.compiler). Measured on the H200: passes."""
    config = {"gradient_checkpointing": True, "gradient_checkpointing_backend": backend,
              "gradient_checkpointing_memory_budget": budget}
    _dropout_matches_eager(case, config, atol=1e-5, what=f"{backend} {budget}")


# -- 200 steps of changing shapes (multi-aspect buckets) -----------------------------------------

ASPECTS = [(1, 1024), (1, 1536), (2, 1024), (1, 2048), (1, 2560), (2, 1536), (1, 3072), (1, 4096)]


def _host_rss(psutil) -> int:
    """Resident host memory once freed memory is given back: glibc keeps freed pageable buffers in its
    arenas (a 4-bucket pool falls back to ~2,000 pageable copies here), which reads as growth that no
    leak caused; malloc_trim hands them back first, so what is left is held by someone."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: the second-half check still tells a leak
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    return psutil.Process(os.getpid()).memory_info().rss


@pytest.mark.parametrize("buckets", [12, 4])
def test_200_steps_of_changing_shapes_leak_nothing(buckets):
    psutil = pytest.importorskip("psutil")
    model, _ = _synthetic(blocks=4, dim=1024)
    inputs = [torch.randn(b, t, 1024, device="cuda", dtype=torch.bfloat16) for b, t in ASPECTS]

    def step(i: int) -> None:
        inp = inputs[i % len(inputs)].detach().requires_grad_(True)
        model(inp).float().square().mean().backward()

    cfg = {"gradient_checkpointing": True, "gradient_checkpointing_backend": "unsloth-ffn",
           "gradient_checkpointing_offload_attention": True,
           "gradient_checkpointing_offload_pin_memory_max_buckets": buckets}
    with gradseam.patch(model, cfg) as handle:
        pool = handle.engine.store
        for i in range(2 * len(ASPECTS)):  # warm-up: every shape twice
            step(i)
        torch.cuda.synchronize()
        allocated, pinned_bytes = torch.cuda.memory_allocated(), pool.pinned_bytes
        rss = [_host_rss(psutil)]
        peaks = []
        for _ in range(2):
            torch.cuda.reset_peak_memory_stats()
            for i in range(100):
                step(i)
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated())
            rss.append(_host_rss(psutil))
        drift = torch.cuda.memory_allocated() - allocated
        growth, late = rss[2] - rss[0], rss[2] - rss[1]
        print(f"\n[200 steps, {len(ASPECTS)} shapes, {buckets} buckets] GPU allocated drift {drift} B, "
              f"peak {peaks[0] / 2**20:.1f} -> {peaks[1] / 2**20:.1f} MiB, host RSS growth {growth / 2**20:.1f} MiB "
              f"({late / 2**20:.1f} in the second 100), "
              f"pool {pool.buckets} buckets, {pool.pinned_allocations} pinned buffers "
              f"({pool.pinned_bytes / 2**20:.0f} MiB), {pool.pageable_allocations} pageable allocations")
        assert drift <= 0  # the memory held between steps did not grow
        assert peaks[1] == peaks[0]
        assert pool.buckets <= buckets
        assert pool.pinned_bytes == pinned_bytes  # nothing pinned after the warm-up
        assert pool.checked_out == 0
        # a leaked pageable buffer is megabytes a step: hundreds of MiB per 100 steps, in both halves
        assert late < 32 * 2**20, f"host memory grew by {late / 2**20:.1f} MiB over steps 100-200"
        assert growth < 64 * 2**20, f"host memory grew by {growth / 2**20:.1f} MiB over 200 steps"
