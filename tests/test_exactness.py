"""No silent wrong result: whatever a model's loop or a hook does between two blocks of a chunk,
interval chunks stay exact (or fall back for that call, counted and said once), and the offload
engine refuses an in-place change exactly where autograd would."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
import torch.nn.functional as F
from cases import FLUX, WAN
from torch import nn

import gradseam
from gradseam import BlockClass, BlockList, Carry, Family, hookimpl
from gradseam.errors import GradseamWarning, UnsupportedModelError, UnsupportedStrategyError
from gradseam.offload import cpu_test_mode
from gradseam.run.links import ARGUMENTS, RANDOM, VERSION
from gradseam.testing import Case, assert_same_step, run_step

CHUNKS = {"gradient_checkpointing": True, "gradient_checkpointing_interval": 2}


# -- a toy family whose loop the tests control ------------------------------------------------


class ToyBlock(nn.Module):
    """A block that takes a tensor, a scale tensor and an options dict, and draws dropout."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, hidden_states: torch.Tensor, scale: torch.Tensor, options: dict) -> torch.Tensor:
        h = F.dropout(self.lin(hidden_states), 0.3, training=self.training)
        return torch.tanh(h) * scale + options["bias"]


class OddBlock(ToyBlock):
    """The same block, with a forward whose receiver is not called ``self``."""

    def forward(this, hidden_states: torch.Tensor, scale: torch.Tensor, options: dict) -> torch.Tensor:  # noqa: N805
        return ToyBlock.forward(this, hidden_states, scale, options)


class ToyStack(nn.Module):
    """``between(i, h)``: what the model's own loop does after block ``i`` (None: nothing)."""

    def __init__(self, depth: int = 4, block: type[ToyBlock] = ToyBlock) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(block() for _ in range(depth))
        self.between = None

    def forward(self, hidden_states: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor]:
        options = {"bias": 0.1}
        scale = scale * 1.0  # a non-leaf the loop may edit in place
        for i, block in enumerate(self.blocks):
            hidden_states = block(hidden_states, scale, options)
            if self.between is not None:
                hidden_states = self.between(i, hidden_states, scale, options) or hidden_states
        return (hidden_states,)


def toy_inputs(g: torch.Generator) -> dict:
    return {
        "hidden_states": torch.randn(2, 3, 8, generator=g).requires_grad_(True),
        "scale": torch.randn(8, generator=g).requires_grad_(True),
    }


def toy_family(carry: Carry | None = None, block: type = ToyBlock) -> Family:
    return Family(
        name="toy", models=(ToyStack,),
        block_lists=(BlockList("blocks", carry=carry or Carry({"hidden_states": None})),),
        block_classes=(BlockClass(block, attention=("lin",)),),
    )


@pytest.fixture
def toy():
    """Registers a toy family (the test may pass its own); always unregistered afterwards."""
    names: list[str] = []

    def register(family: Family | None = None) -> Family:
        family = family or toy_family()

        class Plugin:
            @hookimpl
            def register_families(self, register):
                register(family)

        names.append(gradseam.register(Plugin(), name=f"toy-{len(names)}"))
        return family

    yield register
    for name in names:
        gradseam.unregister(name)


def toy_step(model: ToyStack, seed: int = 5):
    torch.manual_seed(seed)  # dropout draws from the global generator
    step = run_step(model, Case("toy", ToyStack, toy_inputs))
    return step, torch.get_rng_state()


def compare(between, *, cause: str | None, block: type = ToyBlock):
    """Unpatched vs interval-2 chunks with the same loop; returns the handle's chunk regions."""
    torch.manual_seed(0)
    model = ToyStack(block=block).train()
    model.between = between
    reference, ref_rng = toy_step(model)
    handle = gradseam.patch(model, CHUNKS)
    try:
        for step in (1, 2):
            got, rng = toy_step(model)
            assert_same_step(reference, got, what=f"step {step}")
            assert torch.equal(rng, ref_rng), f"step {step}: the generator ended elsewhere than unpatched"
        chunks = [r for r in handle.regions() if r.shape == "chunk"]
        assert [r.chunk_calls for r in chunks] == [2, 2]  # tried as chunks on every call, never latched off
        if cause is None:
            assert all(r.served == 2 and not r.fallbacks for r in chunks), chunks
        else:
            assert all(r.fallbacks == {cause: 2} for r in chunks), chunks
        return handle
    finally:
        handle.remove()


