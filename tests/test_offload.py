"""The offload engine's logic on the CPU stand-in path (pool, caps, views, dedup, version checks)."""

from __future__ import annotations

import contextlib
import gc
import warnings

import pytest
import torch
from cases import FAMILIES as ALL
from cases import WAN

import gradseam
from gradseam.errors import GradseamWarning, UnsupportedStrategyError
from gradseam.offload import OffloadEngine, cpu_test_mode, host_store
from gradseam.offload.pinned import PinnedPool, register_pinned, size_class
from gradseam.testing import check_strategy, config_id, run_step

OFFLOAD_CONFIGS = [
    {"gradient_checkpointing": True, "gradient_checkpointing_backend": "unsloth"},
    {"gradient_checkpointing": True, "gradient_checkpointing_backend": "unsloth-ffn"},
    {"gradient_checkpointing": True, "gradient_checkpointing_backend": "unsloth", "gradient_checkpointing_interval": 2,
     "gradient_checkpointing_segment_stride": 4},
    {"gradient_checkpointing_offload_attention": True},
    {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch", "gradient_checkpointing_segment_stride": 3,
     "gradient_checkpointing_offload_attention": True},
    {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch-ffn",
     "gradient_checkpointing_offload_attention": True},
    {"gradient_checkpointing": True, "gradient_checkpointing_backend": "unsloth-ffn",
     "gradient_checkpointing_offload_attention": True},
]
MATRIX = [(case, cfg) for case in ALL for cfg in OFFLOAD_CONFIGS]


@pytest.mark.parametrize(("case", "config"), MATRIX, ids=[f"{c.name}-{config_id(k)}" for c, k in MATRIX])
def test_offload_parity_through_the_engine(case, config):
    """Every byte goes through host buffers and comes back: results must stay bit-identical."""
    with cpu_test_mode():
        check_strategy(case, config)


def _plain_pool(max_buckets: int) -> PinnedPool:
    return PinnedPool(max_buckets, allocate=lambda n: torch.empty(n, dtype=torch.uint8))


def test_size_classes_waste_at_most_a_quarter():
    for n in [1, 4096, 4097, 10_000, 1 << 20, (1 << 20) + 1, 3 * (1 << 24) + 7]:
        c = size_class(n)
        assert c >= n and (n <= 4096 or c <= n * 1.25)


def test_pool_reuses_buffers_and_caps_buckets():
    pool = _plain_pool(2)
    a, ka = pool.acquire(5000, torch.bfloat16)
    pool.release(a, ka, [])
    b, kb = pool.acquire(5000, torch.bfloat16)
    assert b is a and kb == ka and pool.pinned_allocations == 1  # reused, not reallocated
    c, kc = pool.acquire(1 << 20, torch.bfloat16)  # second bucket
    d, kd = pool.acquire(1 << 22, torch.bfloat16)  # third size: over the cap -> pageable
    assert kc is not None and kd is None and pool.buckets == 2 and pool.pageable_allocations == 1
    e, ke = pool.acquire(5000, torch.float32)  # same size, other dtype: another bucket, also over the cap
    assert ke is None
    for buf, key in [(b, kb), (c, kc), (d, kd), (e, ke)]:
        pool.release(buf, key, [])
    assert pool.checked_out == 0


def test_pool_waits_for_pending_events():
    class Pending:
        done = False

        def query(self):
            return self.done

    pool = _plain_pool(1)
    a, ka = pool.acquire(5000, torch.float32)
    event = Pending()
    pool.release(a, ka, [event])
    b, _ = pool.acquire(5000, torch.float32)
    assert b is not a  # the copy out of `a` has not finished: never hand it out
    event.done = True
    c, _ = pool.acquire(5000, torch.float32)
    assert c is a


def test_zero_buckets_means_pageable_only():
    pool = PinnedPool(0)
    buf, key = pool.acquire(1 << 20, torch.float32)
    assert key is None and not buf.is_pinned() and pool.pinned_allocations == 0


