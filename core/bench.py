"""Side-by-side measurements of strategies: activation peak and step time, on the real GPU.

The reference rows (no checkpointing, hand-written ``torch.utils.checkpoint``, a naive
unsloth-style checkpoint and ``save_on_cpu``) run in the same process as gradseam's rows, so
every comparison shares one machine state. Protocol (the anchors'): bf16, frozen weights, the
stack input requires grad, loss ``out.float().square().mean()``, one warm-up step, then the
median of the timed steps; the activation peak is ``max_memory_allocated`` over the timed steps
minus what was allocated before them.

Without CUDA (or with ``device="cpu"``) the synthetic workload runs on the CPU in float32 at a
small size (:data:`CPU_SHAPES`): the rows that only use torch (no checkpointing, the
``torch.utils.checkpoint`` references, gradseam's ``torch``/``torch-ffn``/interval rows) are
measured, and the memory column is the bytes autograd keeps between forward and backward
(counted with saved-tensor hooks, as ``gradseam demo`` does), not an allocator peak. The rows in
:data:`CUDA_ONLY_ROWS` (pinned-memory offload and its references) are reported with the status
``"needs CUDA"``.

The JSON written by ``gradseam bench`` (see :func:`payload`)::

    {
      "title": str,            # also the table/chart title; says "CPU" on the CPU
      "device": "cuda" | "cpu",
      "memory": str,           # what peak_gib measures (MEMORY_GPU or MEMORY_CPU)
      "family": str | null, "preset": str | null, "layers": int | null, "steps": int,
      "rows": [                # one per (workload, strategy), in sweep order
        {"workload": str, "tokens": int, "strategy": str,
         "peak_gib": float | null,       # null unless status == "ok"
         "step_ms": float | null,        # median of the timed steps
         "status": str,                  # "ok", "OOM", "needs CUDA", "unsupported: ...", "error: ..."
         "pinned_allocations_after_warmup": int | null,
         "vs_none": float | null, "vs_torch": float | null}  # step-time ratios in the same workload
      ]
    }
"""

from __future__ import annotations

import gc
import json
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import gradseam

from .named_strategies import needs_cuda, rows

GiB = 1 << 30
MiB = 1 << 20
MEMORY_GPU = "activation peak: max_memory_allocated over the timed steps minus what was allocated before"
MEMORY_CPU = "bytes autograd keeps between forward and backward (saved tensors, parameters excluded)"
NEEDS_CUDA = "needs CUDA"

# gradseam's rows, from the one table of named strategies (gradseam.named_strategies)
GRADSEAM_ROWS: list[tuple[str, dict[str, Any]]] = rows(
    "torch", "torch-ffn", "unsloth", "unsloth-ffn", "attention offload", "torch-ffn + attention offload",
    "unsloth-ffn + attention offload", "torch + attention kept", "torch + attention offload",
    "unsloth + attention offload", "torch, interval 2",
)
# Rows of a real-model workload (``gradseam bench --family``): the references a user has today
# (no checkpointing, diffusers' own flag, ``save_on_cpu``), then gradseam's strategies.
DIFFUSERS_ROW = "ref: diffusers enable_gradient_checkpointing()"
REAL_REFERENCE_ROWS = ["none", DIFFUSERS_ROW, "ref: save_on_cpu"]
REFERENCE_ROWS = [
    "none",
    "ref: torch.utils.checkpoint",
    "ref: torch.utils.checkpoint (FFN)",
    "ref: naive unsloth",
    "ref: save_on_cpu",
]
# Rows the CPU mode cannot measure, reported as "needs CUDA" there: offload copies GPU memory, and
# kept attention kernel outputs escape the CPU mode's saved-tensor count.
CUDA_ONLY_ROWS = frozenset({label for label, _ in GRADSEAM_ROWS if needs_cuda(label)}
                           | {"ref: naive unsloth", "ref: save_on_cpu"})


