"""Weight streaming (issue 40, first part), on the CPU through the engine's test mode: the frozen weights of the
chosen blocks live in host memory between calls and are copied in for each block's forward, recompute and
backward (:mod:`gradseam.offload.weights`).

A LoRA over streamed blocks trains exactly as over resident ones with every backend; every use of a streamed
weight happens while its block is loaded (checked by poisoning a released weight), also through gradient
accumulation, retained graphs and sampling forwards in the middle of a step; the host copies are what
``state_dict()`` and ``model.to()`` see; ``remove()`` puts the weights back; each refusal names its fix.
"""

from __future__ import annotations

import math
import re
import warnings

import pytest
import torch
from cases import FLUX, WAN

import gradseam
from gradseam.errors import UnsupportedStrategyError
from gradseam.offload import cpu_test_mode
from gradseam.offload import weights as weights_module
from gradseam.testing import Case, assert_same_step, check_strategy, config_id, run_step

STREAM = "gradient_checkpointing_stream_weights"
ON = {"gradient_checkpointing": True}
ROWS = [
    {**ON, "gradient_checkpointing_backend": "torch"},
    {**ON, "gradient_checkpointing_backend": "torch-ffn"},
    {**ON, "gradient_checkpointing_backend": "unsloth"},
    {**ON, "gradient_checkpointing_backend": "unsloth", "gradient_checkpointing_offload_attention": True},
    {**ON, "gradient_checkpointing_backend": "torch", "gradient_checkpointing_keep_attention": True},
    {**ON, "gradient_checkpointing_backend": "torch", "gradient_checkpointing_segment_stride": 2},
    {**ON, "gradient_checkpointing_backend": "compile"},
    {**ON, "gradient_checkpointing_backend": "unsloth-compile"},
]


def _lora(model: torch.nn.Module) -> torch.nn.Module:
    """A frozen base with a peft LoRA on the attention projections (non-zero B: it changes the outputs)."""
    import peft

    model.requires_grad_(False)
    model.add_adapter(peft.LoraConfig(r=2, lora_alpha=2, target_modules=["to_q", "to_v"], init_lora_weights=False))
    return model


def lora_case(case: Case) -> Case:
    return Case(f"{case.name}+lora", lambda: _lora(case.build()), case.inputs, case.output, case.seed)


LORA = {case.name: lora_case(case) for case in (FLUX, WAN)}


def _streamed(model: torch.nn.Module, handle) -> list[torch.nn.Parameter]:
    return [e.tensor for block in handle.weights.blocks for e in block.tensors]


# Compiled rows on Flux another row covers, run under `-m compiled` only (pyproject.toml deselects the mark by
# default): both compiled backends run one compiled function per block (gradseam.run.compiled), unsloth-compile only
# adds the offload group around its call, so flux-unsloth-compile-1 runs Flux's compiled blocks over streamed
# weights (streamed and resident blocks side by side); each backend and stream is also its wan-... row.
COVERED_COMPILED_ROWS = {("flux", "compile", "all"), ("flux", "compile", 1), ("flux", "unsloth-compile", "all")}


def _lora_rows() -> list:
    params = []
    for case in (FLUX, WAN):
        for config in ROWS:
            for stream in ("all", 1):
                covered = (case.name, config["gradient_checkpointing_backend"], stream) in COVERED_COMPILED_ROWS
                params.append(pytest.param(case, config, stream, id=f"{case.name}-{config_id(config)}-{stream}",
                                           marks=[pytest.mark.compiled] if covered else []))
    return params


@pytest.mark.parametrize(("case", "config", "stream"), _lora_rows())
def test_a_lora_over_streamed_weights_trains_exactly_as_over_resident_ones(case, config, stream):
    pytest.importorskip("peft")
    with cpu_test_mode():
        check_strategy(LORA[case.name], {**config, STREAM: stream})


def poison_releases(monkeypatch: pytest.MonkeyPatch) -> None:
    """From now on a released streamed weight is poisoned (NaN) instead of pointing at its host copy: a forward,
    recompute or backward that used a weight outside its block's load then gives NaN, not the unpatched result."""
    real_release = weights_module.WeightStream.release

    def poisoning(self, index):
        block = self.blocks[index]
        was_loaded = block.loaded
        real_release(self, index)
        if was_loaded:
            for entry in block.tensors:
                entry.tensor.data = torch.full_like(entry.host, math.nan)

    monkeypatch.setattr(weights_module.WeightStream, "release", poisoning)


@pytest.mark.parametrize("config", [ROWS[0], ROWS[2], ROWS[7]], ids=config_id)
def test_every_use_of_a_streamed_weight_happens_while_its_block_is_loaded(config, monkeypatch):
    """With released weights poisoned, a LoRA step over streamed weights is the unpatched one."""
    pytest.importorskip("peft")
    case = LORA[WAN.name]
    want = run_step(case.fresh(), case)
    poison_releases(monkeypatch)
    model = case.fresh()
    with cpu_test_mode(), gradseam.patch(model, {**config, STREAM: "all"}) as handle:
        got = run_step(model, case, count_bytes=False)
        assert handle.weights.loads == 2 * len(handle.weights.blocks), "one load for forward, one for backward"
    assert_same_step(want, got, atol=1e-5 if "compile" in config_id(config) else 0.0, what=config_id(config))


