"""Weight streaming on a CUDA GPU (run with ``pytest -m cuda``): a model built on the CPU, patched, then moved
to the GPU keeps its streamed weights in pinned host memory, so the GPU holds only the rest; a LoRA step
matches the resident model within the GPU's own run-to-run spread, with each block's weights copied on the
copy stream one block ahead (at most two blocks' weights on the GPU); ``remove()`` brings the weights to the
GPU. How much of the copy the compute hides is measured by ``gradseam bench`` (docs/benchmarks.md)."""

from __future__ import annotations

import pytest
from cases import WAN
from test_gpu import _deterministic, _on_cuda, _spread  # noqa: F401  (the fixture applies here too)
from test_weight_streaming import LORA, ON, STREAM

import gradseam
from gradseam.testing import assert_same_step, run_step

pytestmark = pytest.mark.cuda


def _resident(case):
    """The case on the GPU, its unpatched step, and the GPU's own spread between two runs of that step."""
    gpu = _on_cuda(case)
    reference = gpu.fresh()
    want = run_step(reference, gpu, count_bytes=False)
    return gpu, want, _spread(want, run_step(reference, gpu, count_bytes=False))



@pytest.mark.parametrize("backend", ["torch", "unsloth", "unsloth-compile"])
def test_gpu_streamed_weights_stay_in_pinned_host_memory_and_train_exactly(backend):
    pytest.importorskip("peft")
    gpu, want, spread = _resident(LORA[WAN.name])
    model = LORA[WAN.name].fresh()  # on the CPU: patched before it moves, as a model too large for the card
    handle = gradseam.patch(model, {**ON, "gradient_checkpointing_backend": backend, STREAM: "all"})
    try:
        streamed = [e for b in handle.weights.blocks for e in b.tensors]
        model.to("cuda")
        assert all(e.tensor.device.type == "cpu" and e.host.is_pinned() for e in streamed)
        assert handle.weights.pinned_bytes == handle.weights.host_bytes > 0
        from gradseam.offload.pinned import pinned_bytes

        assert pinned_bytes() >= handle.weights.pinned_bytes, "the process's pinned count holds the weights' buffers"
        for _ in range(2):
            got = run_step(model, gpu, count_bytes=False)
            assert_same_step(want, got, atol=max(1e-5, 4 * spread), what=f"streamed {backend}")
        assert all(e.tensor.device.type == "cpu" for e in streamed), "released after the step"
        assert handle.weights._copy_stream is not None, "the copies ran on the copy stream"
        assert handle.weights.most_loaded == 1 + handle.weights.prefetch
    finally:
        handle.remove()
    assert all(e.tensor.device.type == "cuda" for e in streamed), "remove() puts them where the model is"


def test_gpu_a_lora_added_after_patching_is_named_until_the_model_moves_again():
    """PEFT makes a LoRA where its base layer's weight is: in host memory, for a streamed block. The block's
    next load names it and the fix; after ``model.to("cuda")`` the LoRA is on the GPU and the step runs."""
    pytest.importorskip("peft")
    from test_weight_streaming import _lora

    from gradseam.errors import UnsupportedStrategyError

    gpu = _on_cuda(LORA[WAN.name])
    model = WAN.fresh().requires_grad_(False)
    with gradseam.patch(model, {**ON, STREAM: 1}):
        model.to("cuda")
        _lora(model)  # after patching: the streamed block's LoRA lands in host memory
        with pytest.raises(UnsupportedStrategyError, match=r"lora_A.*is on cpu.*Call model.to\(...\) once more"):
            run_step(model, gpu, count_bytes=False)
        model.to("cuda")
        run_step(model, gpu, count_bytes=False)


def test_gpu_streaming_without_expandable_segments_warns_once_naming_the_setting(monkeypatch):
    """Read from the environment at the first load, as the allocator cannot change once CUDA is in use."""
    import warnings

    from gradseam.offload import weights as weights_module

    monkeypatch.setattr(weights_module, "expandable_segments", lambda: False)
    weights_module._warned.discard(weights_module.FRAGMENTATION)
    model = LORA[WAN.name].fresh()
    gpu = _on_cuda(LORA[WAN.name])
    with gradseam.patch(model, {**ON, "gradient_checkpointing_backend": "torch", STREAM: "all"}):
        model.to("cuda")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run_step(model, gpu, count_bytes=False)
            run_step(model, gpu, count_bytes=False)
    said = [w for w in caught if "expandable_segments:True" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]