def test_chunks_served_when_the_loop_does_nothing(toy):
    toy()
    compare(None, cause=None)


def test_residual_added_in_place_between_blocks(toy):
    toy()

    def residual(i, h, scale, options):
        h[:, 1:] = h[:, 1:] + 0.5 * (i + 1)  # the ControlNet residual pattern of diffusers' Chroma/Flux loops

    with pytest.warns(GradseamWarning, match="changed in place between blocks"):
        compare(residual, cause=VERSION)


def test_random_numbers_drawn_between_blocks(toy):
    toy()

    def stochastic_depth(i, h, scale, options):
        torch.rand(3)  # the draw itself changes every later dropout mask

    with pytest.warns(GradseamWarning, match="random numbers were drawn between blocks"):
        compare(stochastic_depth, cause=RANDOM)


def test_dict_argument_edited_between_blocks(toy):
    toy()

    def schedule(i, h, scale, options):
        options["bias"] += 0.25  # same dict object, new contents

    compare(schedule, cause=ARGUMENTS)


class ShiftBlock(ToyBlock):
    """Adds ``scale`` instead of multiplying by it: autograd saves nothing of it, so the loop may edit it
    in place between blocks unpatched (an edit of a tensor autograd saved raises in plain autograd)."""

    def forward(self, hidden_states: torch.Tensor, scale: torch.Tensor, options: dict) -> torch.Tensor:
        h = F.dropout(self.lin(hidden_states), 0.3, training=self.training)
        return torch.tanh(h) + scale + options["bias"]


@pytest.mark.parametrize("config", [CHUNKS, {"gradient_checkpointing": True}], ids=["interval-2", "per-block"])
def test_tensor_argument_edited_in_place_between_blocks_is_refused_as_torch_checkpoint_refuses(toy, config):
    """A block input edited in place after the block ran is legal unpatched here, but a checkpoint must
    recompute the block from that input: torch's checkpoint (diffusers' own flag) saves its inputs and
    autograd raises in backward. gradseam does the same; the chunk falls back first, naming why. (With the
    byte count's hooks masking autograd's check, this test once compared against a reference that plain
    autograd refuses.)"""
    toy(toy_family(block=ShiftBlock))

    def rescale(i, h, scale, options):
        with torch.no_grad():
            scale.mul_(1.1)

    torch.manual_seed(0)
    model = ToyStack(block=ShiftBlock).train()
    model.between = rescale
    run_step(model, Case("toy", ToyStack, toy_inputs), count_bytes=False)  # unpatched: legal, trains
    handle = gradseam.patch(model, config)
    try:
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            run_step(model, Case("toy", ToyStack, toy_inputs), count_bytes=False)
        chunks = [r for r in handle.regions() if r.shape == "chunk"]
        assert all(r.fallbacks == {ARGUMENTS: 1} for r in chunks) and len(chunks) == (2 if config is CHUNKS else 0)
    finally:
        handle.remove()


def test_receiver_not_named_self(toy):
    toy(toy_family(block=OddBlock))
    compare(None, cause=None, block=OddBlock)


def test_fallback_is_per_call_and_the_summary_counts_it(toy):
    toy()
    torch.manual_seed(0)
    model = ToyStack().train()
    handle = gradseam.patch(model, CHUNKS)
    try:
        model.between = lambda i, h, s, o: torch.rand(1) and None
        toy_step(model)
        model.between = None
        toy_step(model)  # the next call runs as a chunk again
        chunks = [r for r in handle.regions() if r.shape == "chunk"]
        assert [(r.chunk_calls, r.served, dict(r.fallbacks)) for r in chunks] == [(2, 1, {RANDOM: 1})] * 2
        text = str(handle.summary())
        assert "blocks[0, 1]: ran as one chunk 2 of 2 calls; 1 call(s) fell back to one region per block because 1x random" in text
    finally:
        handle.remove()