def _accumulated(model: torch.nn.Module, case: Case) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Gradient accumulation as trainers write it in one backward: two forwards, then the summed loss."""
    outs = [case.output(model(**case.inputs(torch.Generator().manual_seed(seed)))) for seed in (1, 2)]
    loss = sum(out.square().mean() for out in outs)
    loss.backward()
    return loss.detach(), _grads(model)


def _retained(model: torch.nn.Module, case: Case) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward, two backwards through the retained graph (the gradients add up)."""
    loss = case.output(model(**case.inputs(torch.Generator().manual_seed(1)))).square().mean()
    loss.backward(retain_graph=True)
    loss.backward()
    return loss.detach(), _grads(model)


def _validated_between(model: torch.nn.Module, case: Case) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A sampling forward without gradients before the step, and one between its forward and its backward."""
    with torch.no_grad():
        before = case.output(model(**case.inputs(torch.Generator().manual_seed(3))))
    out = case.output(model(**case.inputs(torch.Generator().manual_seed(1))))
    with torch.no_grad():
        between = case.output(model(**case.inputs(torch.Generator().manual_seed(4))))
    loss = out.square().mean()
    loss.backward()
    return torch.stack([before.sum(), between.sum(), loss.detach()]), _grads(model)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("use", [_accumulated, _retained, _validated_between], ids=lambda f: f.__name__[1:])
@pytest.mark.parametrize("backend", ["torch-ffn", "unsloth"])
def test_accumulation_retained_graphs_and_sampling_between_steps_stream_exactly(use, backend, monkeypatch):
    """Two forwards before one backward (each forward starts by releasing what the last one left loaded), two
    backwards through one graph, and forwards without gradients in the middle of a step: every block's weights
    streamed, released weights poisoned, the losses, outputs and every gradient bitwise the unpatched model's."""
    pytest.importorskip("peft")
    case = LORA[WAN.name]
    want_values, want_grads = use(case.fresh(), case)
    poison_releases(monkeypatch)
    model = case.fresh()
    with cpu_test_mode(), gradseam.patch(model, {**ON, "gradient_checkpointing_backend": backend, STREAM: "all"}):
        values, grads = use(model, case)
    assert torch.equal(values, want_values), (values, want_values)
    assert grads.keys() == want_grads.keys() and all(torch.equal(grads[n], want_grads[n]) for n in grads), \
        [n for n in grads if not torch.equal(grads[n], want_grads[n])]


def test_re_patching_a_streamed_model_hands_its_host_copies_to_the_new_patch(monkeypatch):
    """A second ``patch()`` replaces the first; when both stream, the new stream takes the blocks they share with
    their host copies as they are (the same memory), so a model larger than its GPU never has to come back there
    while it is re-patched, nor sit in host memory twice. A block the new patch no longer streams goes back to the
    model's device; a third patch without streaming brings everything back, and each step is the unpatched one."""
    pytest.importorskip("peft")
    case = LORA[WAN.name]
    want = run_step(case.fresh(), case)
    poison_releases(monkeypatch)
    model = case.fresh()

    def hosts(handle) -> dict[int, int]:
        return {id(e.tensor): e.host.data_ptr() for b in handle.weights.blocks for e in b.tensors}

    with cpu_test_mode():
        first = gradseam.patch(model, {**ON, STREAM: "all"})
        before = hosts(first)
        second = gradseam.patch(model, {**ON, "gradient_checkpointing_backend": "unsloth", STREAM: "all"})
        assert first.weights is None and hosts(second) == before, "the host copies were not handed over as they are"
        assert all(p.data_ptr() == before[id(p)] for p in _streamed(model, second)), "a weight left host memory"
        assert_same_step(want, run_step(model, case), what="re-patched, every block streamed")
        third = gradseam.patch(model, {**ON, STREAM: 1})
        kept = hosts(third)
        assert len(kept) < len(before) and all(before[t] == ptr for t, ptr in kept.items())
        back = [p for p in model.parameters() if id(p) in before and id(p) not in kept]
        assert back and all(p.data_ptr() != before[id(p)] for p in back), "a block no longer streamed stayed on the host"
        assert_same_step(want, run_step(model, case), what="re-patched, one block streamed")
        fourth = gradseam.patch(model, ON)
        assert fourth.weights is None and all(p.data_ptr() != before[id(p)] for p in model.parameters() if id(p) in before)
        assert_same_step(want, run_step(model, case), what="re-patched without streaming")
        fourth.remove()
    assert_same_step(want, run_step(model, case), what="removed")


def test_a_state_dict_of_blocks_mixing_dtypes_saves_and_loads_while_streamed(tmp_path):
    """diffusers loads Wan in bf16 with its norms and modulation tables kept in fp32, so one block's host copies mix
    dtypes. Each dtype has a host buffer of its own: ``torch.save`` refuses views of one storage in two dtypes, and
    a checkpoint saved mid-training would fail. Saved with torch and with safetensors, the values load back."""
    from safetensors.torch import load_file, save_file

    model = WAN.fresh().requires_grad_(False)
    for name, p in model.named_parameters():
        p.data = p.data.to(torch.float32 if "norm" in name or "scale_shift" in name else torch.bfloat16)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    assert len({v.dtype for v in want.values()}) == 2
    with cpu_test_mode(), gradseam.patch(model, {**ON, STREAM: "all"}) as handle:
        assert any(len(b.buffers) == 2 for b in handle.weights.blocks)
        torch.save(model.state_dict(), tmp_path / "model.pt")
        save_file(model.state_dict(), str(tmp_path / "model.safetensors"))
    for loaded in (torch.load(tmp_path / "model.pt"), load_file(str(tmp_path / "model.safetensors"))):
        assert loaded.keys() == want.keys() and all(torch.equal(loaded[k], want[k]) for k in want)