def test_gpu_dit_streams_block_0_and_its_call_after_the_loop_finds_the_weights_on_the_gpu():
    """DiT's forward calls transformer_blocks[0].norm1.emb after the loop: streamed whole, block 0 would hand that
    call host weights and the forward would stop with a device mismatch. Declared (``called_outside``), that
    submodule stays on the GPU, every block streams the rest, and the step matches the resident model."""
    from test_family_dit import FROZEN

    gpu, want, spread = _resident(FROZEN)
    model = FROZEN.fresh()  # on the CPU: patched, then moved
    with gradseam.patch(model, {**ON, STREAM: "all"}) as handle:
        model.to("cuda")
        emb = model.transformer_blocks[0].norm1.emb
        assert all(p.device.type == "cuda" for p in emb.parameters())
        assert all(e.tensor.device.type == "cpu" for b in handle.weights.blocks for e in b.tensors)
        got = run_step(model, gpu, count_bytes=False)
        assert_same_step(want, got, atol=max(1e-5, 4 * spread), what="DiT, every block streamed")


def test_gpu_re_patching_a_streamed_model_keeps_its_weights_in_the_same_pinned_memory():
    """A second patch that streams too takes the first one's pinned host copies: nothing streamed comes onto the GPU
    while it replaces the first (a model larger than its card could not), no second copy is pinned, and the step
    still matches the resident model."""
    pytest.importorskip("peft")
    import torch

    from gradseam.offload.pinned import pinned_bytes

    gpu, want, spread = _resident(LORA[WAN.name])
    model = LORA[WAN.name].fresh()
    first = gradseam.patch(model, {**ON, STREAM: "all"})
    model.to("cuda")
    pinned, streamed = pinned_bytes(), first.weights.host_bytes
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    resident = torch.cuda.memory_allocated()
    with gradseam.patch(model, {**ON, "gradient_checkpointing_backend": "unsloth", STREAM: "all"}) as second:
        assert torch.cuda.max_memory_allocated() - resident < streamed / 4, "streamed weights came onto the GPU"
        assert pinned_bytes() == pinned and second.weights.pinned_bytes == streamed
        got = run_step(model, gpu, count_bytes=False)
        assert_same_step(want, got, atol=max(1e-5, 4 * spread), what="re-patched, streamed")
    assert pinned - pinned_bytes() >= streamed, "the handed-over pinned memory was not freed on remove()"


def test_gpu_a_measuring_patch_over_a_set_aside_stream_leaves_the_weights_in_host_memory():
    """What ``auto`` does at the first step of a model larger than its card (streamed from patch time): the stream
    steps aside, its weights parked in host memory, and each candidate is a patch of its own streaming the blocks it
    keeps. Removed, that patch leaves the weights in host memory, where it found them. It used to bring them onto the
    GPU (where the model computes), which on Wan 2.1 14B at 24 GiB ran out of memory beside the activations of a
    candidate that had just run out itself, and every later candidate found the card full (issue 41)."""
    pytest.importorskip("peft")

    gpu, want, spread = _resident(LORA[WAN.name])
    model = LORA[WAN.name].fresh()
    outer = gradseam.patch(model, {**ON, STREAM: "all"})
    try:
        model.to("cuda")
        outer.active = False  # as auto's first step: the measuring patches do not replace this one
        try:
            with outer.set_aside():
                with gradseam.patch(model, {**ON, "gradient_checkpointing_backend": "unsloth", STREAM: "all"}) as one:
                    run_step(model, gpu, count_bytes=False)
                    tensors = [e.tensor for b in one.weights.blocks for e in b.tensors]
                # (by device, not by the allocator's count: this model's weights are 68 KB, less than what a first
                # step's workspaces add, ~1 MiB on an H100)
                assert tensors and all(t.device.type == "cpu" for t in tensors), "remove() moved them to the GPU"
        finally:
            outer.active = True
        got = run_step(model, gpu, count_bytes=False)
        assert_same_step(want, got, atol=max(1e-5, 4 * spread), what="streamed again after the measuring patch")
    finally:
        outer.remove()


def test_gpu_moving_a_streamed_model_to_the_dtype_it_has_keeps_loading_onto_the_gpu():
    """Trainers call ``model.to(dtype=weight_dtype)`` on a model already in that dtype. ``.to(dtype)`` keeps each
    tensor's device, so the stream's device stays the GPU: read as a move to the CPU, every block ran with its
    weights in host memory (a device mismatch in the first block)."""
    pytest.importorskip("peft")

    gpu, want, spread = _resident(LORA[WAN.name])
    model = LORA[WAN.name].fresh()
    with gradseam.patch(model, {**ON, STREAM: "all"}) as handle:
        model.to("cuda")
        model.to(next(model.parameters()).dtype)
        assert handle.weights.device.type == "cuda"
        got = run_step(model, gpu, count_bytes=False)
        assert_same_step(want, got, atol=max(1e-5, 4 * spread), what="streamed, after .to(its own dtype)")
        streamed = [e for b in handle.weights.blocks for e in b.tensors]
    assert all(e.tensor.device.type == "cuda" for e in streamed), "remove() puts them where the model is"