def test_carry_naming_a_missing_parameter_is_refused_at_planning(toy):
    toy(toy_family(Carry({"hidden": None})))
    model = ToyStack()
    with pytest.raises(UnsupportedModelError) as info:
        gradseam.patch(model, CHUNKS)
    msg = str(info.value)
    assert "family 'toy'" in msg and "'hidden'" in msg and "ToyBlock.forward does not take" in msg
    assert gradseam.handle_of(model) is None
    gradseam.patch(model, gradient_checkpointing=True).remove()  # without chunks the Carry is not used


def test_carry_position_out_of_range_names_the_family(toy):
    toy(toy_family(Carry({"hidden_states": 1})))
    model = ToyStack()
    with gradseam.patch(model, CHUNKS), pytest.raises(UnsupportedModelError) as info:
        toy_step(model)
    msg = str(info.value)
    assert "family 'toy', block list 'blocks'" in msg and "'hidden_states' to output position 1" in msg
    assert "returned a single Tensor" in msg


# -- real families: a forward hook that edits a block's output in place -----------------------


def _scale_outputs(model: nn.Module) -> None:
    def edit(module, args, out):
        (out[-1] if isinstance(out, tuple) else out).mul_(1.5)

    for name, child in model.named_modules():
        if name.count(".") == 1 and name.split(".")[0] in ("blocks", "transformer_blocks", "single_transformer_blocks"):
            child.register_forward_hook(edit)


@pytest.mark.parametrize("case", [WAN, FLUX], ids=["wan", "flux"])
def test_forward_hook_editing_outputs_in_place(case):
    torch.manual_seed(case.seed)
    model = case.build()
    _scale_outputs(model)
    reference = run_step(model, case)
    with gradseam.patch(model, CHUNKS) as handle:
        assert_same_step(reference, run_step(model, case), what=f"{case.name} interval 2 with output hooks")
        assert any(VERSION in r.fallbacks for r in handle.regions())


# -- offload: in-place changes through another view ---------------------------------------------


class ViewAttention(nn.Module):
    """Saves a view of a projection for backward, and keeps a sibling view of it (like q, k, v)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 16)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        qk = self.proj(hidden_states)
        self.sibling = qk[..., 8:]  # the saved view below dies; this alias of its storage lives on
        return qk[..., :8].sin()


class ViewBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = ViewAttention()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.attn(hidden_states)


class ViewStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([ViewBlock()])

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.blocks[0](hidden_states)


def _edit_through_sibling(model: ViewStack) -> str:
    out = model(torch.randn(2, 8, requires_grad=True))
    gc.collect()
    with torch.no_grad():
        model.blocks[0].attn.sibling.mul_(2)
    with pytest.raises(RuntimeError) as info:
        out.sum().backward()
    return str(info.value)


def test_offload_refuses_in_place_edit_through_another_view():
    family = Family(name="views", models=(ViewStack,), block_lists=(BlockList("blocks"),),
                    block_classes=(BlockClass(ViewBlock, attention=("attn",)),))

    class Plugin:
        @hookimpl
        def register_families(self, register):
            register(family)

    name = gradseam.register(Plugin(), name="views")
    try:
        model = ViewStack()
        assert "modified by an inplace operation" in _edit_through_sibling(model)  # autograd, unpatched
        with cpu_test_mode(), gradseam.patch(model, gradient_checkpointing_offload_attention=True) as handle:
            msg = _edit_through_sibling(model)
            assert handle.engine.copies > 0
        assert "modified by an inplace operation" in msg and "gradseam's activation offload" in msg
    finally:
        gradseam.unregister(name)


# -- torch.func, deep copies ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "what"),
    [({"gradient_checkpointing": True, "gradient_checkpointing_backend": "unsloth"}, "unsloth backends"),
     ({"gradient_checkpointing_offload_attention": True}, "gradient_checkpointing_offload_attention")],
    ids=["unsloth", "attention-offload"],
)
@pytest.mark.parametrize("transform", ["jvp", "vjp", "grad"])
def test_torch_func_transforms_are_refused_by_name(config, what, transform):
    torch.manual_seed(0)
    model = WAN.build()
    inputs = WAN.inputs(torch.Generator().manual_seed(1))
    h = inputs.pop("hidden_states").detach()

    def f(x):
        return model(hidden_states=x, **inputs)[0]

    run = {
        "jvp": lambda: torch.func.jvp(f, (h,), (torch.ones_like(h),)),
        "vjp": lambda: torch.func.vjp(f, h),
        "grad": lambda: torch.func.grad(lambda x: f(x).sum())(h),
    }[transform]
    with cpu_test_mode(), gradseam.patch(model, config), pytest.raises(UnsupportedStrategyError) as info:
        run()
    msg = str(info.value)
    assert what in msg and f"torch.func.{transform}" in msg and "handle.remove()" in msg, msg


def test_deep_copy_of_one_patched_block_is_clean():
    torch.manual_seed(0)
    model = WAN.build()
    handle = gradseam.patch(model, CHUNKS)
    clone = copy.deepcopy(model.blocks[1])
    handle.remove()
    x = torch.randn(1, 8, 16)
    args = dict(encoder_hidden_states=torch.randn(1, 6, 16), temb=torch.randn(1, 6, 16),
                rotary_emb=model.rope(torch.randn(1, 4, 2, 4, 4)))
    expected = model.blocks[1](x, **args)
    assert torch.equal(clone(x, **args), expected)
    assert "forward" not in clone.__dict__  # the copied seam unlinked itself on its first call
    # a copy of the whole patched model is patched in its own right
    handle = gradseam.patch(model, CHUNKS)
    whole = copy.deepcopy(model)
    assert gradseam.handle_of(whole) is not None and gradseam.handle_of(whole) is not handle
    handle.remove()


# -- all-or-nothing patches ---------------------------------------------------------------------


class TwoTransformers:
    """A pipeline as patch() sees it: components, one of them on a 'GPU' and one on the CPU."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.transformer, self.transformer_2 = WAN.build(), WAN.build()

    @property
    def components(self) -> dict:
        return {"transformer": self.transformer, "transformer_2": self.transformer_2}


