"""gradseam.tools.bench on the CPU: the synthetic sweep, failing cells, the JSON payload, and advise's ladder
driven by real CPU measurements (bytes kept for backward) of a tiny synthetic stack."""

from __future__ import annotations

import json

import pytest
import torch

import gradseam
from gradseam.backends import CATALOG
from gradseam.kinds import KINDS
from gradseam.tools import bench as b
from gradseam.tools import bench_report as report
from gradseam.tools import bench_rows
from gradseam.tools.advise import GiB, advise
from gradseam.tools.compiled import compiles
from gradseam.tools.measure import count_saved_bytes

MiB = 1 << 20
TINY = [(2, 64, 128)]  # blocks, tokens, dim
# the rows the CPU measures, in the sweep's order: the references, then gradseam's least aggressive first
MEASURED = ["none", "ref: torch.utils.checkpoint", "ref: torch.utils.checkpoint (FFN)", "torch-ffn", "torch",
            "torch, interval 2"]
ROW_KEYS = {"workload", "tokens", "strategy", "peak_gib", "step_ms", "status", "pinned_allocations_after_warmup",
            "pinned_gib", "depth", "blocks", "vs_none", "vs_torch", "step_times_ms", "forward_peak_gib",
            "backward_peak_gib", "forward_ms", "backward_ms", "first_step_ms", "gpu_peak_gib",
            "pinned_weights_gib", "alloc_retries", "failure", "plan"}


@pytest.fixture(scope="module")
def results():
    return b.synthetic(TINY, steps=1, device="cpu")


def test_cpu_sweep_measures_torch_rows_and_marks_offload_rows(results):
    by = {r.strategy: r for r in results}
    assert [r.strategy for r in results] == [n for n, _ in bench_rows.synthetic_rows()]
    assert {r.workload for r in results} == {"synthetic 2x64x128"}
    for name in MEASURED:
        assert by[name].status == "ok", by[name]
        assert by[name].peak_gib > 0 and by[name].step_ms > 0
    assert b.CUDA_ONLY_ROWS & set(by)
    for name in b.CUDA_ONLY_ROWS & set(by):
        assert by[name].status == bench_rows.NEEDS_CUDA and by[name].peak_gib is None
    # rows that run on the CPU but are not measured there say so, not "needs CUDA"
    assert by["compile"].status == bench_rows.NOT_ON_CPU_COMPILED and by["compile"].peak_gib is None
    assert by["torch + attention kept"].status == bench_rows.NOT_ON_CPU_KEPT
    # the memory column is bytes kept for backward: exact counts, so these compare exactly
    assert by["torch"].peak_gib == by["ref: torch.utils.checkpoint"].peak_gib < by["torch-ffn"].peak_gib
    assert by["torch-ffn"].peak_gib == by["ref: torch.utils.checkpoint (FFN)"].peak_gib < by["none"].peak_gib
    assert by["torch, interval 2"].peak_gib < by["torch"].peak_gib


def test_cpu_defaults_are_small():
    assert b.CPU_SHAPES == [(2, 256, 256)] and b.CPU_STEPS == 2
    assert "CPU" in b.synthetic_title("cpu") and "CPU" not in b.synthetic_title("cuda")


def _fail_on(monkeypatch, strategy: str, exc: BaseException) -> list[int]:
    """Replace the measuring loop so that the cell of ``strategy`` raises ``exc``; the others really measure."""
    real = b.measuring.measure
    calls = [0]
    target = MEASURED.index(strategy)

    def fake(step, **kwargs):
        calls[0] += 1
        if calls[0] - 1 == target:
            raise exc
        return real(step, **kwargs)

    monkeypatch.setattr(b.measuring, "measure", fake)
    return calls


def test_oom_in_one_cell_is_a_row_and_the_sweep_continues(monkeypatch):
    calls = _fail_on(monkeypatch, "torch", torch.OutOfMemoryError("CUDA out of memory (simulated)"))
    seen = []
    results = b.synthetic(TINY, steps=1, device="cpu", on_row=seen.append)
    assert calls[0] == len(MEASURED)  # every measurable cell was tried
    assert [r.strategy for r in seen] == [r.strategy for r in results]
    by = {r.strategy: r for r in results}
    assert by["torch"].status == "OOM" and by["torch"].peak_gib is None and by["torch"].step_ms is None
    assert all(by[n].status == "ok" for n in MEASURED if n != "torch")
    rows = report.with_ratios(results)
    assert all(r["vs_torch"] is None for r in rows)  # no torch time to compare with
    assert "| torch | OOM |" in report.to_markdown(rows, cpu=True)


