"""Side-by-side measurements of strategies: activation peak and step time, on the real GPU.

The reference rows (no checkpointing, hand-written ``torch.utils.checkpoint``, a naive
unsloth-style checkpoint and ``save_on_cpu``) run in the same process as gradseam's rows, so
every comparison shares one machine state. Protocol (the anchors'): bf16, frozen weights, the
stack input requires grad, loss ``out.float().square().mean()``, one warm-up step, then the
median of the timed steps; the activation peak is ``max_memory_allocated`` over the timed steps
minus what was allocated before them.
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

GiB = 1 << 30

# (label, gradseam config or None for a reference row)
GRADSEAM_ROWS: list[tuple[str, dict[str, Any]]] = [
    ("torch", {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch"}),
    ("torch-ffn", {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch-ffn"}),
    ("unsloth", {"gradient_checkpointing": True, "gradient_checkpointing_backend": "unsloth"}),
    ("unsloth-ffn", {"gradient_checkpointing": True, "gradient_checkpointing_backend": "unsloth-ffn"}),
    ("attention offload", {"gradient_checkpointing_offload_attention": True}),
    (
        "torch-ffn + attention offload",
        {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch-ffn",
         "gradient_checkpointing_offload_attention": True},
    ),
    (
        "unsloth-ffn + attention offload",
        {"gradient_checkpointing": True, "gradient_checkpointing_backend": "unsloth-ffn",
         "gradient_checkpointing_offload_attention": True},
    ),
    ("torch, interval 2", {"gradient_checkpointing": True, "gradient_checkpointing_interval": 2}),
]
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
) -> list[Result]:
    results = []
    for name, config in rows:
        gc.collect()
        torch.cuda.empty_cache()
        try:
            ctx = _strategy_context(model, name, config, blocks_attr)
            with ctx:
                step = make_step()
                peak, ms = measure(step, steps)
                pinned = None
                handle = getattr(ctx, "handle", None)
                engine = getattr(handle, "engine", None)
                if engine is not None:
                    before = engine.pool.pinned_allocations
                    step()
                    torch.cuda.synchronize()
                    pinned = engine.pool.pinned_allocations - before
            result = Result(workload, tokens, name, round(peak, 3), round(ms, 1),
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


def synthetic(
    shapes: list[tuple[int, int, int]] = SYNTHETIC_SHAPES,
    rows: list[str] | None = None,
    steps: int = 5,
    on_row: Callable[[Result], None] | None = None,
) -> list[Result]:
    from .synthetic import SyntheticStack, ensure_registered

    ensure_registered()
    chosen: list[tuple[str, dict[str, Any] | None]] = [(n, None) for n in REFERENCE_ROWS]
    chosen += [(n, c) for n, c in GRADSEAM_ROWS]
    if rows is not None:
        chosen = [r for r in chosen if r[0] in rows]
    results = []
    for blocks, tokens, dim in shapes:
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = SyntheticStack(blocks, dim).to(torch.bfloat16).requires_grad_(False)
        x = torch.randn(1, tokens, dim, device="cuda", dtype=torch.bfloat16)

        def make_step(model: nn.Module = model, x: torch.Tensor = x) -> Callable[[], None]:
            def step() -> None:
                inp = x.detach().requires_grad_(True)
                model(inp).float().square().mean().backward()

            return step

        workload = f"synthetic {blocks}x{tokens}x{dim}"
        results += run_rows(workload, tokens, model, make_step, chosen, steps=steps, on_row=on_row)
        del model, x
    return results


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


def chart(rows: list[dict[str, Any]], path: Any, title: str = "gradseam bench") -> bool:
    """Memory (x) vs step time (y), one point per strategy, one panel per workload; False without matplotlib."""
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
            ax.scatter(r["peak_gib"], r["step_ms"], marker="s" if ref else "o", color="grey" if ref else "C0")
            ax.annotate(r["strategy"], (r["peak_gib"], r["step_ms"]), fontsize=7, xytext=(4, 3),
                        textcoords="offset points")
        ax.set_xlabel("activation peak (GiB)")
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


def to_markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| workload | strategy | act. peak GiB | step ms | vs none | vs gradseam torch |",
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
        lines.append(
            f"| {workload} | {r['strategy']} | {r['peak_gib']:.2f} | {r['step_ms']:.1f} | {vs_none} | {vs_torch} |"
        )
    return "\n".join(lines)


def main() -> None:  # python -m gradseam.bench [json-path]
    import sys

    results = synthetic(on_row=lambda r: print(r, flush=True))
    rows = with_ratios(results)
    print(to_markdown(rows))
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