def test_pinning_failure_falls_back_with_one_warning():
    def refuse(n):
        raise RuntimeError("CUDA error: out of memory (simulated pinned-memory cap)")

    pool = PinnedPool(4, allocate=refuse)
    with pytest.warns(RuntimeWarning, match="pinned host memory") as record:
        first, k1 = pool.acquire(1 << 20, torch.float32)
        second, k2 = pool.acquire(1 << 21, torch.float32)
    assert len(record) == 1 and k1 is None and k2 is None and not pool.pin


class _Pins:
    """Stands in for cudaHostRegister / cudaHostUnregister on the CPU: which buffers are pinned now."""

    def __init__(self) -> None:
        self.pinned: dict[int, int] = {}

    def allocate(self, n: int) -> torch.Tensor:
        buf = torch.empty(n, dtype=torch.uint8)
        self.pinned[buf.data_ptr()] = n
        return buf

    def unpin(self, buf: torch.Tensor) -> None:
        assert self.pinned.pop(buf.data_ptr(), None) is not None, "unpinned twice, or never pinned"


def test_closing_the_pool_unpins_every_buffer_once_and_later_requests_are_pageable():
    pins = _Pins()
    pool = PinnedPool(4, allocate=pins.allocate, unpin=pins.unpin)
    a, ka = pool.acquire(5000, torch.float32)
    b, kb = pool.acquire(1 << 20, torch.float32)
    pool.release(a, ka, [])  # one free, one still checked out (a backward not yet run)
    assert len(pins.pinned) == 2 and pool.pinned_bytes == a.numel() + b.numel()
    pool.close()
    assert pins.pinned == {} and not pool.pin
    b.fill_(7)  # what a pending backward still reads stays valid memory
    pool.release(b, kb, [])
    c, kc = pool.acquire(5000, torch.float32)
    assert kc is None and c is not a and pool.pinned_allocations == 2  # pageable now, nothing re-pinned
    pool.close()  # idempotent: nothing is unpinned twice


def test_a_pool_collected_without_close_unpins_its_buffers():
    pins = _Pins()
    pool = PinnedPool(4, allocate=pins.allocate, unpin=pins.unpin)
    buf, key = pool.acquire(1 << 20, torch.float32)
    pool.release(buf, key, [])
    del pool, buf
    gc.collect()
    assert pins.pinned == {}


def test_remove_gives_the_engines_pinned_memory_back(monkeypatch):
    """``remove()`` closes the handle's engine: its host buffers are unpinned then, not at collection."""
    closed = []
    monkeypatch.setattr(OffloadEngine, "close", lambda self: closed.append(self))
    model, _ = WAN.twins()
    with cpu_test_mode():
        handle = gradseam.patch(model, {"gradient_checkpointing": True, "gradient_checkpointing_backend": "unsloth"})
        engine = handle.engine
        run_step(model, WAN)
        assert closed == []
        handle.remove()
    assert closed == [engine]