def test_a_streamed_model_deep_copied_or_pickled_streams_its_own_weights(monkeypatch, tmp_path):
    """``copy.deepcopy`` (an EMA copy) and ``torch.save`` of a whole streamed model carry the stream over: the copy's
    hooks load the copy's blocks from the copy's host memory (its own, plain, never counted as pinned), each copy
    steps exactly with released weights poisoned, and ``remove()`` on each restores each."""
    import copy

    pytest.importorskip("peft")
    case = LORA[WAN.name]
    want = run_step(case.fresh(), case)
    poison_releases(monkeypatch)
    model = case.fresh()
    with cpu_test_mode():
        handle = gradseam.patch(model, {**ON, STREAM: "all"})
        run_step(model, case)
        twin = copy.deepcopy(model)
        torch.save(model, tmp_path / "model.pt")
        loaded = torch.load(tmp_path / "model.pt", weights_only=False)
        for other in (twin, loaded):
            stream = gradseam.handle_of(other).weights
            assert stream is not handle.weights and [b.module for b in stream.blocks] == list(other.blocks)
            assert stream.pinned_bytes == 0 and stream.host_bytes == handle.weights.host_bytes
            mine = {e.host.data_ptr() for b in stream.blocks for e in b.tensors}
            assert not mine & {e.host.data_ptr() for b in handle.weights.blocks for e in b.tensors}
            assert_same_step(want, run_step(other, case), what="a copy of the streamed model")
        assert_same_step(want, run_step(model, case), what="the original after the copies ran")
        for other in (twin, loaded, model):
            gradseam.handle_of(other).remove()
            assert_same_step(want, run_step(other, case), what="removed")


@pytest.mark.parametrize(("config", "freed"), [
    (ROWS[0], True), (ROWS[2], True), (ROWS[6], True), (ROWS[7], True),
    (ROWS[1], False), (ROWS[5], False),
], ids=lambda v: config_id(v) if isinstance(v, dict) else str(v))
def test_which_backends_free_each_blocks_weights_after_its_forward(config, freed, monkeypatch):
    """What streaming saves: after the forward, is any block's loaded copy still held (by autograd, for
    backward)? Whole-block regions recompute everything and compiled blocks save the parameters themselves
    (reloaded for backward): nothing is held. ``torch-ffn`` keeps attention's outputs, so autograd holds its
    weights' copies; a stride leaves blocks unrecomputed, which hold theirs (docs/strategies.md)."""
    pytest.importorskip("peft")
    copies = []
    real_load = weights_module.WeightStream.load

    def recording(self, index, **how):
        fresh = not self.blocks[index].loaded
        real_load(self, index, **how)
        if fresh:
            copies.extend(e.tensor.untyped_storage()._weak_ref() for e in self.blocks[index].tensors)

    monkeypatch.setattr(weights_module.WeightStream, "load", recording)
    case = LORA[WAN.name]
    model = case.fresh()
    with cpu_test_mode(), gradseam.patch(model, {**config, STREAM: "all"}):
        out = case.output(model(**case.inputs(torch.Generator().manual_seed(1))))
        gradseam.handle_of(model).weights.release_all()  # the last block's copy, loaded ahead for backward
        held = sum(not torch.UntypedStorage._expired(ref) for ref in copies)
        del out
    assert copies and (held == 0) == freed, f"{held} of {len(copies)} loaded copies held after the forward"


def test_streamed_weights_are_host_copies_between_calls_and_fresh_copies_inside_their_block():
    pytest.importorskip("peft")
    case = LORA[WAN.name]
    model = case.fresh()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    resident = model.blocks[2].ffn.net[2].weight
    resident_ptr = resident.data_ptr()
    seen = []
    with cpu_test_mode(), gradseam.patch(model, {**ON, STREAM: 2}) as handle:
        block = model.blocks[1]  # 2 of the 5 blocks stream, spread: blocks 1 and 3
        weight = block.ffn.net[2].weight
        host = next(e.host for b in handle.weights.blocks for e in b.tensors if e.tensor is weight)
        assert weight.data_ptr() == host.data_ptr(), "between calls a streamed weight is its host copy"
        hook = block.register_forward_pre_hook(lambda m, a: seen.append(weight.data_ptr()))  # after the load
        run_step(model, case, count_bytes=False)
        hook.remove()
        assert seen and all(p != host.data_ptr() for p in seen), "inside its block a streamed weight is a copy"
        assert weight.data_ptr() == host.data_ptr() and not any(b.loaded for b in handle.weights.blocks)
        assert resident.data_ptr() == resident_ptr, "a block between the streamed ones keeps its weights"
        assert all(not p.requires_grad for p in _streamed(model, handle)), "only frozen tensors stream"
        assert not any("lora" in e.name for b in handle.weights.blocks for e in b.tensors), "the LoRA stays"
        state = model.state_dict()
        assert list(state) == list(before) and all(torch.equal(state[k], before[k]) for k in before)
        model.to(torch.device("cpu"))  # moving the model leaves the streamed weights where they are
        assert weight.data_ptr() == host.data_ptr()
        summary = str(handle.summary())
        assert "weights of 2 block(s) stream from host memory (blocks 1, 3)" in summary
        assert "4 block loads so far" in summary
        assert "1 block ahead on a side stream" in summary
        assert "Pinned host memory now: weights 0.00 GiB, offloaded activations 0.00 GiB" in summary  # test mode
    assert weight.data_ptr() != host.data_ptr() and "_apply" not in block.ffn.net[2].__dict__
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


