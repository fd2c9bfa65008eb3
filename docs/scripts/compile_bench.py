"""Eager vs inductor-compiled blocks on the synthetic stack (H200): step time and activation peak.

Run on a CUDA machine: ``python docs/scripts/compile_bench.py``. Each block is compiled with
``nn.Module.compile()`` (inductor) and patched by gradseam; rows of one table share one process.
"""

import statistics
import time

import torch

import gradseam
from gradseam.synthetic import SyntheticStack, ensure_registered

ensure_registered()
B, T, D = 8, 4096, 3072
torch.manual_seed(0)
with torch.device("cuda"):
    model = SyntheticStack(B, D).to(torch.bfloat16).requires_grad_(False)
x = torch.randn(1, T, D, device="cuda", dtype=torch.bfloat16)


def step():
    inp = x.detach().requires_grad_(True)
    model(inp).float().square().mean().backward()


def measure(n=3):
    step()
    step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) * 1e3)
    return (torch.cuda.max_memory_allocated() - base) / 2**30, statistics.median(ts)


rows = []
for compiled in (False, True):
    if compiled:
        for b in model.blocks:
            b.compile()
    for name, cfg in [
        ("none", None),
        ("torch", {"gradient_checkpointing": True}),
        ("torch-ffn", {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch-ffn"}),
        ("unsloth", {"gradient_checkpointing": True, "gradient_checkpointing_backend": "unsloth"}),
        ("attention offload", {"gradient_checkpointing_offload_attention": True}),
    ]:
        h = gradseam.patch(model, cfg) if cfg else None
        try:
            peak, ms = measure()
            rows.append((("inductor" if compiled else "eager"), name, f"{peak:.2f}", f"{ms:.1f}"))
            print(rows[-1], flush=True)
        except Exception as e:
            rows.append(
                (("inductor" if compiled else "eager"), name, "error", type(e).__name__ + ": " + str(e)[:80])
            )
        finally:
            if h:
                h.remove()
print(f"| blocks (synthetic {B}x{T}x{D}) | strategy | act. peak GiB | step ms |\n|---|---|---:|---:|")
for r in rows:
    print("| " + " | ".join(r) + " |")