def test_buffers_are_registered_whole_pages_of_their_own():
    """What the default allocator pins: page-aligned, whole pages, a mapping of its own, and counted exactly (torch's pinned allocator would round a 5 MiB class up to 8 MiB and not say so)."""
    import mmap

    calls = []

    class Cudart:
        def cudaHostRegister(self, ptr, size, flags):  # noqa: N802 - CUDA's name
            calls.append((ptr, size, flags))
            return 0

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "cudart", lambda: Cudart())
        mp.setattr(torch.cuda, "check_error", lambda res: None if res == 0 else pytest.fail(str(res)))
        buf = register_pinned(5 * (1 << 20) + 3)
    page = mmap.PAGESIZE
    (ptr, size, flags), = calls
    assert ptr == buf.data_ptr() and ptr % page == 0 and size == buf.numel() and size % page == 0
    assert 5 * (1 << 20) + 3 <= size < 5 * (1 << 20) + 3 + page and flags == 0
    storage = buf.untyped_storage()
    assert storage.data_ptr() == ptr and storage.nbytes() == size  # is_pinned() reads the storage's start
    buf.fill_(3)  # writable host memory


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run with -m cuda on a GPU machine)")
def test_pool_pins_exactly_what_it_counts_and_close_unpins_on_the_gpu():
    before = torch.cuda.host_memory_stats().get("allocated_bytes.all.current", 0)
    pool = PinnedPool(4)
    buf, key = pool.acquire(5 * (1 << 20) + 3, torch.bfloat16)
    assert key is not None and buf.is_pinned() and pool.pinned_bytes == buf.numel() == size_class(5 * (1 << 20) + 3)
    gpu = torch.randn(1 << 20, device="cuda")
    host = buf[: gpu.numel() * 4].view(torch.float32)
    host.copy_(gpu, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(host, gpu.cpu())
    assert torch.cuda.host_memory_stats().get("allocated_bytes.all.current", 0) == before  # not torch's pool
    pool.close()
    assert not buf.is_pinned() and torch.equal(host, gpu.cpu())  # still readable, as pageable memory


def _engine(**kw) -> OffloadEngine:
    return OffloadEngine(host_store(kw.pop("max_buckets", 4), test_mode=True), min_bytes=kw.pop("min_bytes", 0), device_test_mode=True)


def test_views_are_restored_with_strides_and_storage_copied_once():
    engine = _engine()
    w = torch.randn(6, 4, requires_grad=True)
    x = torch.randn(5, 6, requires_grad=True)
    with engine.group():
        qkv = x @ w  # (5, 4)
        q, k = qkv[:, :2], qkv.t()[2:]  # two views of one storage, different strides
        y = (q.sin() * k.t().cos()).sum()
    # six saved tensors (x, w, q, k viewed back, sin(q), cos(k)); q and k share one storage copy
    assert engine.copies == 5
    y.backward()
    expected_w, expected_x = w.grad.clone(), x.grad.clone()
    w.grad = x.grad = None
    qkv = x @ w
    (qkv[:, :2].sin() * qkv.t()[2:].t().cos()).sum().backward()
    assert torch.equal(w.grad, expected_w) and torch.equal(x.grad, expected_x)


def test_conjugate_and_negative_views_come_back_with_their_bits():
    # A conjugate (or negative) view is a bit on the tensor, not in its bytes: compiled blocks save complex
    # RoPE tables that way, and a storage copy without the bit gave silently wrong gradients.
    engine = _engine()
    x = torch.randn(4, 3, dtype=torch.complex64, requires_grad=True)
    a = torch.randn(4, 3, requires_grad=True)
    w = torch.randn(4, 3, dtype=torch.complex64)
    with engine.group():
        saved_conj, saved_neg = w.conj(), w.conj().imag  # is_conj(), is_neg(): what mul saves for backward
        assert saved_conj.is_conj() and saved_neg.is_neg()
        y = torch.view_as_real(x * saved_conj).sum() + (a * saved_neg).square().sum()
    assert engine.copies >= 1
    y.backward()
    got_x, got_a = x.grad.clone(), a.grad.clone()
    x.grad = a.grad = None
    (torch.view_as_real(x * w.conj()).sum() + (a * w.conj().imag).square().sum()).backward()
    assert torch.equal(got_x, x.grad) and torch.equal(got_a, a.grad)


def test_storage_saved_twice_is_copied_once():
    engine = _engine()
    x = torch.randn(8, 8, requires_grad=True)
    with engine.group():
        h = x * 2
        y = (h.sin() + h.cos() + h * h).sum()  # h saved four times
    assert engine.copies == 1
    y.backward()


def test_a_save_after_an_in_place_edit_is_a_copy_of_its_own():
    """A processor saves its query once for a side statistic, scales it in place (a softmax temperature),
    then the kernel saves it again: the second save must come back with the scaled bytes (it came back
    with the first pack's, and the version check passed), the statistic's own backward still raises."""
    def run(engine):
        x = torch.randn(8, 8, requires_grad=True)
        w = torch.randn(8, 8, requires_grad=True)
        context = engine.group() if engine is not None else contextlib.nullcontext()
        with context:
            q = x @ w
            statistic = q.square().mean()  # saves q at version 0
            with torch.no_grad():
                q.mul_(0.5)  # version 1
            out = (q * w).sum()  # saves q again, at version 1
        out.backward(retain_graph=True)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            statistic.backward()
        return x.grad, w.grad

    torch.manual_seed(0)
    want = run(None)
    torch.manual_seed(0)
    engine = _engine()
    got = run(engine)
    assert engine.copies == 4  # x, w (saved twice, copied once), q before and q after the edit
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])