def test_pipeline_patch_checks_every_device_before_installing(monkeypatch):
    from gradseam import patcher

    pipe = TwoTransformers()
    real = patcher.device_type
    monkeypatch.setattr(patcher, "device_type", lambda m: "cuda" if m is pipe.transformer else real(m))
    with pytest.raises(UnsupportedStrategyError, match="WanTransformer3DModel is on the CPU"):
        gradseam.patch(pipe, gradient_checkpointing=True, gradient_checkpointing_backend="unsloth")
    for model in pipe.components.values():
        assert gradseam.handle_of(model) is None
        assert not [n for n, m in model.named_modules() if "forward" in m.__dict__]


def test_pipeline_patch_rolls_back_when_installing_fails(monkeypatch):
    from gradseam.handle import PatchHandle

    pipe = TwoTransformers()
    earlier = gradseam.patch(pipe.transformer, gradient_checkpointing=True)  # replaced, then put back
    real = PatchHandle.install

    def install(self, inherit=None):
        if self.model is pipe.transformer_2:
            raise RuntimeError("injected install failure")
        real(self, inherit)

    monkeypatch.setattr(PatchHandle, "install", install)
    with pytest.raises(RuntimeError, match="injected install failure"):
        gradseam.patch(pipe, CHUNKS)
    monkeypatch.setattr(PatchHandle, "install", real)
    assert gradseam.handle_of(pipe.transformer) is earlier and earlier.config.interval == 1
    assert gradseam.handle_of(pipe.transformer_2) is None
    assert not [n for n, m in pipe.transformer_2.named_modules() if "forward" in m.__dict__]
    earlier.remove()


# -- torch's checkpoint wrapper applied after gradseam ----------------------------------------


def test_checkpoint_wrapper_applied_after_patching_is_respected(checkpoint_calls):
    from diffusers.models.transformers.transformer_wan import WanTransformerBlock
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    def is_block(m: nn.Module) -> bool:
        return isinstance(m, WanTransformerBlock)

    torch.manual_seed(0)
    model = WAN.build()
    plain = copy.deepcopy(model)
    apply_activation_checkpointing(plain, check_fn=is_block)
    reference = run_step(plain, WAN)  # parameter names change inside the wrapper: compare like with like
    handle = gradseam.patch(model, CHUNKS)
    apply_activation_checkpointing(model, check_fn=is_block)
    with pytest.warns(GradseamWarning, match="CheckpointWrapper") as record:
        checkpoint_calls.clear()
        assert_same_step(reference, run_step(model, WAN), what="after the wrapper")
    assert len([w for w in record if issubclass(w.category, GradseamWarning)]) == 1
    assert checkpoint_calls == []  # torch's wrapper checkpoints the blocks; gradseam does not nest a second
    assert not handle.regions()
    assert_same_step(reference, run_step(model, WAN), what="second step")
    handle.remove()
    assert_same_step(reference, run_step(model, WAN), what="after remove()")