class _NoRoom(torch.Tensor):
    """A host copy whose copy back runs out of memory, as on a GPU still full of a failed step's activations."""

    def to(self, *args, **kwargs):  # noqa: ANN002, ANN003
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 50.00 MiB.")


def test_remove_that_runs_out_of_memory_changes_nothing_and_can_be_called_again():
    # Every copy back is made before anything changes: the model still streams and trains exactly, the error says
    # how much would come back and what to free, and a second remove() restores the original model.
    pytest.importorskip("peft")
    case = LORA[WAN.name]
    want = run_step(case.fresh(), case, count_bytes=False)
    model = case.fresh()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with cpu_test_mode():
        handle = gradseam.patch(model, {**ON, STREAM: "all"})
        last = handle.weights.blocks[-1].tensors[-1]
        host = last.host
        last.host = host.as_subclass(_NoRoom)
        with pytest.raises(torch.OutOfMemoryError, match=r"remove\(\) could not bring the streamed weights \(0\.00 GiB\) "
                           r"back .*Nothing changed: the weights still stream\. Free GPU memory"):
            handle.remove()
        assert handle.active and handle.weights is not None
        assert all(e.tensor.data_ptr() == e.host.data_ptr() for b in handle.weights.blocks for e in b.tensors)
        last.host = host
        assert_same_step(want, run_step(model, case, count_bytes=False), what="streamed, after a failed remove()")
        handle.remove()
    assert not handle.active and all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_dtype_change_of_streamed_weights_after_patching_is_refused_by_name():
    pytest.importorskip("peft")
    model = LORA[WAN.name].fresh()
    dtype = r"streams from host memory in torch.float32; changing it to torch.float64"
    with cpu_test_mode(), gradseam.patch(model, {**ON, STREAM: 1}), pytest.raises(TypeError, match=dtype):
        model.to(torch.float64)


@pytest.mark.parametrize(("config", "words"), [
    ({"gradient_checkpointing": False, STREAM: 1}, "needs checkpointing"),
    ({**ON, "gradient_checkpointing_interval": 2, STREAM: 1}, "Remove the interval"),
    ({**ON, STREAM: 99}, "Stream at most 5"),
], ids=["no-checkpointing", "interval", "too-many"])
def test_what_cannot_stream_is_refused_naming_the_fix(config, words):
    pytest.importorskip("peft")
    model = LORA[WAN.name].fresh()
    with cpu_test_mode(), pytest.raises(UnsupportedStrategyError, match=words):
        gradseam.patch(model, config)
    assert gradseam.handle_of(model) is None


def test_a_full_fine_tune_has_nothing_to_stream_when_streaming_starts():
    model = WAN.fresh()  # every parameter trains: as if patched while loading, before the base is frozen
    with cpu_test_mode(), gradseam.patch(model, {**ON, STREAM: "all"}) as handle:
        assert not handle.weights.selected and "once the base is frozen" in str(handle.summary())
        with pytest.raises(UnsupportedStrategyError) as refused:
            run_step(model, WAN)
    message = str(refused.value)
    assert "blocks[0] has no frozen weight to stream" in message and "requires_grad=True" in message
    assert "unsloth-compile" in message  # what to do instead


def test_a_model_patched_as_it_loads_streams_once_its_base_is_frozen():
    """Load-time patching (``gradseam.patching``, ``gradseam run``): the model arrives with every parameter
    trainable; the trainer freezes it and adds a LoRA afterwards. Streaming starts at the first forward, with
    what is frozen then, and the step is the resident model's."""
    pytest.importorskip("peft")
    case = LORA[WAN.name]
    want = run_step(case.fresh(), case)
    torch.manual_seed(case.seed)
    model = WAN.build()
    with cpu_test_mode(), gradseam.patch(model, {**ON, STREAM: "all"}) as handle:
        assert not handle.weights.selected
        _lora(model)
        got = run_step(model, case, count_bytes=False)
        assert handle.weights.selected and handle.weights.host_bytes > 0
        assert not any("lora" in e.name for b in handle.weights.blocks for e in b.tensors)
    assert_same_step(want, got)


def test_a_streamed_weight_that_starts_training_is_refused_at_its_next_load():
    pytest.importorskip("peft")
    case = LORA[WAN.name]
    model = case.fresh()
    with cpu_test_mode(), gradseam.patch(model, {**ON, STREAM: 1}) as handle:
        (streamed,) = handle.weights.blocks
        index = list(model.blocks).index(streamed.module)
        model.blocks[index].ffn.net[2].weight.requires_grad_(True)
        with pytest.raises(UnsupportedStrategyError, match=rf"blocks\[{index}\]\.ffn\.net\.2\.weight trains now"):
            run_step(model, case)