def test_a_groups_copies_are_issued_together_when_it_closes():
    """One batch per group (a stream wait and an event per group on a GPU, not per tensor): nothing is
    copied while the group is open, everything once it closes, and backward gets the packed bytes."""
    engine = _engine()
    x = torch.randn(16, 16, requires_grad=True)
    w = torch.randn(16, 16, requires_grad=True)
    with engine.group() as group:
        h = (x @ w).sin()
        y = (h * h.cos()).sum()
        pending = list(group.pending)
        assert len(pending) == engine.copies >= 3 and all(stored.copied is None for stored in pending)
    assert not group.pending and all(stored.copied is not None for stored in pending)
    assert all(torch.equal(s.host[: s.nbytes], s.src) for s in pending)  # the newest group keeps its sources
    y.backward()
    got = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    h = (x @ w).sin()
    (h * h.cos()).sum().backward()
    assert torch.equal(got[0], x.grad) and torch.equal(got[1], w.grad)


def test_a_backward_inside_the_open_group_gets_the_packed_bytes_and_later_ones_too():
    """A backward that runs before its group closes (a closure that differentiates inside the region) issues
    the group's copies first, so a second backward after the close, from the host copies, agrees."""
    engine = _engine()
    x = torch.randn(16, 16, requires_grad=True)
    with engine.group() as group:
        y = (x * 2).sin().square().sum()
        (first,) = torch.autograd.grad(y, x, retain_graph=True)
        z = x.cos().sum()  # packed after the flush: copied at the close
    with engine.group():  # a newer group closes: the first lets go of its sources
        keep = (x * 3).exp().sum()
    assert all(ref().src is None for ref in group.stored if ref() is not None)  # backward reads the host copies
    (second,) = torch.autograd.grad(y, x)
    z.backward()
    keep.backward()
    assert torch.equal(first, second) and torch.equal(x.grad, -x.sin() + 3 * (x * 3).exp())


def test_in_place_modification_of_a_saved_tensor_still_raises():
    engine = _engine()
    x = torch.randn(8, requires_grad=True)
    with engine.group():
        h = x * 2
        y = h.sin().sum()
    with torch.no_grad():
        h.mul_(3)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_small_tensors_and_parameters_stay_put():
    engine = _engine(min_bytes=1 << 20)
    lin = torch.nn.Linear(16, 16)
    x = torch.randn(4, 16, requires_grad=True)
    with engine.group():
        lin(x).sum().backward()
    assert engine.copies == 0


def test_buffers_return_to_the_pool_and_nothing_leaks():
    engine = _engine()
    for _ in range(3):
        x = torch.randn(64, 64, requires_grad=True)
        with engine.group():
            y = (x * 2).sin().sum()
        y.backward()
        del y
        gc.collect()
    assert engine.store.checked_out == 0
    assert engine.store.pinned_allocations == 1  # one bucket buffer, reused by steps 2 and 3


def test_exception_mid_forward_leaks_no_buffer():
    engine = _engine()
    x = torch.randn(64, 64, requires_grad=True)
    with pytest.raises(ValueError, match="boom"), engine.group():
        (x * 2).sin()
        raise ValueError("boom")
    gc.collect()
    assert engine.store.checked_out == 0


