"""Determinism and numerics: repeatable gradients, dtypes kept exactly, RNG preserved in recompute.

* Same seed, same inputs: two fresh patched models give bitwise the same outputs and gradients,
  for every strategy (offload ones through :func:`gradseam.offload.cpu_test_mode`).
* Low precision (bf16, fp16): the patched model's output, every gradient and every block's output
  have exactly the dtypes of the unpatched model's (and, on the CPU, the same values).
* Dropout inside a recomputed region: the recompute replays the forward's random numbers
  (``torch.utils.checkpoint`` restores the RNG state), so a patched model in train mode matches
  the unpatched one with the same seed, to the bit.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from cases import FLUX, WAN
from torch import nn

import gradseam
from gradseam.offload import cpu_test_mode
from gradseam.patcher import family_for
from gradseam.testing import Case, Step, assert_same_step, run_step

ON = {"gradient_checkpointing": True}
CONFIGS = {
    "torch": ON,
    "torch-ffn": {**ON, "gradient_checkpointing_backend": "torch-ffn"},
    "torch-interval2": {**ON, "gradient_checkpointing_interval": 2},
    "torch-stride3": {**ON, "gradient_checkpointing_segment_stride": 3},
    "unsloth": {**ON, "gradient_checkpointing_backend": "unsloth"},
    "unsloth-ffn": {**ON, "gradient_checkpointing_backend": "unsloth-ffn"},
    "unsloth-interval2-stride4": {**ON, "gradient_checkpointing_backend": "unsloth",
                                  "gradient_checkpointing_interval": 2, "gradient_checkpointing_segment_stride": 4},
    "attention-offload": {"gradient_checkpointing_offload_attention": True},
    "torch-ffn+attention-offload": {**ON, "gradient_checkpointing_backend": "torch-ffn",
                                    "gradient_checkpointing_offload_attention": True},
}
CASES = {"flux": FLUX, "wan": WAN}


def build(case: Case, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(case.seed)
    return case.build().to(dtype)


def patch(model: nn.Module, name: str):
    with cpu_test_mode():  # the engine is made at patch time; offload strategies then run on the CPU
        return gradseam.patch(model, CONFIGS[name])


def in_dtype(case: Case, dtype: torch.dtype) -> Case:
    """The same case with its floating inputs cast to ``dtype`` (gradients kept where they were)."""

    def inputs(g: torch.Generator) -> dict:
        return {
            k: v.detach().to(dtype).requires_grad_(v.requires_grad)
            if isinstance(v, torch.Tensor) and v.is_floating_point()
            else v
            for k, v in case.inputs(g).items()
        }

    return dataclasses.replace(case, inputs=inputs)


def step(model: nn.Module, case: Case, dtype: torch.dtype = torch.float32, seed: int = 1) -> Step:
    return run_step(model, in_dtype(case, dtype), seed=seed, count_bytes=False)


def blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    found = []
    for block_list in family_for(model).block_lists:
        for i, b in enumerate(model.get_submodule(block_list.path)):
            found.append((f"{block_list.path}[{i}]", b))
    return found


def dtypes(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value.dtype]
    if isinstance(value, (tuple, list)):
        return [d for v in value for d in dtypes(v)]
    return [type(value).__name__]


# -- determinism ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_same_seed_gives_bitwise_same_gradients(case, name):
    """Two fresh patched models, same seed and inputs: the same bits, on two steps each."""
    runs = []
    for _ in range(2):
        model = build(case)
        handle = patch(model, name)
        runs.append([step(model, case, seed=1), step(model, case, seed=2)])
        handle.remove()
    for s, (a, b) in enumerate(zip(*runs)):
        assert_same_step(a, b, what=f"{case.name} {name} step {s + 1} run to run")
    # ...and those bits are the unpatched model's.
    assert_same_step(step(build(case), case, seed=1), runs[0][0], what=f"{case.name} {name} vs unpatched")


# -- dtypes --------------------------------------------------------------------------------------

LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_CONFIGS = ["torch", "torch-ffn", "torch-interval2", "unsloth", "torch-ffn+attention-offload"]


def traced_step(model: nn.Module, case: Case, dtype: torch.dtype) -> tuple[Step, dict[str, list]]:
    """A step, with the dtypes of every block's output (forward hooks on the blocks)."""
    seen: dict[str, list] = {}

    def record(label: str):
        def hook(_m, _a, out) -> None:  # returns None: the output stays as it is
            seen.setdefault(label, dtypes(out))

        return hook

    hooks = [b.register_forward_hook(record(label)) for label, b in blocks(model)]
    try:
        return step(model, case, dtype), seen
    finally:
        for h in hooks:
            h.remove()