def test_quantized_weights_are_refused_by_type():
    from gradseam.testing.quantized import quantized_case, unavailable

    if unavailable("torchao-int8"):
        pytest.skip(unavailable("torchao-int8"))
    model = quantized_case(WAN, "torchao-int8", train=_lora).fresh()
    with cpu_test_mode(), pytest.raises(UnsupportedStrategyError, match=r"is a Int8Tensor \(a quantized weight\)"):
        gradseam.patch(model, {**ON, STREAM: 1})


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("stream, room, words", [
    (1, "two blocks", r"streams the frozen weights of 1 of its 5 blocks \(gradient_checkpointing_stream_weights=1\), "
        r"which leaves 0.00 GiB of its 0.00 GiB of weights and buffers for the GPU, more than the 0.00 GiB this "
        r"process may allocate on its CUDA device: moving it there will run out of memory before a step runs\. Stream "
        r"more blocks \(\"all\" leaves 0.00 GiB there\), or let gradient_checkpointing_backend \"auto\" choose"),
    (3, "two blocks", None),
    ("all", "nothing", r"of 5 of its 5 blocks .*Even with every block's streamed that much stays: quantize the base, "
        r"or use a larger GPU\."),
])
def test_a_stream_count_that_leaves_more_on_the_gpu_than_it_holds_warns_at_patch_time(stream, room, words, monkeypatch):
    """A model on the CPU streaming too few blocks' weights for its GPU would run out of memory as it moves there,
    before a step, with an error from deep in Module.to: said at patch time, with the key and the fix. The GPU here
    holds everything but two blocks' frozen weights (or not even what stays with every block streamed)."""
    import gradseam.patcher

    model = WAN.fresh().requires_grad_(False)
    model.proj_out.requires_grad_(True)
    total = _bytes([*model.parameters(), *model.buffers()])
    outside = total - _bytes(p for block in model.blocks for p in block.parameters())
    limit = total - 2 * _bytes(model.blocks[0].parameters()) if room == "two blocks" else outside - 1
    monkeypatch.setattr(gradseam.patcher, "gpu_limit_bytes", lambda: limit)
    with warnings.catch_warnings(record=True) as caught, cpu_test_mode():
        warnings.simplefilter("always")
        gradseam.patch(model, {**ON, STREAM: stream}).remove()
    said = [str(w.message) for w in caught if "moving it there" in str(w.message)]
    if words is None:
        assert not said, said
    else:
        assert len(said) == 1 and re.search(words, said[0]), said


def test_a_base_not_frozen_at_patch_time_is_not_judged_then(monkeypatch):
    """Load-time patching: what streams is chosen once the base is frozen, so patch time cannot say what stays."""
    import gradseam.patcher

    monkeypatch.setattr(gradseam.patcher, "gpu_limit_bytes", lambda: 1)
    with warnings.catch_warnings(record=True) as caught, cpu_test_mode():
        warnings.simplefilter("always")
        gradseam.patch(WAN.fresh(), {**ON, STREAM: 1}).remove()
    assert not [w for w in caught if "moving it there" in str(w.message)]


def test_without_cuda_streaming_is_refused_outside_the_test_mode():
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU: tests/test_gpu_streaming.py streams there")
    model = LORA[WAN.name].fresh() if _has_peft() else WAN.fresh().requires_grad_(False)
    with pytest.raises(UnsupportedStrategyError, match="no CUDA GPU is available here"):
        gradseam.patch(model, {**ON, STREAM: 1})


def _has_peft() -> bool:
    import importlib.util

    return importlib.util.find_spec("peft") is not None


def test_pinning_past_half_the_host_memory_warns_once_for_weights_and_activations_together(monkeypatch):
    """Every pinning gradseam does (the streamed weights', the activation pools') goes through one count, so the
    warning weighs them together, as the host feels them, and says so before the pinning that passes the share."""
    from gradseam.offload import pinned

    monkeypatch.setattr(pinned, "host_memory_bytes", lambda: 100 << 20)  # a 100 MiB "machine"
    monkeypatch.setattr(pinned, "_pinned", {"bytes": 30 << 20, "warned": False})  # 30 MiB held already
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pinned._admit(15 << 20)  # 45 MiB: under half
    with pytest.warns(RuntimeWarning, match=r"pinning 0.01 GiB more host memory brings .* to 0.1 GiB, more than "
                                            r"50% of this machine's 0.1 GiB") as caught:
        pinned._admit(10 << 20)
        pinned._admit(10 << 20)  # once per process
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "gradient_checkpointing_stream_weights" in message and "max_buckets: 0" in message
    assert pinned.pinned_bytes() == 65 << 20
    pinned._forget(65 << 20)
    assert pinned.pinned_bytes() == 0


def test_a_weight_tied_between_two_streamed_blocks_stays_where_it_is():
    """Moving one holder's ``.data`` would move a tied weight under the other block too: it does not stream."""
    pytest.importorskip("peft")

    def tied():
        model = LORA[WAN.name].build()
        model.blocks[1].ffn.net[2].weight = model.blocks[0].ffn.net[2].weight
        return model

    case = Case("wan+lora+tied", tied, WAN.inputs, WAN.output, WAN.seed)
    model = case.fresh()
    weight = model.blocks[0].ffn.net[2].weight
    pointer = weight.data_ptr()
    with cpu_test_mode(), gradseam.patch(model, {**ON, STREAM: "all"}) as handle:
        assert handle.weights.selected and all(e.tensor is not weight for b in handle.weights.blocks for e in b.tensors)
        assert weight.data_ptr() == pointer
        got = run_step(model, case, count_bytes=False)
    assert_same_step(run_step(case.fresh(), case), got)