def test_offload_strategies_need_a_cuda_model():
    from cases import FLUX

    model = FLUX.build()
    for config in (
        {"gradient_checkpointing": True, "gradient_checkpointing_backend": "unsloth"},
        {"gradient_checkpointing": True, "gradient_checkpointing_backend": "unsloth-ffn"},
        {"gradient_checkpointing_offload_attention": True},
    ):
        with pytest.raises(UnsupportedStrategyError, match="needs? a CUDA model.*model.to\\('cuda'\\)"):
            gradseam.patch(model, config)
        assert gradseam.handle_of(model) is None


def test_module_buffers_are_never_offloaded():
    class WithTable(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("table", torch.randn(64, 64))

    module = WithTable()
    engine = _engine()
    engine.watch(module)
    x = torch.randn(64, 64, requires_grad=True)
    with engine.group():
        y = (x.sin() * module.table).sum()  # sin saves x, the product saves the buffer
    assert engine.copies == 1  # x only
    y.backward()
    assert torch.equal(x.grad, x.detach().cos() * module.table)


class _WithTable(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.randn(64, 64))


def test_state_is_listed_once_until_refreshed_and_moves_are_noticed(monkeypatch):
    """Listing parameters walks every module (milliseconds on a real model): once per model
    forward, not once per group; a buffer that moved (``.to()``, loading) is still recognised."""
    module = _WithTable()
    engine = _engine()
    engine.watch(module)
    walks = []
    real = torch.nn.Module.buffers

    def counted(self, *args, **kwargs):
        walks.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "buffers", counted)
    x = torch.randn(64, 64, requires_grad=True)
    for _ in range(3):
        with engine.group():
            (x.sin() * module.table).sum()
    assert len(walks) == 1 and engine.copies == 3  # x each time, never the buffer
    module.table = module.table.clone()  # a new storage, as after .to() or loading weights
    with engine.group():
        (x.sin() * module.table).sum()
    assert len(walks) == 2 and engine.copies == 4
    engine.refresh()  # the patcher calls this before every model forward
    with engine.group():
        (x.sin() * module.table).sum()
    assert len(walks) == 3 and engine.copies == 5


def test_patched_model_lists_its_state_once_per_forward(monkeypatch):
    """Once per forward (not per group); and a model patched in the CPU test mode offloads wherever it then
    runs, so it is not 'offload pending' and gives no warning that nothing is offloaded."""
    from cases import FLUX

    from gradseam.offload import cpu_test_mode

    torch.manual_seed(0)
    model = FLUX.build()
    with cpu_test_mode():
        handle = gradseam.patch(model, {"gradient_checkpointing_offload_attention": True})
    walks = []
    real = torch.nn.Module.buffers

    def counted(self, *args, **kwargs):
        if self is model:
            walks.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "buffers", counted)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GradseamWarning)  # it offloads: no "nothing is offloaded" warning
        for step in range(2):
            model(**FLUX.inputs(torch.Generator().manual_seed(step)))[0].square().mean().backward()
    assert handle.engine.copies > 0 and not handle.offload_pending()
    assert len(walks) == 2  # 7 attention groups per forward, one listing per forward
    handle.remove()


def test_unsloth_lets_go_of_block_inputs_after_copying_them():
    """What the unsloth backends free is the block inputs: after the forward, nothing of gradseam's may
    still hold one on the device (only the newest region keeps its source, for backward to start on)."""
    import weakref

    from cases import WAN

    torch.manual_seed(0)
    model = WAN.build()
    seen: list[weakref.ref] = []
    def record(module, args, kwargs):
        seen.append(weakref.ref(args[0] if args else kwargs["hidden_states"]))

    hooks = [b.register_forward_pre_hook(record, with_kwargs=True) for b in model.blocks]
    with cpu_test_mode(), gradseam.patch(model, gradient_checkpointing=True, gradient_checkpointing_backend="unsloth"):
        out = model(**WAN.inputs(torch.Generator().manual_seed(1)))[0]
        gc.collect()
        alive = [i for i, ref in enumerate(seen) if ref() is not None]
        out.sum().backward()
    for h in hooks:
        h.remove()
    assert len(seen) == len(model.blocks)
    assert alive in ([], [len(seen) - 1]), f"block inputs still held after the forward: {alive}"
