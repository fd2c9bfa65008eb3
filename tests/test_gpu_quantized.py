"""LoRA-style training on quantized bases on the GPU (run on a CUDA machine: ``pytest -m cuda``).

Each base (:mod:`gradseam.tools.bases`) quantizes the blocks of two identical tiny fp32 models; a trainable
output projection stands in for the LoRA. Every backend must give the unpatched quantized model's step:
eager ones within the GPU's own run-to-run spread (as ``test_gpu.py``), compiled ones within the compiled
tolerance; on the real kernels (inductor, pinned copies on side streams, bitsandbytes' CUDA kernels) that
the CPU suite cannot reach. The offloading rows must offload something and never a weight.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from cases import FLUX, WAN, flux_inputs, wan_inputs
from test_gpu import _deterministic, _on_cuda, _spread  # noqa: F401  (the fixture applies here too)

import gradseam
from gradseam.offload.state import state_storages
from gradseam.testing import Case, assert_same_step, config_id, run_step
from gradseam.tools.bases import BASES, quantize
from gradseam.tools.workloads import blocks

pytestmark = pytest.mark.cuda

GPU_BASES = ["torchao-fp8", "torchao-int8", "torchao-float8-training", "quanto-qfloat8", "bnb-nf4", "bnb-int8"]
CONFIGS = [
    {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch"},
    {"gradient_checkpointing": True, "gradient_checkpointing_backend": "unsloth",
     "gradient_checkpointing_offload_attention": True},
    {"gradient_checkpointing": True, "gradient_checkpointing_backend": "compile"},
    {"gradient_checkpointing": True, "gradient_checkpointing_backend": "unsloth-compile"},
]


# CUDA's fp8 matmul (torch._scaled_mm) takes only sizes that are multiples of 16, and torchao's float8
# training recipe multiplies by the token count too (the weight-gradient matmul): the tiny cases' 6, 8 and
# 24 tokens fail in the unpatched model, so that base runs on inputs with 16 and 32 (48) tokens
TOKENS_BY_16 = {FLUX.name: Case(FLUX.name, FLUX.build, partial(flux_inputs, image=32, text=16)),
                WAN.name: Case(WAN.name, WAN.build, partial(wan_inputs, side=8, text=16))}


def _quantized(case, base: str):
    torch.manual_seed(case.seed)
    model = case.build().cuda()
    quantize(_blocks(model), base, torch.float32)
    # a frozen base: torchao's float8 recipe keeps trainable weights, and the time embedding training with them
    # sends a 1-token gradient into each block's norm projection, which CUDA's fp8 matmul refuses
    model.requires_grad_(False)
    model.proj_out.requires_grad_(True)
    return model


def _blocks(model):
    from gradseam.patcher import family_for

    return blocks(model, family_for(model))


@pytest.mark.parametrize("base", GPU_BASES)
@pytest.mark.parametrize("case", [FLUX, WAN], ids=lambda c: c.name)
def test_gpu_quantized_base_every_backend(case, base):
    if not BASES[base].available():
        pytest.skip(f"{BASES[base].library} is not installed (pip install 'gradseam[quant]')")
    gpu = _on_cuda(TOKENS_BY_16[case.name] if base == "torchao-float8-training" else case)
    reference_model = _quantized(gpu, base)
    reference = run_step(reference_model, gpu, count_bytes=False)
    spread = _spread(reference, run_step(reference_model, gpu, count_bytes=False))
    for config in CONFIGS:
        torch._dynamo.reset()
        model = _quantized(gpu, base)
        handle = gradseam.patch(model, config)
        compiled = config["gradient_checkpointing_backend"].endswith("compile")
        copied: list[int] = []
        if handle.engine is not None:
            handle.engine.min_bytes = 0  # tiny models: offload everything so the copies are exercised
            copy_out = handle.engine._copy_out

            def recording(group, t, storage, lo, hi, copy_out=copy_out, copied=copied):
                copied.append(storage.data_ptr())
                return copy_out(group, t, storage, lo, hi)

            handle.engine._copy_out = recording
        try:
            for _ in range(2):
                got = run_step(model, gpu, count_bytes=False)
                atol = max(1e-5 if compiled else 1e-6, 4 * spread)
                assert_same_step(reference, got, atol=atol, what=f"{case.name} {base} {config_id(config)}")
            if handle.engine is not None:
                weights = state_storages([*model.parameters(), *model.buffers()])
                assert copied and not weights.intersection(copied), f"{base}: a weight was offloaded"
        finally:
            handle.remove()