@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("backend", ["torch", "unsloth"])
def test_the_next_blocks_weights_are_loaded_while_a_block_runs_and_no_more(backend, prefetch):
    """The copy of the block that runs next is issued while this one computes (on a GPU, on the copy stream):
    in forward the ``prefetch`` blocks after it, in backward (the recompute) the ones before it. Nothing
    else is loaded, so the GPU holds ``1 + prefetch`` blocks' weights at most."""
    pytest.importorskip("peft")
    case = LORA[WAN.name]
    model = case.fresh()
    seen: list[tuple[str, int, set[int]]] = []
    with cpu_test_mode(), gradseam.patch(model, {**ON, "gradient_checkpointing_backend": backend, STREAM: "all"}) as h:
        stream = h.weights
        stream.prefetch = prefetch
        count = len(stream.blocks)
        for i, block in enumerate(model.blocks):
            def look(module, args, i=i):
                phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
                seen.append((phase, i, {j for j, b in enumerate(stream.blocks) if b.loaded}))
            block.ffn.register_forward_pre_hook(look)  # the block's own hooks are not run again by a recompute
        run_step(model, case, count_bytes=False)
        assert not any(b.loaded for b in stream.blocks), "all released after the step"
    forward = [(i, got) for phase, i, got in seen if phase == "forward"]
    recompute = [(i, got) for phase, i, got in seen if phase == "backward"]
    assert [i for i, _ in forward] == list(range(count))
    assert sorted(i for i, _ in recompute) == list(range(count)), "every block recomputes once"
    for i, got in forward:
        assert got == set(range(i, min(i + prefetch + 1, count))), f"forward of block {i}: {got}"
    for i, got in recompute:
        assert got == set(range(max(i - prefetch, 0), i + 1)), f"recompute of block {i}: {got}"
    assert stream.most_loaded == prefetch + 1


@pytest.mark.parametrize(("count", "total", "want"), [
    (2, 8, [2, 6]), (1, 5, [2]), (3, 8, [1, 4, 6]), (5, 5, [0, 1, 2, 3, 4]), (0, 4, []),
])
def test_streamed_blocks_are_spread_evenly_each_in_the_middle_of_its_share(count, total, want):
    from gradseam.planning import spread

    assert spread(count, [1.0] * total) == want