# -- load-time patching of a CPU model with an offload backend -------------------------------


def test_cpu_model_patched_at_load_time_says_offload_is_pending(tmp_path):
    torch.manual_seed(0)
    WAN.build().save_pretrained(tmp_path)
    from diffusers import WanTransformer3DModel

    with gradseam.patching(gradient_checkpointing=True, gradient_checkpointing_backend="unsloth"):
        model = WanTransformer3DModel.from_pretrained(tmp_path)
    handle = gradseam.handle_of(model)
    assert handle is not None and handle.offload_pending()
    text = str(handle.summary())
    assert "CPU offload of region inputs (pending: the model is on the CPU)" in text
    assert "note: offload pending: WanTransformer3DModel is on the CPU" in text
    with pytest.warns(GradseamWarning) as record:
        run_step(model, WAN)
        run_step(model, WAN)
    pending = [str(w.message) for w in record if "nothing is offloaded until the model is on a GPU" in str(w.message)]
    assert len(pending) == 1 and "backend 'unsloth'" in pending[0]
    with torch.no_grad():  # sampling is not training: no warning
        model(**WAN.inputs(torch.Generator().manual_seed(1)))
    handle.remove()


# -- a seam some instances of a block class lack ---------------------------------------------


class TwoStreamBlock(nn.Module):
    """Like SD3's joint block: the last one is built without the text stream's feed-forward."""

    def __init__(self, last: bool = False) -> None:
        super().__init__()
        self.ff = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
        self.ff_context = None if last else nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))

    def forward(self, hidden_states: torch.Tensor, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states = hidden_states + self.ff(hidden_states)
        if self.ff_context is not None:
            context = context + self.ff_context(context)
        return context, hidden_states


class TwoStreamModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([TwoStreamBlock(), TwoStreamBlock(), TwoStreamBlock(last=True)])

    def forward(self, hidden_states: torch.Tensor, context: torch.Tensor) -> tuple[torch.Tensor]:
        for block in self.blocks:
            context, hidden_states = block(hidden_states, context)
        return (hidden_states,)


def _two_stream_family(optional: tuple[str, ...]) -> Family:
    return Family(name="two-stream", models=(TwoStreamModel,), block_lists=(BlockList("blocks"),),
                  block_classes=(BlockClass(TwoStreamBlock, ffn=(("ff",), ("ff_context",)), optional=optional),))


TWO_STREAM = Case("two-stream", TwoStreamModel, lambda g: {"hidden_states": torch.randn(2, 4, 8, generator=g).requires_grad_(True),
                                                          "context": torch.randn(2, 3, 8, generator=g).requires_grad_(True)})


def test_optional_seam_is_skipped_on_instances_that_lack_it(toy):
    from gradseam.testing import check_strategy

    toy(_two_stream_family(("ff_context",)))
    report = check_strategy(TWO_STREAM, {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch-ffn"},
                            whole=True)
    assert sorted(r.label for r in report.regions) == [
        "blocks[0].ff", "blocks[0].ff_context", "blocks[1].ff", "blocks[1].ff_context", "blocks[2].ff"]


def test_a_missing_seam_not_declared_optional_is_refused(toy):
    toy(_two_stream_family(()))
    with pytest.raises(UnsupportedModelError, match="names submodule 'ff_context' of TwoStreamBlock"):
        gradseam.patch(TwoStreamModel(), gradient_checkpointing=True, gradient_checkpointing_backend="torch-ffn")


def test_optional_must_name_a_declared_submodule():
    with pytest.raises(ValueError, match="field 'optional' names 'norm', which is neither in 'ffn' nor in 'attention'"):
        BlockClass(TwoStreamBlock, ffn=(("ff",),), optional=("norm",))