@pytest.mark.parametrize("name", DTYPE_CONFIGS)
@pytest.mark.parametrize("dtype", list(LOW.values()), ids=list(LOW))
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_low_precision_keeps_dtypes(case, dtype, name):
    reference, ref_blocks = traced_step(build(case, dtype), case, dtype)
    model = build(case, dtype)
    with patch(model, name):
        got, got_blocks = traced_step(model, case, dtype)
    what = f"{case.name} {name} {dtype}"
    assert [o.dtype for o in got.outputs] == [o.dtype for o in reference.outputs] == [dtype] * len(got.outputs), what
    assert {k: v.dtype for k, v in got.input_grads.items()} == {k: v.dtype for k, v in reference.input_grads.items()}
    assert {k: v.dtype for k, v in got.param_grads.items()} == {k: v.dtype for k, v in reference.param_grads.items()}
    assert all(v.dtype == dtype for v in got.param_grads.values()), what
    assert len(ref_blocks) == len(blocks(model)), f"{what}: some block never ran"
    assert got_blocks == ref_blocks, f"{what}: block output dtypes differ"
    # Not only the dtypes: on the CPU the low-precision values are the unpatched ones, bit for bit.
    assert_same_step(reference, got, what=what)


# -- dropout in recomputed regions ---------------------------------------------------------------

DROPOUT_CONFIGS = ["torch", "torch-ffn", "torch-interval2", "torch-stride3", "unsloth", "unsloth-interval2-stride4"]


def with_dropout(case: Case, p: float = 0.25) -> nn.Module:
    """The tiny model in train mode with dropout inside every block: its own ``nn.Dropout``
    modules turned on, and a dropout hook on each block's first Linear (Flux's single blocks have
    no dropout module of their own), so every recomputed region draws random numbers."""
    model = build(case).train()
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = p
    for _, b in blocks(model):
        first = next(m for m in b.modules() if isinstance(m, nn.Linear))
        first.register_forward_hook(lambda m, _a, out: F.dropout(out, p, training=m.training))
    return model


def seeded_step(model: nn.Module, case: Case, seed: int) -> Step:
    torch.manual_seed(seed)
    return step(model, case)


@pytest.mark.parametrize("name", DROPOUT_CONFIGS)
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_dropout_in_recomputed_regions_replays_same_mask(case, name):
    reference = seeded_step(with_dropout(case), case, 123)
    # the dropout is real: another seed gives other outputs
    assert not torch.equal(reference.outputs[0], seeded_step(with_dropout(case), case, 124).outputs[0])
    model = with_dropout(case)
    with patch(model, name):
        got = seeded_step(model, case, 123)
        again = seeded_step(model, case, 123)
    assert_same_step(reference, got, what=f"{case.name} {name} with dropout")
    assert_same_step(reference, again, what=f"{case.name} {name} with dropout, second step")


def test_recompute_leaves_the_global_rng_where_unpatched_leaves_it():
    """After a patched step the RNG has advanced exactly as after an unpatched one: the recompute
    draws from a forked generator, so later random numbers (the next step's noise) are the same."""
    states = []
    for patched in (False, True):
        model = with_dropout(FLUX)
        handle = patch(model, "torch-interval2") if patched else None
        seeded_step(model, FLUX, 7)
        states.append(torch.get_rng_state())
        if handle is not None:
            handle.remove()
    assert torch.equal(states[0], states[1])