@dataclass
class Result:
    workload: str
    tokens: int
    strategy: str
    peak_gib: float | None
    step_ms: float | None
    status: str = "ok"  # "ok" or "OOM" or an error
    pinned_allocations_after_warmup: int | None = None


# -- reference strategies (hand-written, as users write them today) ----------------------------


class _NaiveUnsloth(torch.autograd.Function):
    """Checkpoint a block, keeping its input in a pinned buffer copied on the compute stream."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, block: nn.Module, buffers: dict[int, torch.Tensor]) -> torch.Tensor:
        buf = buffers.get(id(block))
        if buf is None or buf.shape != x.shape:
            buf = buffers[id(block)] = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        buf.copy_(x, non_blocking=True)
        ctx.block, ctx.buf, ctx.device = block, buf, x.device
        with torch.no_grad():
            return block(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        x = ctx.buf.to(ctx.device, non_blocking=True).requires_grad_(True)
        with torch.enable_grad():
            out = ctx.block(x)
        torch.autograd.backward(out, grad)
        return x.grad, None, None


class _ReferenceWrap(nn.Module):
    """Wraps each block of a list with a hand-written reference strategy (for comparison rows)."""

    def __init__(self, block: nn.Module, mode: str, buffers: dict[int, torch.Tensor]) -> None:
        super().__init__()
        self.block, self.mode, self.buffers = block, mode, buffers

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.mode == "checkpoint":
            return checkpoint(self.block, *args, use_reentrant=False, **kwargs)
        (x,) = args  # the naive unsloth row is only defined for single-input blocks
        return _NaiveUnsloth.apply(x, self.block, self.buffers)


@contextmanager
def reference(model: nn.Module, blocks_attr: str, mode: str, submodule: str | None = None) -> Iterator[None]:
    """Wrap every block (or its ``submodule``, e.g. the FFN) with a hand-written reference strategy."""
    blocks = getattr(model, blocks_attr)
    owners = [b._modules for b in blocks] if submodule else [blocks._modules] * len(blocks)
    keys = [submodule] * len(owners) if submodule else list(blocks._modules)
    original = [owner[key] for owner, key in zip(owners, keys)]
    buffers: dict[int, torch.Tensor] = {}
    for owner, key, module in zip(owners, keys, original):
        owner[key] = _ReferenceWrap(module, mode, buffers)
    try:
        yield
    finally:
        for owner, key, module in zip(owners, keys, original):
            owner[key] = module


# -- measuring ----------------------------------------------------------------------------------


def measure(step: Callable[[], None], steps: int = 5) -> tuple[float, float]:
    """(activation peak GiB, median step ms) of ``step`` on the current CUDA device."""
    step()  # warm-up: allocator, kernels, pinned pool
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1000)
    peak = (torch.cuda.max_memory_allocated() - base) / GiB
    return peak, statistics.median(times)


def measure_cpu(step: Callable[[], int], steps: int = 2) -> tuple[float, float]:
    """(GiB autograd keeps between forward and backward, median step ms) of a CPU ``step``.

    ``step`` runs one forward + backward and returns the saved bytes it counted in its forward
    (see :func:`gradseam.testing.count_saved_bytes`); the largest count of the timed steps is kept.
    """
    step()  # warm-up
    times, kept = [], []
    for _ in range(steps):
        start = time.perf_counter()
        kept.append(step())
        times.append((time.perf_counter() - start) * 1000)
    return max(kept) / GiB, statistics.median(times)


def _strategy_context(model: nn.Module, name: str, config: dict[str, Any] | None, blocks_attr: str) -> Any:
    if config is not None:
        return _Patched(model, config)
    if name == "none":
        return nullcontext()
    if name == "ref: torch.utils.checkpoint":
        return reference(model, blocks_attr, "checkpoint")
    if name == "ref: torch.utils.checkpoint (FFN)":
        return reference(model, blocks_attr, "checkpoint", submodule="ffn")
    if name == "ref: naive unsloth":
        return reference(model, blocks_attr, "naive-unsloth")
    if name == "ref: save_on_cpu":
        return torch.autograd.graph.save_on_cpu(pin_memory=True)
    if name == DIFFUSERS_ROW:
        return _diffusers_checkpointing(model)
    raise ValueError(f"unknown strategy {name!r}")


@contextmanager
def _diffusers_checkpointing(model: nn.Module) -> Iterator[None]:
    enable = getattr(model, "enable_gradient_checkpointing", None)
    if enable is None or not getattr(model, "_supports_gradient_checkpointing", False):
        raise gradseam.UnsupportedStrategyError(f"{type(model).__name__} has no diffusers gradient checkpointing")
    enable()
    try:
        yield
    finally:
        model.disable_gradient_checkpointing()


class _Patched(AbstractContextManager):
    def __init__(self, model: nn.Module, config: dict[str, Any]) -> None:
        self.model, self.config, self.handle = model, config, None

    def __enter__(self) -> _Patched:
        self.handle = gradseam.patch(self.model, self.config)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.handle is not None:
            self.handle.remove()


def run_rows(
    workload: str,
    tokens: int,
    model: nn.Module,
    make_step: Callable[[], Callable[[], None]],
    rows: list[tuple[str, dict[str, Any] | None]],
    *,
    steps: int = 5,
    blocks_attr: str = "blocks",
    on_row: Callable[[Result], None] | None = None,
    device: str = "cuda",
) -> list[Result]:
    """Measure every row on ``model``; a failing cell becomes a row with a status, never an exception.

    On ``device="cpu"`` the steps made by ``make_step`` return their saved bytes (see
    :func:`measure_cpu`) and the rows in :data:`CUDA_ONLY_ROWS` are reported as "needs CUDA".
    """
    cpu = device == "cpu"
    results = []
    for name, config in rows:
        if cpu and name in CUDA_ONLY_ROWS:
            result = Result(workload, tokens, name, None, None, NEEDS_CUDA)
            results.append(result)
            if on_row is not None:
                on_row(result)
            continue
        gc.collect()
        if not cpu:
            torch.cuda.empty_cache()
        try:
            ctx = _strategy_context(model, name, config, blocks_attr)
            with ctx:
                step = make_step()
                # looked up per call, so tests can replace measure / measure_cpu
                peak, ms = (measure_cpu if cpu else measure)(step, steps)
                pinned = None
                handle = getattr(ctx, "handle", None)
                engine = getattr(handle, "engine", None)
                if engine is not None and not cpu:
                    before = engine.pool.pinned_allocations
                    step()
                    torch.cuda.synchronize()
                    pinned = engine.pool.pinned_allocations - before
            # CPU counts are small (a few MiB at the default size): keep enough digits
            result = Result(workload, tokens, name, round(peak, 6 if cpu else 3), round(ms, 1),
                            pinned_allocations_after_warmup=pinned)
        except torch.OutOfMemoryError:
            result = Result(workload, tokens, name, None, None, "OOM")
        except gradseam.UnsupportedStrategyError as exc:
            result = Result(workload, tokens, name, None, None, f"unsupported: {exc}")
        except Exception as exc:  # one broken cell must not lose the sweep; the row says what broke
            result = Result(workload, tokens, name, None, None, f"error: {type(exc).__name__}: {exc}"[:300])
        finally:
            step = None  # type: ignore[assignment]
        results.append(result)
        if on_row is not None:
            on_row(result)
    return results


# -- the synthetic workload ---------------------------------------------------------------------

SYNTHETIC_SHAPES = [(8, 1024, 3072), (8, 4096, 3072), (8, 16384, 3072), (32, 3072, 4096)]
# (blocks, tokens, dim) on the CPU: seconds, not minutes, for the whole sweep
CPU_SHAPES = [(2, 256, 256)]
CPU_STEPS = 2


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def synthetic_rows(rows: list[str] | None = None) -> list[tuple[str, dict[str, Any] | None]]:
    chosen: list[tuple[str, dict[str, Any] | None]] = [(n, None) for n in REFERENCE_ROWS]
    chosen += [(n, c) for n, c in GRADSEAM_ROWS]
    if rows is not None:
        chosen = [r for r in chosen if r[0] in rows]
    return chosen


def synthetic(
    shapes: list[tuple[int, int, int]] | None = None,
    rows: list[str] | None = None,
    steps: int | None = None,
    on_row: Callable[[Result], None] | None = None,
    device: str | None = None,
) -> list[Result]:
    """Every row on the synthetic stack: bf16 on the GPU, or float32 at :data:`CPU_SHAPES` on the CPU."""
    from .synthetic import SyntheticStack, ensure_registered

    device = device or default_device()
    cpu = device == "cpu"
    if shapes is None:
        shapes = CPU_SHAPES if cpu else SYNTHETIC_SHAPES
    if steps is None:
        steps = CPU_STEPS if cpu else 5
    dtype = torch.float32 if cpu else torch.bfloat16
    ensure_registered()
    chosen = synthetic_rows(rows)
    results = []
    for blocks, tokens, dim in shapes:
        torch.manual_seed(0)
        with torch.device(device):
            model = SyntheticStack(blocks, dim).to(dtype).requires_grad_(False)
        x = torch.randn(1, tokens, dim, device=device, dtype=dtype)
        params = {id(p) for p in model.parameters()}

        def make_step(
            model: nn.Module = model, x: torch.Tensor = x, params: set[int] = params
        ) -> Callable[[], Any]:
            def step() -> None:
                inp = x.detach().requires_grad_(True)
                model(inp).float().square().mean().backward()

            def cpu_step() -> int:
                from .testing import count_saved_bytes

                inp = x.detach().requires_grad_(True)
                with count_saved_bytes(params) as saved:
                    out = model(inp)
                out.float().square().mean().backward()
                return saved[0]

            return cpu_step if cpu else step

        workload = f"synthetic {blocks}x{tokens}x{dim}"
        results += run_rows(workload, tokens, model, make_step, chosen, steps=steps, on_row=on_row, device=device)
        del model, x
    return results


def synthetic_title(device: str) -> str:
    if device == "cpu":
        return "gradseam bench (CPU, float32): synthetic block stack"
    return "gradseam bench: synthetic block stack"


def payload(
    rows: list[dict[str, Any]], title: str, *, device: str = "cuda", family: str | None = None,
    preset: str | None = None, layers: int | None = None, steps: int = 5,
) -> dict[str, Any]:
    """The JSON document ``gradseam bench`` writes (schema in this module's docstring)."""
    return {
        "title": title, "device": device, "memory": MEMORY_CPU if device == "cpu" else MEMORY_GPU,
        "family": family, "preset": preset, "layers": layers, "steps": steps, "rows": rows,
    }


def real(
    family: str,
    preset: str | None = None,
    *,
    layers: int | None = None,
    tokens: list[int | None] | None = None,
    rows: list[str] | None = None,
    steps: int = 3,
    on_row: Callable[[Result], None] | None = None,
) -> list[Result]:
    """Every row on a family preset's real-size model (random bf16 weights, built on the GPU)."""
    from .workloads import build, make_step, sequence_length

    workload = build(family, preset, layers=layers, device="cuda")
    chosen = real_rows(rows)
    results = []
    for count in tokens or [None]:
        inputs = workload.inputs(count)
        seq = sequence_length(workload.model, workload.family, inputs)

        def step_factory(inputs: dict[str, Any] = inputs) -> Callable[[], None]:
            return make_step(workload.model, inputs)

        results += run_rows(workload.label(seq), seq, workload.model, step_factory, chosen, steps=steps,
                            on_row=on_row)
        del inputs
    return results


def real_rows(rows: list[str] | None = None) -> list[tuple[str, dict[str, Any] | None]]:
    chosen: list[tuple[str, dict[str, Any] | None]] = [(n, None) for n in REAL_REFERENCE_ROWS]
    chosen += [(n, c) for n, c in GRADSEAM_ROWS]
    if rows is not None:
        chosen = [r for r in chosen if r[0] in rows]
    return chosen


def chart(rows: list[dict[str, Any]], path: Any, title: str = "gradseam bench", *, cpu: bool = False) -> bool:
    """Memory (x) vs step time (y), one point per strategy, one panel per workload; False without matplotlib.

    ``cpu=True``: x is the MiB autograd keeps for backward (``peak_gib`` of a CPU run).
    """
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(1, max(1, len(workloads)), figsize=(7 * max(1, len(workloads)), 6), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        mine = [r for r in rows if r["workload"] == workload and r["status"] == "ok"]
        failed = [r["strategy"] for r in rows if r["workload"] == workload and r["status"] != "ok"]
        for r in mine:
            ref = r["strategy"] == "none" or r["strategy"].startswith("ref:")
            x = r["peak_gib"] * GiB / MiB if cpu else r["peak_gib"]
            ax.scatter(x, r["step_ms"], marker="s" if ref else "o", color="grey" if ref else "C0")
            ax.annotate(r["strategy"], (x, r["step_ms"]), fontsize=7, xytext=(4, 3),
                        textcoords="offset points")
        ax.set_xlabel("kept for backward (MiB, CPU)" if cpu else "activation peak (GiB)")
        ax.set_ylabel("step time (ms)")
        ax.set_title(workload, fontsize=9)
        ax.grid(alpha=0.3)
        if failed:
            ax.text(0.01, 0.01, "not shown: " + ", ".join(failed), transform=ax.transAxes, fontsize=7,
                    va="bottom", wrap=True)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def with_ratios(results: list[Result]) -> list[dict[str, Any]]:
    """Rows as dicts with ``vs_none`` and ``vs_torch`` step-time ratios per workload."""
    out = []
    for r in results:
        same = [o for o in results if o.workload == r.workload]
        none = next((o.step_ms for o in same if o.strategy == "none"), None)
        torch_ms = next((o.step_ms for o in same if o.strategy == "torch"), None)
        row = asdict(r)
        row["vs_none"] = round(r.step_ms / none, 3) if r.step_ms and none else None
        row["vs_torch"] = round(r.step_ms / torch_ms, 3) if r.step_ms and torch_ms else None
        out.append(row)
    return out


def to_markdown(rows: list[dict[str, Any]], *, cpu: bool = False) -> str:
    """The rows as a markdown table; ``cpu=True`` shows the MiB kept for backward instead of the GiB peak."""
    memory = "kept for backward MiB (CPU)" if cpu else "act. peak GiB"
    lines = [
        f"| workload | strategy | {memory} | step ms | vs none | vs gradseam torch |",
        "|---|---|---:|---:|---:|---:|",
    ]
    last = None
    for r in rows:
        workload = r["workload"] if r["workload"] != last else ""
        last = r["workload"]
        if r["status"] != "ok":
            lines.append(f"| {workload} | {r['strategy']} | {r['status']} | | | |")
            continue
        vs_none = f"{r['vs_none']:.2f}" if r["vs_none"] is not None else ""
        vs_torch = f"{r['vs_torch']:.3f}" if r["vs_torch"] is not None else ""
        peak = r["peak_gib"] * GiB / MiB if cpu else r["peak_gib"]
        lines.append(
            f"| {workload} | {r['strategy']} | {peak:.2f} | {r['step_ms']:.1f} | {vs_none} | {vs_torch} |"
        )
    return "\n".join(lines)


def main() -> None:  # python -m gradseam.bench [json-path]
    import sys

    results = synthetic(on_row=lambda r: print(r, flush=True))
    rows = with_ratios(results)
    print(to_markdown(rows, cpu=default_device() == "cpu"))
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