def test_blocks_of_one_size_are_placed_as_the_even_spread_placed_them_for_every_count():
    """Placing by size changes nothing where every block has one size (Wan, and most families): each of ``count``
    equal shares' middle block, as before."""
    from gradseam.planning import spread

    for total in range(1, 41):
        for count in range(total + 1):
            assert spread(count, [0.4] * total) == [((2 * k + 1) * total) // (2 * count) for k in range(count)]


FLUX_DEV_GIB = [0.633] * 19 + [0.262] * 38  # Flux dev's double and single blocks in bf16, in forward order


@pytest.mark.parametrize("count", [20, 26, 32, 40])
def test_blocks_of_two_sizes_are_placed_with_gaps_that_grow_with_their_bytes(count):
    """A streamed block's copy overlaps the blocks run since the streamed one before it, and copies take time in
    proportion to their bytes: Flux's double blocks (2.4 times a single's bytes) get gaps about that much wider."""
    from gradseam.planning import spread

    chosen = spread(count, FLUX_DEV_GIB)
    assert len(chosen) == count and chosen == sorted(set(chosen))
    gaps = {"double": [], "single": []}
    for before, index in zip(chosen, chosen[1:]):
        gaps["double" if index < 19 else "single"].append(index - before)
    mean = {kind: sum(g) / len(g) for kind, g in gaps.items() if g}
    assert mean["double"] >= 2 * mean["single"], (chosen, mean)
    # read in steps of the largest block's size: a LoRA's few bytes on some blocks move nothing
    assert spread(count, [g * (1.001 if i % 3 else 1.0) for i, g in enumerate(FLUX_DEV_GIB)]) == chosen


def test_every_count_of_blocks_of_mixed_sizes_streams_that_many_distinct_blocks():
    from gradseam.planning import spread

    sizes = [3.0, 1.0, 1.0, 2.0, 0.5, 0.5, 0.5, 4.0, 1.0]
    for count in range(len(sizes) + 1):
        chosen = spread(count, sizes)
        assert len(chosen) == count and chosen == sorted(set(chosen)) and all(0 <= i < len(sizes) for i in chosen)


def test_the_copy_stream_model_places_flux_by_size_no_slower_for_the_memory_it_frees(capsys):
    """docs/scripts/stream_placement.py, the model behind placing by size: with its defaults (Flux dev 4k on an
    H100) it gives the even spread's stream 25 the forward the docs compare with the measured one (222 ms modelled,
    226.0 measured), and wherever the even spread frees up to 10 GiB, a by-size count that frees at least as much
    runs its forward no slower."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "docs" / "scripts" / "stream_placement.py"
    spec = importlib.util.spec_from_file_location("stream_placement", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    sizes = FLUX_DEV_GIB
    assert round(script.forward_ms(script.even(25, 57), sizes, 3.0, 49.5)) == 222
    rows = script.main([])
    assert "| streamed | even: freed GiB |" in capsys.readouterr().out
    for row in rows:
        if row["even_freed_gib"] > 10:
            continue
        match = min((r for r in rows if r["size_freed_gib"] >= row["even_freed_gib"]), key=lambda r: r["count"])
        assert match["size_forward_ms"] <= row["even_forward_ms"], (row, match)


def test_the_runtime_streams_the_blocks_the_planner_counts():
    """The planner predicts which blocks a count streams from their frozen bytes (advise.spread_blocks_gib); the
    runtime places them by all their bytes: the same blocks of a Flux whose double and single blocks differ."""
    pytest.importorskip("peft")
    from gradseam.patcher import family_for
    from gradseam.planning import spread
    from gradseam.tools.advise import frozen_block_gib

    case = LORA[FLUX.name]
    model = case.fresh()
    sizes = frozen_block_gib(model, family_for(model))
    assert len(set(round(s, 6) for s in sizes)) > 1, "the test model's blocks are all of one size"
    order = [("transformer_blocks", i) for i in range(len(model.transformer_blocks))] + \
        [("single_transformer_blocks", i) for i in range(len(model.single_transformer_blocks))]
    for count in range(1, len(order) + 1):
        with cpu_test_mode(), gradseam.patch(model, {**ON, STREAM: count}) as handle:
            assert list(handle.plan.streamed) == [order[i] for i in spread(count, sizes)], count


def test_streamed_blocks_spread_among_resident_ones_and_the_first_and_last_copies_start_early():
    """2 of Wan's 5 test blocks stream: blocks 1 and 3, so each copy overlaps a resident block's compute. The
    first streamed block is loaded as the model's forward starts (before block 0 runs), the last one as it
    ends (before backward reaches it); the step stays exact."""
    pytest.importorskip("peft")
    case = LORA[WAN.name]
    want = run_step(case.fresh(), case)
    model = case.fresh()
    seen: list[tuple[int, set[int]]] = []
    with cpu_test_mode(), gradseam.patch(model, {**ON, STREAM: 2}) as handle:
        stream = handle.weights
        assert [list(model.blocks).index(b.module) for b in stream.blocks] == [1, 3]
        model.blocks[0].register_forward_pre_hook(
            lambda m, a: seen.append((0, {j for j, b in enumerate(stream.blocks) if b.loaded})))
        outputs = []
        model.register_forward_hook(
            lambda m, a, out: outputs.append({j for j, b in enumerate(stream.blocks) if b.loaded}), prepend=False)
        got = run_step(model, case)
        assert not any(b.loaded for b in stream.blocks), "all released after the step"
    assert seen[0] == (0, {0}), "the first streamed block is copied before block 0 runs"
    assert outputs == [{1}], "the last streamed block is copied as forward ends, for its backward"
    assert stream.loads == 4, "each block once in forward, the last again as forward ends, the first in backward"
    assert_same_step(want, got)


@pytest.mark.parametrize("backend", ["torch", "unsloth"])
def test_the_naive_reference_copies_each_block_in_as_it_runs_and_back_out_after_exactly(backend):
    """The reference bench measures the overlap against: nothing is loaded ahead (one block's weights at a
    time), every release copies the block back to host memory, and the step is the resident model's."""
    pytest.importorskip("peft")
    case = LORA[WAN.name]
    want = run_step(case.fresh(), case)
    model = case.fresh()
    config = {**ON, "gradient_checkpointing_backend": backend, STREAM: "all"}
    with cpu_test_mode(), gradseam.patch(model, config) as handle:
        handle.weights.naive = True
        got = run_step(model, case)
        stream = handle.weights
        assert stream.most_loaded == 1 and stream.ahead == 0
        assert stream.loads == 2 * len(stream.blocks) == stream.copies_back, "in and out, forward and backward"
    assert_same_step(want, got)


def test_streaming_a_group_offloaded_model_is_refused_naming_both():
    """diffusers' group offloading moves the same weights between CPU and GPU memory: one of the two."""
    from diffusers.hooks import apply_group_offloading

    model = WAN.fresh().requires_grad_(False)
    apply_group_offloading(model, onload_device=torch.device("cpu"), offload_type="block_level",
                           num_blocks_per_group=1)
    with cpu_test_mode(), pytest.raises(UnsupportedStrategyError,
                                        match=r"group offloading on.*move the same weights a second way.*Use one"):
        gradseam.patch(model, {**ON, STREAM: "all"})
    assert gradseam.handle_of(model) is None


def test_streaming_fsdp2_sharded_blocks_is_refused_naming_fsdp2s_own_offload(tmp_path):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    if dist.is_initialized():
        pytest.skip("a process group is already open in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = WAN.fresh().requires_grad_(False)
        for block in model.blocks:
            fully_shard(block)
        with cpu_test_mode(), pytest.raises(UnsupportedStrategyError, match=(
                r"blocks\[2\]\..* is sharded by FSDP2 \(a DTensor\).*CPUOffloadPolicy")) as info:
            gradseam.patch(model, {**ON, STREAM: 1})
        assert "quantized" not in str(info.value)
        assert gradseam.handle_of(model) is None
    finally:
        dist.destroy_process_group()


def test_a_model_loaded_under_gradseam_patching_streams_once_frozen(tmp_path):
    """``from_pretrained`` onto the CPU inside ``gradseam.patching``: the model comes out patched, nothing
    streams until the trainer freezes it and adds its LoRA, and the first step is the resident model's."""
    pytest.importorskip("peft")
    from diffusers import WanTransformer3DModel

    case = LORA[WAN.name]
    torch.manual_seed(case.seed)
    WAN.build().save_pretrained(tmp_path)
    want_model = WanTransformer3DModel.from_pretrained(tmp_path)
    torch.manual_seed(1)  # the same LoRA (initialised at random) on both
    want = run_step(_lora(want_model), case)
    with cpu_test_mode():
        with gradseam.patching(gradient_checkpointing=True, gradient_checkpointing_stream_weights="all"):
            model = WanTransformer3DModel.from_pretrained(tmp_path)
        handle = gradseam.handle_of(model)
        assert handle is not None and not handle.weights.selected, "the loaded model trains everything yet"
        torch.manual_seed(1)
        _lora(model)
        got = run_step(model, case, count_bytes=False)
        assert handle.weights.selected and handle.weights.loads > 0
        handle.remove()
    assert_same_step(want, got)


@pytest.mark.parametrize(("env", "want"), [
    ({}, False),
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, True),
    ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128, expandable_segments:True"}, True),
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, False),
    ({"PYTORCH_ALLOC_CONF": "expandable_segments:true"}, True),
    ({"PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.6"}, False),
])
def test_whether_the_allocator_expands_its_segments_is_read_as_torch_reads_it(monkeypatch, env, want):
    """Streaming on a GPU warns once without expandable segments (freed blocks' memory stays reserved in pieces)."""
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert weights_module.expandable_segments() is want
    assert "expandable_segments:True" in weights_module.FRAGMENTATION