def test_other_errors_in_a_cell_are_recorded(monkeypatch):
    _fail_on(monkeypatch, "torch-ffn", RuntimeError("boom"))
    by = {r.strategy: r for r in b.synthetic(TINY, steps=1, device="cpu")}
    assert by["torch-ffn"].status == "error: RuntimeError: boom"
    assert by["torch, interval 2"].status == "ok"


def test_payload_and_cpu_table_and_chart(results, tmp_path):
    rows = report.with_ratios(results)
    doc = json.loads(json.dumps(report.payload(rows, b.synthetic_title("cpu"), device="cpu", steps=1)))
    assert set(doc) == {"title", "device", "gpu", "torch", "memory", "family", "preset", "steps", "base", "lora", "weights_gib",
                        "gpu_memory_gib", "host_memory_gib", "depth",
                        "full_depth", "rows"}
    assert doc["device"] == "cpu" and doc["memory"] == report.MEMORY_CPU and "CPU" in doc["title"]
    assert all(set(r) == ROW_KEYS for r in doc["rows"])
    text = report.to_markdown(rows, cpu=True)
    assert "kept for backward MiB (CPU)" in text and "act. peak GiB" not in text
    none = next(r for r in rows if r["strategy"] == "none")
    assert f"| none | {none['peak_gib'] * GiB / MiB:.2f} |" in text
    assert "act. peak GiB" in report.to_markdown(rows)
    pytest.importorskip("matplotlib")
    assert report.chart(rows, tmp_path / "cpu.png", "cpu", cpu=True)
    assert (tmp_path / "cpu.png").read_bytes()[:4] == b"\x89PNG"


# -- advise, measured for real on the CPU -------------------------------------------------------


def _cpu_measure(blocks: int = 4, tokens: int = 64, dim: int = 128):
    """advise's ``measure=``: real bytes kept for backward, and as the "time" the number of attention +
    FFN forwards a step starts (recomputation included; pre-hooks, since a recomputation stops early
    inside the last module): deterministic, and what checkpointing costs.

    advise rounds peaks to 0.001 GiB, too coarse for a tiny stack, so the peak is reported in MiB
    (budgets in this test are then "GiB" numbers that mean MiB)."""
    from gradseam.tools.synthetic import SyntheticStack, ensure_registered

    ensure_registered()
    torch.manual_seed(0)
    model = SyntheticStack(blocks, dim).requires_grad_(False)
    x = torch.randn(1, tokens, dim)
    forwards = [0]
    for block in model.blocks:
        for sub in (block.attn, block.ffn):
            sub.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))

    def measure(config):
        backend = CATALOG.get(config.get("gradient_checkpointing_backend", ""))
        if config.get("compile_blocks") or (backend is not None and KINDS[backend.kind].compiles):
            raise gradseam.UnsupportedStrategyError("inductor's memory budget is measured on the GPU")
        if (backend is not None and backend.moves) or config.get("gradient_checkpointing_offload_attention"):
            raise gradseam.UnsupportedStrategyError("pinned-memory offload needs CUDA")
        handle = gradseam.patch(model, config) if config.get("gradient_checkpointing") else None
        try:
            forwards[0] = 0
            inp = x.detach().requires_grad_(True)
            with count_saved_bytes(model) as saved:
                out = model(inp)
            out.square().mean().backward()
            return saved[0] / MiB, float(forwards[0])
        finally:
            if handle is not None:
                handle.remove()

    return measure


