"""Threads: one patched model per thread trains exactly as alone; one patched model serves
inference (``torch.no_grad()``) from several threads at once.

gradseam's per-call state is thread-local (the region depth in ``strategies``, the seam call
stacks in ``seams``); a chain's state and an offload engine belong to one model, so models in
different threads share nothing mutable. Training one model from two threads at once is not
supported (as with plain PyTorch: the threads would share ``.grad``) and is not tested here.
"""

from __future__ import annotations

import threading

import pytest
import torch
from cases import FLUX, WAN
from torch import nn

import gradseam
from gradseam.offload import cpu_test_mode
from gradseam.testing import Case, Step, assert_same_step, run_step

ON = {"gradient_checkpointing": True}
TORCH_INTERVAL2 = {**ON, "gradient_checkpointing_interval": 2}
TORCH_FFN = {**ON, "gradient_checkpointing_backend": "torch-ffn"}
UNSLOTH = {**ON, "gradient_checkpointing_backend": "unsloth"}
ATTENTION = {**ON, "gradient_checkpointing_backend": "torch-ffn", "gradient_checkpointing_offload_attention": True}
STEPS = 10

# Two jobs run side by side: (case, config). Different families and the same family twice.
PAIRS = {
    "flux-interval2+wan-unsloth": ((FLUX, TORCH_INTERVAL2), (WAN, UNSLOTH)),
    "flux-unsloth+flux-ffn-attention": ((FLUX, UNSLOTH), (FLUX, ATTENTION)),
    "wan-ffn+wan-interval2": ((WAN, TORCH_FFN), (WAN, TORCH_INTERVAL2)),
}


def build(case: Case) -> nn.Module:
    torch.manual_seed(case.seed)
    return case.build()


def step(model: nn.Module, case: Case, seed: int) -> Step:
    return run_step(model, case, seed=seed, count_bytes=False)  # the kit's step, without extra hooks


def train(model: nn.Module, case: Case, barrier: threading.Barrier | None = None) -> list[Step]:
    """``STEPS`` steps with an SGD update between them, so every step sees new weights."""
    steps = []
    for s in range(STEPS):
        if barrier is not None:
            barrier.wait(timeout=60)  # both threads start each step together
        steps.append(step(model, case, seed=s))
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p.sub_(0.05 * p.grad)
    return steps


def run_threads(jobs: list) -> list:
    """Run each zero-argument callable in its own thread; re-raise the first failure."""
    results: list = [None] * len(jobs)
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            results[i] = jobs[i]()
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("pair", list(PAIRS))
def test_one_model_per_thread_trains_exactly_as_alone(pair):
    jobs = PAIRS[pair]
    # Alone: each job on its own, one after the other; the unpatched model gives the same bits.
    alone = []
    for case, config in jobs:
        model = build(case)
        with cpu_test_mode():
            handle = gradseam.patch(model, config)
        alone.append(train(model, case))
        handle.remove()
    reference = train(build(jobs[0][0]), jobs[0][0])
    for s, (a, b) in enumerate(zip(reference, alone[0])):
        assert_same_step(a, b, what=f"{pair}: alone vs unpatched, step {s}")

    # Together: fresh models, both threads inside every step at the same time.
    models = [build(case) for case, _ in jobs]
    with cpu_test_mode():  # a module-level stack: entered here, around both threads
        handles = [gradseam.patch(m, config) for m, (_, config) in zip(models, jobs)]
        barrier = threading.Barrier(len(jobs))
        together = run_threads(
            [lambda m=m, c=c: train(m, c, barrier) for m, (c, _) in zip(models, jobs)]
        )
    for j, (case, _) in enumerate(jobs):
        for s, (a, b) in enumerate(zip(alone[j], together[j])):
            assert_same_step(a, b, what=f"{pair}: job {j} ({case.name}) threaded vs alone, step {s}")
        engine = handles[j].engine
        if engine is not None:
            assert engine.copies > 0 and engine.store.checked_out == 0, f"{pair}: job {j} engine state"
    for h in handles:
        h.remove()


INFERENCE = {"torch-interval2": TORCH_INTERVAL2, "unsloth": UNSLOTH, "ffn-attention": ATTENTION}


@pytest.mark.parametrize("name", list(INFERENCE))
@pytest.mark.parametrize("case", [FLUX, WAN], ids=["flux", "wan"])
def test_one_model_serves_inference_from_two_threads(case, name):
    seeds = list(range(12))
    model = build(case)
    with torch.no_grad():
        expected = [case.output(model(**case.inputs(torch.Generator().manual_seed(s)))) for s in seeds]
    with cpu_test_mode():
        handle = gradseam.patch(model, INFERENCE[name])
    barrier = threading.Barrier(2)

    def serve(mine: list[int]) -> dict[int, torch.Tensor]:
        out = {}
        with torch.no_grad():  # grad mode is per thread: each thread enters it itself
            for s in mine:
                barrier.wait(timeout=60)
                out[s] = case.output(model(**case.inputs(torch.Generator().manual_seed(s))))
        return out

    try:
        got = run_threads([lambda: serve(seeds[0::2]), lambda: serve(seeds[1::2])])
    finally:
        handle.remove()
    merged = {**got[0], **got[1]}
    for s in seeds:
        assert torch.equal(expected[s], merged[s]), f"{case.name} {name}: seed {s} differs when served from two threads"
    if handle.engine is not None:
        assert handle.engine.copies == 0, "inference offloaded something"