# -- which blocks stream, per block --------------------------------------------------------------------------------

BLOCKS = "gradient_checkpointing_blocks"


@pytest.mark.parametrize(("keys", "want"), [
    # an entry streams every block it selects; the others stay resident
    ({BLOCKS: [{"blocks": "blocks[1:3]", STREAM: "all"}]}, [1, 2]),
    # the top-level N spreads over the blocks no entry decides; an entry's 0 keeps its blocks resident
    ({STREAM: 2, BLOCKS: [{"blocks": "blocks[0:1]", STREAM: 0}]}, [2, 4]),
    # an entry's N spreads over its own blocks, the later entry winning where two select a block
    ({BLOCKS: [{"blocks": "blocks", STREAM: 1}, {"blocks": "blocks[4]", STREAM: "all"}]}, [2, 4]),
])
def test_an_entry_chooses_which_of_its_blocks_stream_and_they_train_exactly(keys, want):
    pytest.importorskip("peft")
    case = LORA[WAN.name]
    with cpu_test_mode():
        check_strategy(case, {**ON, **keys})
        with gradseam.patch(case.fresh(), {**ON, **keys}) as handle:
            assert handle.plan.streamed == tuple(("blocks", i) for i in want)


@pytest.mark.parametrize(("keys", "words"), [
    ({BLOCKS: [{"blocks": "blocks[0:2]", STREAM: 3}]},
     r"gradient_checkpointing_stream_weights=3, but gradient_checkpointing_blocks\[0\] \('blocks\[0:2\]'\) decides it "
     r"for 2 blocks\. Stream at most 2"),
    ({STREAM: "all", BLOCKS: [{"blocks": "blocks[3]", "gradient_checkpointing": False}]},
     r"needs checkpointing, and blocks\[3\] runs without it"),
])
def test_an_entry_that_cannot_stream_is_refused_naming_it(keys, words):
    with cpu_test_mode(), pytest.raises(UnsupportedStrategyError, match=words):
        gradseam.patch(WAN.fresh().requires_grad_(False), {**ON, **keys})


def test_a_set_aside_stream_lends_the_blocks_a_measuring_patch_keeps_resident_and_parks_them_after():
    """What ``auto`` measures a model larger than its GPU with: its stream set aside, a measuring patch streams some
    blocks from the stream's host copies (borrowed), and ``lending`` brings the others to the device for the step,
    as if resident; after it every block points at its host copy again, and none of it counts as the stream's
    own loads (the summary's count is the training's). Exact against the unpatched model."""
    from gradseam.handle import lending

    def frozen() -> torch.nn.Module:
        model = WAN.fresh()
        for block in model.blocks:
            block.requires_grad_(False)
        return model

    want = run_step(frozen(), WAN)
    model = frozen()
    with cpu_test_mode():
        outer = gradseam.patch(model, {**ON, STREAM: "all"})
        stream = outer.weights
        outer.active = False  # as auto's first step: the measuring patches do not replace this one
        try:
            with outer.set_aside():
                hosts = {id(b.module): {e.host.data_ptr() for e in b.tensors} for b in stream.blocks}

                def parked(block: torch.nn.Module) -> bool:
                    return {p.data_ptr() for p in block.parameters()} <= hosts[id(block)]

                counted = (stream.loads, stream.misses)
                with gradseam.patch(model, {**ON, STREAM: 2}) as one:
                    borrowed = {id(b.module) for b in one.weights.blocks}
                    assert len(borrowed) == 2 and all(b.borrowed for b in one.weights.blocks)
                    with lending(model):
                        assert [parked(b) for b in model.blocks] == [id(b) in borrowed for b in model.blocks]
                        got = run_step(model, WAN)
                    assert all(parked(b) for b in model.blocks), "a lent block stayed off its host copy"
                assert not any(b.loaded for b in stream.blocks), "a lent block stayed loaded"
                assert (stream.loads, stream.misses) == counted
        finally:
            outer.active = True
            outer.remove()
    assert_same_step(want, got, what="lent and borrowed blocks vs unpatched")
