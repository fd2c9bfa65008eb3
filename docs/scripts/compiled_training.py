"""Compiled blocks in a training setup: PEFT LoRA, first-step compile time, a recompile for a new shape.

``gradseam bench`` measures frozen models; a LoRA run differs in what autograd keeps (the adapters'
inputs) and in what the compiler sees (PEFT's wrapped linears). This script measures, on one
real-size model at full depth, each row's activation peak, step time and pinned host memory, and
for compiled rows the first step (which compiles every block graph) and the first step at another
shape (an aspect bucket: dynamo recompiles). Rows of one run share one process and one model.

    python docs/scripts/compiled_training.py --family flux --tokens 4096 --retoken 3600 --lora 16 \
        --json compiled-lora.json

LoRA targets the attention projections (``to_q``, ``to_k``, ``to_v``, ``to_out.0``), as diffusers'
DreamBooth LoRA trainers do; ``--lora 0`` keeps every weight frozen.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

import gradseam
from gradseam.tools import measure as measuring
from gradseam.tools.compiled import applied, budget_config, budget_label
from gradseam.tools.named_strategies import BY_LABEL, compared, kept_kernel_variants, rows_of
from gradseam.tools.named_strategies import rows as named_rows
from gradseam.tools.workloads import blocks, build

# by default: the eager rows bench also compiles (kept kernel outputs, on the device and in CPU memory),
# then every compiled backend at each memory budget bench compares
GRADSEAM_ROWS = tuple(label for label, _ in rows_of([*kept_kernel_variants(), *compared(compiles=True)]))
GiB = 1 << 30


def _timed(step: Any) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="flux")
    parser.add_argument("--preset", default=None)
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--retoken", type=int, default=None, help="a second token count: the recompile")
    parser.add_argument("--lora", type=int, default=16, help="LoRA rank (0: frozen weights)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--budget", type=float, action="append", help="the compiler alone at this budget (default 0.05)")
    parser.add_argument("--no-compiler-row", action="store_true", help="leave out the compiler-alone rows")
    parser.add_argument("--row", action="append", help="gradseam rows by label (default: GRADSEAM_ROWS)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    work = build(args.family, args.preset, device="cuda")
    model = work.model
    trainable = 0
    if args.lora:
        from peft import LoraConfig

        model.add_adapter(LoraConfig(r=args.lora, lora_alpha=args.lora, init_lora_weights="gaussian",
                                     target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.to(work.dtype)
                trainable += p.numel()
    inputs = work.inputs(args.tokens)
    other = work.inputs(args.retoken) if args.retoken else None
    block_list = blocks(model, work.family)
    rows: list[tuple[str, dict[str, Any] | None]] = [("none", None)]
    if not args.no_compiler_row:
        rows += [(budget_label(b), budget_config(b)) for b in (args.budget or [0.05])]
    rows += list(named_rows(*(args.row or GRADSEAM_ROWS)))
    results = []
    for label, config in rows:
        measuring.release()
        row: dict[str, Any] = {"row": label}
        try:
            with applied(model, config or {}, block_list):
                handle = gradseam.handle_of(model)
                step = measuring.forward_backward(model, inputs)
                compiled = bool(config and config.get("compile_blocks")) or (label in BY_LABEL and BY_LABEL[label].compiles)
                if compiled:
                    row["first_step_ms"] = round(_timed(step), 1)
                got = measuring.measure(step, steps=args.steps, warmup=1, engine=getattr(handle, "engine", None))
                row.update(peak_gib=round(got.peak_gib, 3), step_ms=round(got.step_ms, 1),
                           pinned_gib=round(got.pinned_gib, 2), spread=got.spread)
                if compiled and other is not None:
                    again = measuring.forward_backward(model, other)
                    row["new_shape_first_step_ms"] = round(_timed(again), 1)
                    row["new_shape_step_ms"] = round(_timed(again), 1)
                    again = None
                step = None
        except Exception as exc:  # one cell must not lose the sweep
            row["status"] = "OOM" if measuring.is_oom(exc) else f"error: {type(exc).__name__}: {exc}"[:300]
        results.append(row)
        print(json.dumps(row), flush=True)
    base = next((r for r in results if r["row"] == "none" and "step_ms" in r), None)
    for r in results:
        if base and "step_ms" in r:
            r["vs_none"] = round(r["step_ms"] / base["step_ms"], 3)
    if args.json:
        args.json.write_text(json.dumps({
            "family": work.family.name, "preset": work.preset_name, "tokens": args.tokens, "retoken": args.retoken,
            "lora_rank": args.lora, "trainable": trainable, "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "rows": results}, indent=1))


if __name__ == "__main__":
    main()
