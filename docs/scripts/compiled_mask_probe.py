"""Does the compiler write a broadcast attention mask out densely? The probe for HunyuanVideo's compiled OOM.

HunyuanVideo passes every block a ``(B, 1, 1, N)`` key-padding mask; inductor's CUDA lowering of the
memory-efficient attention kernel (``sdpa_constraint``) materializes it as a dense ``(B, 1, N, N)``
bias, ~2 N² bytes per attention call (8.5 GiB at 540p's 67,576 tokens). gradseam's compiled backends
therefore run the attention of blocks handed such a mask outside the compiled graph
(:mod:`gradseam.run.compiled`). This script measures both on a shallow cut of the preset
(``--depth``, default 1 unit: 1 + 1 + 2 blocks), one row per token count and variant:

* ``none``: eager, no checkpointing (the reference peak);
* ``compile, attention in graph``: gradseam's ``compile`` backend with the broadcast-mask check
  switched off, so inductor compiles the attention with the mask (what it did before);
* ``compile``: the backend as it ships, the attention of such blocks eager.

If the dense bias is the cause, the in-graph row's peak grows with N² (by about 2 N² bytes per
attention call at least) and the shipped row's does not. Each row reports its first step (the
compile) apart from the timed steps (measure's warm-up times). On a CPU the compiled rows use
``aot_eager``, which does not lower attention, so there the peaks say nothing about the question;
the script only checks that it runs. ::

    python docs/scripts/compiled_mask_probe.py --tokens 8192 --tokens 16384 --tokens 32768 --json probe.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn

import gradseam
from gradseam.run import compiled as compiled_blocks
from gradseam.tools import measure as measuring
from gradseam.tools.workloads import build

COMPILE = {"gradient_checkpointing": True, "gradient_checkpointing_backend": "compile"}


@contextmanager
def attention_in_graph() -> Iterator[None]:
    """gradseam's broadcast-mask check switched off: the compiler sees the attention and its mask."""
    check = compiled_blocks.broadcast_mask
    compiled_blocks.broadcast_mask = lambda args, kwargs: False
    try:
        yield
    finally:
        compiled_blocks.broadcast_mask = check


def measure_row(model: nn.Module, inputs: dict[str, Any], label: str, steps: int, device: str) -> dict[str, Any]:
    row: dict[str, Any] = {"row": label}
    measuring.release(device)
    config = None if label == "none" else COMPILE
    try:
        handle = gradseam.patch(model, config) if config else None
        try:
            with attention_in_graph() if label.endswith("in graph") else nullcontext():
                got = measuring.measure(measuring.forward_backward(model, inputs), steps=steps, warmup=2,
                                        device=device)
                row.update(first_step_ms=round(got.warmup_times_ms[0], 1),  # the compile
                           peak_gib=round(got.peak_gib, 3), step_ms=round(got.step_ms, 1))
                if handle is not None:
                    row["notes"] = handle.summary().notes
        finally:
            if handle is not None:
                handle.remove()
    except Exception as exc:  # a row that does not fit is the finding, not the end of the probe
        row["status"] = "OOM" if measuring.is_oom(exc) else f"error: {type(exc).__name__}: {exc}"[:300]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="hunyuanvideo")
    parser.add_argument("--preset", default="13b-540p")
    parser.add_argument("--depth", type=int, default=1, help="units of depth kept (default 1)")
    parser.add_argument("--tokens", type=int, action="append", help="video tokens (repeat; default 8192)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    work = build(args.family, args.preset, depth=args.depth, device=args.device)
    results = []
    for tokens in args.tokens or [8192]:
        inputs = work.inputs(tokens)
        for label in ("none", "compile, attention in graph", "compile"):
            row = {"tokens": tokens, **measure_row(work.model, inputs, label, args.steps, args.device)}
            results.append(row)
            print(json.dumps(row), flush=True)
        del inputs
    if args.json:
        args.json.write_text(json.dumps({"family": args.family, "preset": args.preset, "depth": args.depth,
                                         "device": args.device, "torch": torch.__version__, "rows": results},
                                        indent=1))


if __name__ == "__main__":
    main()
