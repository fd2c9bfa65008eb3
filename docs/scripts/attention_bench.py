"""Whole-block checkpointing that never recomputes attention, side by side with its alternatives.

Measures, in one process on one GPU, every row below on one workload (frozen bf16 weights, random
init): the activation peak (``max_memory_allocated`` over the timed steps minus what was allocated
before them), the median step time, and the pinned host memory the row's offload engine holds.
With two depths (``--layers 4,8``) it also fits the peak's growth per added block.

    python docs/scripts/attention_bench.py wan --preset 14b-480p --layers 4,8 --json wan14b.json
    python docs/scripts/attention_bench.py wan --preset 14b-480p --rows unsloth,unsloth+offload --json wan40.json
    python docs/scripts/attention_bench.py flux --tokens 16384 --layers 4 --json flux16k.json
    python docs/scripts/attention_bench.py synthetic --tokens 16384 --layers 8 --json synthetic.json
    python docs/scripts/attention_bench.py flux --cpu --tiny --steps 1     # smoke test (the suite runs it)

Rows: ``none``; gradseam's ``torch``, ``unsloth``, ``torch+keep`` (attention kernels' outputs kept on
the GPU), ``torch+offload`` and ``unsloth+offload`` (kept in pinned host memory); the compiler's
activation memory budget (``budget-0.3``, ``budget-0.1``, ``budget-0.05``: blocks compiled one by one
with ``torch._functorch.config.activation_memory_budget``); and gradseam rows on compiled blocks
(``compiled:unsloth+offload``, ``compiled:torch+keep``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
from typing import Any

import torch

import gradseam
from gradseam.offload import cpu_test_mode
from gradseam.tools import measure, workloads
from gradseam.tools.compiled import compiled_blocks

GiB = 2**30
ON = {"gradient_checkpointing": True}
CONFIGS: dict[str, dict[str, Any] | None] = {
    "none": None,
    "torch": ON,
    "unsloth": {**ON, "gradient_checkpointing_backend": "unsloth"},
    "torch+keep": {**ON, "gradient_checkpointing_keep_attention": True},
    "torch+offload": {**ON, "gradient_checkpointing_offload_attention": True},
    "unsloth+offload": {**ON, "gradient_checkpointing_backend": "unsloth", "gradient_checkpointing_offload_attention": True},
}
BUDGETS = {"budget-0.3": 0.3, "budget-0.1": 0.1, "budget-0.05": 0.05}
DEFAULT_ROWS = [*CONFIGS, *BUDGETS, "compiled:unsloth+offload", "compiled:torch+keep"]
TINY = {
    "flux": {"num_layers": 2, "num_single_layers": 2, "attention_head_dim": 16, "num_attention_heads": 2,
             "joint_attention_dim": 32, "pooled_projection_dim": 16, "axes_dims_rope": [4, 6, 6]},
    "wan": {"num_attention_heads": 2, "attention_head_dim": 16, "ffn_dim": 64, "num_layers": 2, "text_dim": 32,
            "freq_dim": 32},
}


def build(args: argparse.Namespace, layers: int | None) -> tuple[torch.nn.Module, dict[str, Any], list[torch.nn.Module]]:
    device = "cpu" if args.cpu else "cuda"
    dtype = torch.float32 if args.cpu else torch.bfloat16
    if args.family == "synthetic":
        from gradseam.tools.synthetic import SyntheticStack, ensure_registered

        ensure_registered()
        dim = 64 if args.tiny else 3072
        torch.manual_seed(0)
        with torch.device(device):
            model = SyntheticStack(layers or 8, dim).to(dtype).requires_grad_(False)
        x = torch.randn(1, args.tokens or 16384, dim, device=device, dtype=dtype, requires_grad=True)
        return model, {"hidden_states": x}, list(model.blocks)
    family = workloads.find_family(args.family)
    if args.tiny:
        import dataclasses

        name, preset = workloads.find_preset(family, args.preset)
        preset = dataclasses.replace(preset, config={**preset.config, **TINY[args.family]})
        family = dataclasses.replace(family, presets={name: preset})
    work = workloads.build(family, args.preset, layers=layers, device=device, dtype=dtype)
    inputs = work.inputs(args.tokens)
    return work.model, inputs, workloads.blocks(work.model, work.family)


def run_row(name: str, model: torch.nn.Module, inputs: dict[str, Any], blocks: list[torch.nn.Module],
            args: argparse.Namespace) -> dict[str, Any]:
    compile_it = name.startswith("compiled:") or name in BUDGETS
    config = CONFIGS.get(name.removeprefix("compiled:")) if name not in BUDGETS else None
    step = measure.forward_backward(model, inputs)
    handle = None
    with contextlib.ExitStack() as stack:
        if args.cpu:
            stack.enter_context(cpu_test_mode(min_bytes=0))
        if config is not None:
            handle = gradseam.patch(model, config)
            stack.callback(handle.remove)
        if compile_it:
            stack.enter_context(compiled_blocks(blocks, BUDGETS.get(name)))
        engine = handle.engine if handle is not None else None

        try:
            got = measure.measure(step, steps=args.steps, warmup=2 if compile_it else 1,
                                  device="cpu" if args.cpu else "cuda", engine=engine)
            peak = got.peak_gib if not args.cpu else float("nan")
            ms, allocations = got.step_ms, got.pinned_allocations_after_warmup or 0
        except torch.OutOfMemoryError:
            return {"row": name, "status": "OOM"}
        pinned = engine.store.pinned_bytes / GiB if engine is not None else 0.0
        moved = engine.offloaded_bytes / GiB / (args.steps + (2 if compile_it else 1)) if engine is not None else 0.0
    for p in model.parameters():
        p.grad = None
    gc.collect()
    if not args.cpu:
        torch.cuda.empty_cache()
    return {"row": name, "status": "ok", "peak_gib": peak, "step_ms": ms, "pinned_gib": pinned,
            "offloaded_gib_per_step": moved, "pinned_allocations_after_warmup": allocations}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("family", help="flux, wan, ..., or synthetic")
    parser.add_argument("--preset", default=None)
    parser.add_argument("--layers", default="", help="blocks per list, e.g. 8 or 4,8 (two depths: per-block growth)")
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--rows", default=",".join(DEFAULT_ROWS))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (engine CPU test mode; no peaks)")
    parser.add_argument("--tiny", action="store_true", help="tiny dimensions (CPU smoke test)")
    args = parser.parse_args()
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r.removeprefix("compiled:") not in CONFIGS and r not in BUDGETS]
    if unknown:
        parser.error(f"unknown rows {unknown}; known: {DEFAULT_ROWS}")
    depths = [int(x) for x in args.layers.split(",") if x] or [None]
    report: dict[str, Any] = {"argv": sys.argv[1:], "torch": torch.__version__,
                              "device": "cpu" if args.cpu else torch.cuda.get_device_name(), "depths": {}}
    for depth in depths:
        model, inputs, blocks = build(args, depth)
        seq = max((t.shape[-2] for t in measure.tensors(inputs) if t.dim() >= 3), default=0)
        results = []
        for name in rows:
            result = run_row(name, model, inputs, blocks, args)
            results.append(result)
            print(f"[depth {depth or 'full'}] {json.dumps(result)}", flush=True)
        report["depths"][str(depth or len(blocks))] = {"blocks": len(blocks), "input_seq": seq, "rows": results}
        del model, inputs, blocks
        gc.collect()
        if not args.cpu:
            torch.cuda.empty_cache()
    table(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def table(report: dict[str, Any]) -> None:
    depths = list(report["depths"].items())
    for key, data in depths:
        rows = {r["row"]: r for r in data["rows"]}
        none = rows.get("none", {}).get("step_ms")
        torch_ms = rows.get("torch", {}).get("step_ms")
        print(f"\n{data['blocks']} blocks ({key} per list)\n| row | act. peak GiB | step ms | vs none | vs torch | pinned GiB |")
        print("|---|---:|---:|---:|---:|---:|")
        for r in data["rows"]:
            if r["status"] != "ok":
                print(f"| {r['row']} | {r['status']} | | | | |")
                continue
            vs_none = f"{r['step_ms'] / none:.3f}" if none else ""
            vs_torch = f"{r['step_ms'] / torch_ms:.3f}" if torch_ms else ""
            print(f"| {r['row']} | {r['peak_gib']:.2f} | {r['step_ms']:.1f} | {vs_none} | {vs_torch} | {r['pinned_gib']:.2f} |")
    if len(depths) == 2:
        (k1, d1), (k2, d2) = depths
        print(f"\nper added block ({k1} -> {k2} per list)\n| row | GiB per block |\n|---|---:|")
        first = {r["row"]: r for r in d1["rows"] if r["status"] == "ok"}
        for r in d2["rows"]:
            if r["status"] == "ok" and r["row"] in first:
                growth = (r["peak_gib"] - first[r["row"]]["peak_gib"]) / (d2["blocks"] - d1["blocks"])
                print(f"| {r['row']} | {growth:.3f} |")


if __name__ == "__main__":
    raise SystemExit(main())
