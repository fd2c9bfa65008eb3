"""Eager vs inductor-compiled blocks on the synthetic stack (H200): step time and activation peak.

Run on a CUDA machine: ``python docs/scripts/compile_bench.py``. Each block is compiled with
``nn.Module.compile()`` (inductor) and patched by gradseam; rows of one table share one process.
"""

import torch

import gradseam
from gradseam.tools import measure
from gradseam.tools.synthetic import SyntheticStack, ensure_registered

ensure_registered()
B, T, D = 8, 4096, 3072
torch.manual_seed(0)
with torch.device("cuda"):
    model = SyntheticStack(B, D).to(torch.bfloat16).requires_grad_(False)
x = torch.randn(1, T, D, device="cuda", dtype=torch.bfloat16)


step = measure.forward_backward(model, {"hidden_states": x.requires_grad_(True)})


def measured() -> tuple[float, float]:
    got = measure.measure(step, steps=3, warmup=2)  # two warm-ups: the first compiles
    return got.peak_gib, got.step_ms


rows = []
for compiled in (False, True):
    if compiled:
        for b in model.blocks:
            b.compile()  # kept for the rest of the run, so not gradseam.tools.compiled's context
    for name, cfg in [
        ("none", None),
        ("torch", {"gradient_checkpointing": True}),
        ("torch-ffn", {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch-ffn"}),
        ("unsloth", {"gradient_checkpointing": True, "gradient_checkpointing_backend": "unsloth"}),
        ("attention offload", {"gradient_checkpointing_offload_attention": True}),
    ]:
        h = gradseam.patch(model, cfg) if cfg else None
        try:
            peak, ms = measured()
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
