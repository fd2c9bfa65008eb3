"""Offload cost with frozen vs trainable weights: Flux, 8 + 8 real-size blocks, 4096 image tokens, one H200.

Run on a CUDA machine: ``python docs/scripts/frozen_vs_trainable.py [--profile]``. No FSDP, no
optimizer: forward + backward only, median of 5 steps after one warm-up, rows in one process.
It separates what FSDP2 costs from what training the weights costs (docs/benchmarks.md, FSDP2).
``--profile`` also prints torch.profiler tables for a separate, untimed run of the trainable
``unsloth`` row.
"""

import sys

import torch

import gradseam
from gradseam.tools import measure, workloads

torch.backends.cuda.matmul.allow_tf32 = True
work = workloads.build("flux", layers=8, device="cuda")
model = work.model
inputs = work.inputs(4096)
CONFIGS = {
    "none": None,
    "torch": {"gradient_checkpointing": True},
    "unsloth": {"gradient_checkpointing": True, "gradient_checkpointing_backend": "unsloth"},
    "attention offload": {"gradient_checkpointing_offload_attention": True},
}


step = measure.forward_backward(model, inputs)


def run(n: int = 5) -> float:
    def one() -> int:
        model.zero_grad(set_to_none=True)
        return step()

    return measure.measure(one, steps=n).step_ms


for trainable in (False, True):
    model.requires_grad_(trainable)
    for name, config in CONFIGS.items():
        handle = gradseam.patch(model, config) if config else None
        print(f"trainable={trainable} {name:18s} {run():7.1f} ms", flush=True)
        if "--profile" in sys.argv and name == "unsloth" and trainable:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                run(2)
            for key in ("self_cuda_time_total", "self_cpu_time_total"):
                print(prof.key_averages().table(sort_by=key, row_limit=12, max_name_column_width=50))
        if handle is not None:
            handle.remove()