def test_advise_with_a_real_cpu_measurement_picks_a_partial_stride():
    measure = _cpu_measure()
    kept = {label: measure(config)[0] for label, config in [
        ("none", {"gradient_checkpointing": False}),
        ("torch-ffn", {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch-ffn"}),
        ("torch", {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch"}),
        ("3 of 4", {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch",
                    "gradient_checkpointing_interval": 3, "gradient_checkpointing_segment_stride": 4}),
        ("every other", {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch",
                         "gradient_checkpointing_interval": 1, "gradient_checkpointing_segment_stride": 2}),
    ]}
    # a GPU size that no checkpointing and torch-ffn miss, torch meets, and that leaves room for
    # leaving one block of four unchecked but not two
    assert kept["torch"] < kept["3 of 4"] < min(kept["every other"], kept["torch-ffn"]) < kept["none"]
    gpu = (kept["3 of 4"] + min(kept["every other"], kept["torch-ffn"])) / 2
    advice = advise(None, {}, gpu, measure=measure, static_gib=0.0)
    status = {t.label: t.status for t in advice.trials}
    assert status["none"] == status["torch-ffn"] == "over GPU memory"
    assert status["torch"] == "fits" and status["unsloth"] == "unsupported"
    assert status["torch, every other block"] == "over GPU memory"
    assert advice.chosen.label == "torch, 3 of every 4 blocks"
    assert advice.config == {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch",
                             "gradient_checkpointing_interval": 3, "gradient_checkpointing_segment_stride": 4}
    # 4 blocks x (attention + FFN), plus recomputing the three checkpointed blocks
    assert advice.chosen.step_ms == 14.0


def test_a_pinned_host_allocation_failure_is_an_oom_row_not_an_error(monkeypatch) -> None:
    # torch raises AcceleratorError, not OutOfMemoryError, when pinned host memory runs out
    # (HunyuanVideo 1.5's save_on_cpu row on the H200): the row must read OOM like any other.
    from gradseam.tools.measure import is_oom

    class AcceleratorError(RuntimeError):
        pass

    assert is_oom(AcceleratorError("CUDA error: out of memory"))
    assert is_oom(torch.OutOfMemoryError("CUDA out of memory"))
    assert not is_oom(AcceleratorError("CUDA error: an illegal memory access was encountered"))
    assert not is_oom(RuntimeError("out of memory"))
    _fail_on(monkeypatch, "torch", AcceleratorError("CUDA error: out of memory"))
    by = {r.strategy: r for r in b.synthetic(TINY, steps=1, device="cpu")}
    assert by["torch"].status == "OOM"
    assert by["torch-ffn"].status == "ok"


TORCH_OOM = ("CUDA out of memory. Tried to allocate 2.25 GiB. GPU 0 has a total capacity of 139.81 GiB of which "
             "115.2 GiB is free. Including non-PyTorch memory, this process has 23.61 GiB memory in use. Of the "
             "allocated memory 21.02 GiB is allocated by PyTorch, and 1.43 GiB is reserved by PyTorch but "
             "unallocated. If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=...")


def test_an_oom_row_says_where_and_what_the_allocator_held(monkeypatch) -> None:
    """A capped row that ran out of memory says GPU or host, forward or backward and torch's figures."""
    from gradseam.tools.measure import oom_detail

    def backward() -> None:  # named as autograd's frame is: the error was raised in the backward
        raise torch.OutOfMemoryError(TORCH_OOM + "\n[gradseam] out of GPU memory while reloading offloaded "
                                     "activations (12.0 MiB).")

    try:
        backward()
    except torch.OutOfMemoryError as exc:
        detail = oom_detail(exc)
    assert detail == ("GPU, in the backward; Tried to allocate 2.25 GiB; this process has 23.61 GiB memory in use; "
                      "21.02 GiB is allocated by PyTorch, and 1.43 GiB is reserved by PyTorch but unallocated; "
                      "[gradseam] out of GPU memory while reloading offloaded activations (12.0 MiB).")

    class AcceleratorError(RuntimeError):
        pass

    assert oom_detail(AcceleratorError("CUDA error: out of memory")) == "pinned host memory, in the forward"
    _fail_on(monkeypatch, "torch", torch.OutOfMemoryError(TORCH_OOM))
    by = {r.strategy: r for r in b.synthetic(TINY, steps=1, device="cpu")}
    assert by["torch"].status == "OOM" and by["torch"].failure.startswith("GPU, in the forward; Tried to allocate 2.25")
    assert by["torch-ffn"].status == "ok" and by["torch-ffn"].failure is None


def test_a_step_out_of_memory_frees_its_activations_before_the_row_unwinds() -> None:
    # Until an exception is handled its traceback keeps the failed step's frames alive, activations and all; a
    # patch removed while it unwinds (streamed weights copied back to the GPU) then found the card full and ran out
    # of memory itself (issue 41's Wan 2.1 14B run). measure() drops the frames' variables of an out-of-memory
    # error, and where it was raised still reads from it.
    import weakref

    from gradseam.tools.measure import measure, oom_detail

    held: dict[str, object] = {}

    def backward() -> None:  # named as autograd's frame is
        activations = torch.ones(1 << 16)
        held["activations"] = weakref.ref(activations)
        raise torch.OutOfMemoryError(TORCH_OOM)

    def other() -> None:
        activations = torch.ones(1 << 16)
        held["activations"] = weakref.ref(activations)
        raise ValueError("not a memory error: left as it is")

    with pytest.raises(torch.OutOfMemoryError) as caught:
        try:
            measure(backward, steps=1, warmup=1, device="cpu")
        finally:
            held["alive while unwinding"] = held["activations"]() is not None
    assert held["alive while unwinding"] is False
    assert oom_detail(caught.value).startswith("GPU, in the backward; Tried to allocate 2.25 GiB")
    with pytest.raises(ValueError):
        try:
            measure(other, steps=1, warmup=1, device="cpu")
        finally:
            held["alive while unwinding"] = held["activations"]() is not None
    assert held["alive while unwinding"] is True


def test_a_row_that_breaks_the_device_ends_the_sweep_with_the_row_to_skip(monkeypatch):
    # An illegal memory access (torch's save_on_cpu on Qwen-Image, H200) poisons the CUDA context:
    # every later row would fail the same way, so the sweep stops and names the row to leave out.
    calls = _fail_on(monkeypatch, "torch", RuntimeError("CUDA error: an illegal memory access was encountered"))
    monkeypatch.setattr(b.measuring, "context_lost", lambda device="cuda": True)
    seen = []
    with pytest.raises(b.DeviceLostError, match=r"row 'torch' broke the GPU's context .*--skip-row 'torch'"):
        b.synthetic(TINY, steps=1, device="cpu", on_row=seen.append)
    assert seen[-1].strategy == "torch" and seen[-1].status.startswith("error: RuntimeError")
    assert calls[0] == MEASURED.index("torch") + 1  # nothing ran after it


def test_counting_saved_bytes_keeps_autograds_in_place_check():
    """Saved-tensor hooks switch off autograd's own version check, so the byte count checks it: a step
    measured through it refuses an in-place edit of a saved tensor as a plain step does."""
    x = torch.randn(4, requires_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        x.exp().add_(1).sum().backward()  # plain autograd
    with count_saved_bytes() as saved:
        y = x.exp()
    assert saved[0] == 16
    y.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation.*saved at version 0 is at version 1"):
        y.sum().backward()
    with count_saved_bytes():
        z = x.exp()
    z.sum().backward()  # untouched: backward runs
    assert torch.equal(x.grad, x.detach().exp())


def test_every_row_keeps_its_first_step_and_a_slow_one_is_named(results):
    # measure() times its warm-up steps apart from the timed ones; bench keeps the first of them
    got = b.measuring.measure(lambda: 1024, steps=1, warmup=2, device="cpu")
    assert len(got.warmup_times_ms) == 2 and len(got.step_times_ms) == 1
    # kept for the rows that compile (the CPU sweep's compiled rows need CUDA, so none here)
    assert all(r.first_step_ms is None for r in results)
    assert compiles({"gradient_checkpointing": True, "gradient_checkpointing_backend": "unsloth-compile"})
    assert compiles({"compile_blocks": True, "compile_memory_budget": 0.1})
    assert not compiles({"gradient_checkpointing": True, "gradient_checkpointing_backend": "unsloth"})
    assert not compiles(None)
    rows = [{"strategy": "none", "status": "ok", "step_ms": 494.0, "first_step_ms": 900.0, "depth": 2},
            {"strategy": "compile", "status": "ok", "step_ms": 483.3, "first_step_ms": 53101.0, "depth": 2},
            {"strategy": "unsloth-compile", "status": "ok", "step_ms": 491.0, "first_step_ms": 35713.3},
            {"strategy": "torch", "status": "OOM", "step_ms": None, "first_step_ms": None}]
    assert report.first_steps_note(rows) == ("First steps (compiling, once per shape and row; not in the step "
                                             "times above): compile at depth 2 53.1 s; unsloth-compile 35.7 s.")
    assert report.first_steps_note(rows[:1]) is None  # a warm-up under 5x its step: not worth a line


def test_rows_whose_steps_made_the_allocator_retry_are_named_under_the_table():
    rows = [{"strategy": "unsloth-compile", "status": "ok", "step_ms": 479.3, "alloc_retries": 0, "depth": 19,
             "step_times_ms": [479.0] * 5},
            {"strategy": "unsloth-compile + stream 30 @ 16GiB", "status": "ok", "step_ms": 639.3, "alloc_retries": 2,
             "depth": 19, "step_times_ms": [606.6, 639.3, 1078.2, 1167.0, 628.6]},
            {"strategy": "torch", "status": "OOM", "step_ms": None, "alloc_retries": None}]
    note = report.retries_note(rows)
    assert note is not None and note.endswith(": unsloth-compile + stream 30 @ 16GiB at depth 19 2 in 5 steps.")
    assert "synchronizes the device" in note and "expandable_segments:True" in note
    assert report.retries_note(rows[:1] + rows[2:]) is None  # no retries (or none read): no line
    table = report.to_markdown([{**r, "workload": "flux", "tokens": 4096, "peak_gib": 1.0, "vs_none": None,
                           "vs_torch": None, "pinned_gib": None} for r in rows[:2]])
    assert table.endswith(note)
    got = b.measuring.measure(lambda: 1024, steps=1, device="cpu")
    assert got.alloc_retries is None  # read on the GPU only


# -- the rows, derived from the catalog (gradseam.tools.named_strategies) ---------------------------


def test_every_tools_rows_are_derived_least_aggressive_first():
    """bench, the demo and the compiled rows take the named strategies by property, in the catalog's
    ladder order: a new backend appears in each by being in the catalog."""
    from gradseam.tools.demo import strategies
    from gradseam.tools.named_strategies import STRATEGIES

    assert [s.label for s in STRATEGIES] == [
        "none", "torch-ffn", "torch", "torch, interval 2", "torch, interval 2, stride 4", "torch + attention kept",
        "unsloth-ffn", "unsloth", "attention offload", "torch-ffn + attention offload", "torch + attention offload",
        "unsloth-ffn + attention offload", "unsloth + attention offload", "compile, budget 0.3", "compile",
        "compile, budget 0.05", "compile, budget 0", "unsloth-compile, budget 0.3", "unsloth-compile",
        "unsloth-compile, budget 0.05", "unsloth-compile, budget 0",
    ]
    # bench: every row that patches and checkpoints every block, but the compiler's own budget rows
    assert [label for label, _ in bench_rows.GRADSEAM_ROWS] == [
        "torch-ffn", "torch", "torch, interval 2", "torch + attention kept", "unsloth-ffn", "unsloth",
        "attention offload", "torch-ffn + attention offload", "torch + attention offload",
        "unsloth-ffn + attention offload", "unsloth + attention offload", "compile", "unsloth-compile, budget 0.3",
        "unsloth-compile", "unsloth-compile, budget 0.05", "unsloth-compile, budget 0",
    ]
    assert [label for label, _ in bench_rows.COMPILED_ROWS] == ["compiled: torch + attention kept",
                                                       "compiled: unsloth + attention offload"]
    # the demo: every row that does not compile; on the CPU those it can measure there
    assert [label for label, _ in strategies(cuda=False)] == [
        "none", "torch-ffn", "torch", "torch, interval 2", "torch, interval 2, stride 4"]
    assert [label for label, _ in strategies(cuda=True)] == [s.label for s in STRATEGIES if not s.compiles]


def test_named_strategies_are_selected_by_property():
    from gradseam.backends import Kept
    from gradseam.tools.named_strategies import BY_LABEL, compared, kept_kernel_variants, select

    assert all(not s.compiles for s in select(compiles=False)) and select(compiles=True)
    assert [s.label for s in select(patches=False)] == ["none"]
    assert {s.label for s in select(strided=True)} == {"torch, interval 2, stride 4"}
    # another budget on the compiled backend that keeps everything on the device is the compiler's own row
    assert {s.label for s in select(repeats_compiler=True)} == {"compile, budget 0.3", "compile, budget 0.05",
                                                                      "compile, budget 0"}
    assert not any(s.repeats_compiler for s in compared())
    # kernel outputs kept where the backend keeps what it saves: one on the device, one in CPU memory
    kept = kept_kernel_variants()
    assert [(s.kept, s.backend.moves) for s in kept] == [(Kept.GPU, False), (Kept.CPU, True)]
    assert BY_LABEL["torch + attention offload"].kept_apart
    with pytest.raises(TypeError, match="no property"):
        select(colour="blue")
