"""gradseam.patch: refusals, warnings, replacing a patch, remove(), inference, the built-in flag,
controlnet residuals, pipelines and the summary."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from cases import FLUX, WAN, flux_inputs, wan_model
from seam_probe import installed_seam
from torch import nn

import gradseam
from gradseam import (
    BlockClass,
    BlockList,
    Carry,
    Family,
    UnsupportedModelError,
    UnsupportedStrategyError,
    hookimpl,
)
from gradseam.errors import GradseamWarning, warned
from gradseam.handle import PatchHandle, PipelineHandle
from gradseam.testing import Case, assert_same_step, check_strategy, run_step

TRAIN = {"gradient_checkpointing": True}
INTERVAL_2 = {"gradient_checkpointing": True, "gradient_checkpointing_interval": 2}


# -- helpers -------------------------------------------------------------------------------------


def build(case: Case) -> nn.Module:
    torch.manual_seed(case.seed)
    return case.build()


def instance_forwards(model: nn.Module) -> list[str]:
    """Modules that carry an instance-level ``forward`` (what a patch installs)."""
    return [name for name, m in model.named_modules() if "forward" in m.__dict__]


def gradseam_warnings(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, GradseamWarning)]


# -- a tiny third-party stack, registered per test -------------------------------------------------


class Block(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.mix = nn.Linear(dim, dim)
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, hidden_states: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        h = hidden_states + torch.tanh(self.mix(hidden_states)) * scale
        return h + self.ff(h)


class Stack(nn.Module):
    def __init__(self, dim: int = 8, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))

    def forward(self, hidden_states: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor]:
        for block in self.blocks:
            hidden_states = block(hidden_states, scale)
        return (hidden_states,)


def stack_inputs(g: torch.Generator) -> dict:
    return {
        "hidden_states": torch.randn(2, 5, 8, generator=g).requires_grad_(True),
        "scale": torch.randn(8, generator=g).requires_grad_(True),
    }


STACK = Case("stack", Stack, stack_inputs)


def _family(name: str, *, ffn: bool = True, carry: bool = True) -> Family:
    return Family(
        name=name,
        models=(Stack,),
        block_lists=(BlockList("blocks", carry=Carry({"hidden_states": None}) if carry else None),),
        block_classes=(BlockClass(Block, ffn=(("ff",),) if ffn else (), attention=("mix",)),),
    )


@pytest.fixture
def stack_family():
    """Register a family for :class:`Stack` (shape chosen by the test); always unregistered afterwards."""
    names: list[str] = []

    def register(family: Family) -> Family:
        class Plugin:
            @hookimpl
            def register_families(self, register):
                register(family)

        names.append(gradseam.register(Plugin(), name=f"test-{family.name}"))
        return family

    yield register
    for name in names:
        gradseam.unregister(name)


# -- unsupported models ----------------------------------------------------------------------------


def _assert_unsupported_message(msg: str, qualified: str) -> None:
    assert qualified in msg
    installed = [f.name for f in gradseam.families()]
    assert {"flux", "wan"} <= set(installed)
    assert f"Installed families: {', '.join(installed)}." in msg
    assert "plugin guide" in msg and "docs/plugins.md" in msg


def test_unsupported_plain_module():
    with pytest.raises(UnsupportedModelError) as info:
        gradseam.patch(nn.Linear(2, 2), TRAIN)
    _assert_unsupported_message(str(info.value), "torch.nn.modules.linear.Linear")
    assert isinstance(info.value, TypeError)  # callers catching TypeError still catch it


class UnclaimedTransformer(nn.Module):
    """Shaped like a transformer a family would patch (a ModuleList of blocks), but no family claims it."""

    def __init__(self, dim: int = 8, depth: int = 2) -> None:
        super().__init__()
        self.transformer_blocks = nn.ModuleList(nn.TransformerEncoderLayer(dim, 2, 16) for _ in range(depth))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        for block in self.transformer_blocks:
            hidden_states = block(hidden_states)
        return hidden_states


def test_unsupported_model_with_blocks():
    # A model with blocks, but of a class no family (and no left-out entry) names: refused, nothing patched.
    model = UnclaimedTransformer()
    with pytest.raises(UnsupportedModelError) as info:
        gradseam.patch(model, TRAIN)
    _assert_unsupported_message(str(info.value), f"{__name__}.UnclaimedTransformer")
    assert str(info.value).startswith("no gradseam family handles ")
    assert instance_forwards(model) == []
    assert gradseam.handle_of(model) is None


def test_patch_rejects_non_model():
    with pytest.raises(TypeError, match="expects a diffusers model or pipeline, got str"):
        gradseam.patch("flux.safetensors", TRAIN)


# -- refused strategies ------------------------------------------------------------------------------


def test_ffn_backend_without_ffn_boundary_refused_and_model_untouched(stack_family):
    stack_family(_family("noffn", ffn=False))
    model = build(STACK)
    reference = run_step(model, STACK)
    dicts = {name: set(m.__dict__) for name, m in model.named_modules()}
    for backend, whole in (("torch-ffn", "torch"), ("unsloth-ffn", "unsloth")):
        with pytest.raises(UnsupportedStrategyError) as info:
            gradseam.patch(model, gradient_checkpointing=True, gradient_checkpointing_backend=backend)
        msg = str(info.value)
        assert f"backend {backend!r} needs an FFN boundary" in msg
        assert "family 'noffn'" in msg and "['Block']" in msg
        assert f"Use '{whole}' (whole-block) instead" in msg
        assert isinstance(info.value, ValueError)
    assert gradseam.handle_of(model) is None
    assert {name: set(m.__dict__) for name, m in model.named_modules()} == dicts
    assert_same_step(reference, run_step(model, STACK), what="after a refused patch")
    # the whole-block backend works on the same family
    check_strategy(STACK, TRAIN)


def test_refused_second_patch_keeps_the_first(stack_family, checkpoint_calls):
    stack_family(_family("noffn", ffn=False))
    model = build(STACK)
    reference = run_step(model, STACK)
    first = gradseam.patch(model, TRAIN)
    with pytest.raises(UnsupportedStrategyError):
        gradseam.patch(model, gradient_checkpointing=True, gradient_checkpointing_backend="torch-ffn")
    assert first.active and gradseam.handle_of(model) is first
    checkpoint_calls.clear()
    assert_same_step(reference, run_step(model, STACK))
    assert len(checkpoint_calls) == 4  # still one region per block
    first.remove()


def test_interval_without_carry_warns_once_and_stays_exact(stack_family, checkpoint_calls):
    stack_family(_family("nocarry", carry=False))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        check_strategy(STACK, INTERVAL_2)
        model = build(STACK)
        handle = gradseam.patch(model, INTERVAL_2)  # the same setting again: no second warning
    messages = gradseam_warnings(record)
    assert len(messages) == 1, messages
    assert "family 'nocarry' does not support gradient_checkpointing_interval" in messages[0]
    assert "interval=2" in messages[0] and "every selected block on its own" in messages[0]
    # what runs instead: one region per block, no chunks
    assert [r.shape for r in handle.plan.regions] == ["block"] * 4
    reference_model = build(STACK)
    checkpoint_calls.clear()
    assert_same_step(run_step(reference_model, STACK), run_step(model, STACK))
    assert len(checkpoint_calls) == 4
    handle.remove()


# -- replacing and removing ------------------------------------------------------------------------


def _fell_back(handle) -> bool:
    return any(r.fallbacks for r in handle.regions())


def test_patch_twice_replaces(checkpoint_calls):
    model = build(FLUX)
    reference = run_step(model, FLUX)
    first = gradseam.patch(model, TRAIN)
    checkpoint_calls.clear()
    assert_same_step(reference, run_step(model, FLUX), what="first patch")
    assert len(checkpoint_calls) == 2 + 5  # one region per block

    second = gradseam.patch(model, INTERVAL_2)
    assert isinstance(second, PatchHandle) and second is not first
    assert not first.active and second.active
    assert gradseam.handle_of(model) is second
    # no stacking: every wrapped block wraps the class forward directly, not the first patch
    for block in [*model.transformer_blocks, *model.single_transformer_blocks]:
        seam = installed_seam(block)
        assert seam is not None and seam.original.previous is None
    summary = str(second.summary())
    assert "flux: torch, interval 2" in summary and "chunks of 2 blocks" in summary
    rows = [(row.blocks, row.strategy) for row in second.summary().rows]
    assert rows == [
        ("transformer_blocks[0..1]", "torch: recompute chunks of 2 blocks"),
        ("single_transformer_blocks[0..3]", "torch: recompute chunks of 2 blocks"),
        ("single_transformer_blocks[4]", "torch: recompute each block"),
    ]
    for step in (1, 2):
        checkpoint_calls.clear()
        assert_same_step(reference, run_step(model, FLUX), what=f"second patch step {step}")
        # transformer_blocks[0..1] + single_transformer_blocks[0..1], [2..3], [4]
        assert len(checkpoint_calls) == 4
    assert not _fell_back(second)

    with pytest.warns(GradseamWarning, match="remove\\(\\) on a replaced handle does nothing"):
        first.remove()  # a stale handle must not undo the active patch, and says which handle to remove
    assert second.active and gradseam.handle_of(model) is second
    second.remove()
    assert instance_forwards(model) == []
    assert gradseam.handle_of(model) is None


def test_remove_twice_and_context_manager(checkpoint_calls):
    model = build(WAN)
    reference = run_step(model, WAN)
    handle = gradseam.patch(model, TRAIN)
    handle.remove()
    handle.remove()
    assert not handle.active and "removed" in repr(handle)
    assert instance_forwards(model) == [] and gradseam.handle_of(model) is None
    checkpoint_calls.clear()
    assert_same_step(reference, run_step(model, WAN))
    assert checkpoint_calls == []
    with gradseam.patch(model, TRAIN) as handle:
        assert handle.active and "active" in repr(handle)
        assert_same_step(reference, run_step(model, WAN))
        assert len(checkpoint_calls) == 5
    assert not handle.active and instance_forwards(model) == []


# -- inference ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [INTERVAL_2, {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch-ffn"}],
    ids=["interval2", "torch-ffn"],
)
def test_no_grad_forward_is_plain(checkpoint_calls, config):
    model = build(FLUX)
    with torch.no_grad():
        reference = model(**flux_inputs(torch.Generator().manual_seed(3)))[0]
    handle = gradseam.patch(model, config)
    try:
        with torch.no_grad():
            got = model(**flux_inputs(torch.Generator().manual_seed(3)))[0]
        assert checkpoint_calls == []
        assert torch.equal(reference, got) and got.grad_fn is None
        # inference mode as well
        with torch.inference_mode():
            assert torch.equal(reference, model(**flux_inputs(torch.Generator().manual_seed(3)))[0])
        assert checkpoint_calls == []
        # the counter does see training steps
        run_step(model, FLUX)
        assert len(checkpoint_calls) > 0
    finally:
        handle.remove()


# -- the model's own gradient-checkpointing flag -------------------------------------------------------


def _counting_flag_func(calls: list):
    def func(module, *args):
        calls.append(type(module).__name__)
        return torch.utils.checkpoint.checkpoint(module.__call__, *args, use_reentrant=False)

    return func


def test_builtin_flag_set_before_patch_is_suspended_and_restored(checkpoint_calls):
    model = build(WAN)
    reference = run_step(model, WAN)
    builtin: list[str] = []
    model.enable_gradient_checkpointing(_counting_flag_func(builtin))
    assert_same_step(reference, run_step(model, WAN), what="built-in flag")
    assert builtin == ["WanTransformerBlock"] * 5

    builtin.clear()
    checkpoint_calls.clear()
    handle = gradseam.patch(model, TRAIN)
    assert model.gradient_checkpointing is False and not model.is_gradient_checkpointing
    assert_same_step(reference, run_step(model, WAN), what="patched over the flag")
    assert builtin == []  # the model's own checkpointing does not nest around gradseam's
    assert len(checkpoint_calls) == 5

    handle.remove()
    assert model.gradient_checkpointing is True
    assert "enable_gradient_checkpointing" not in model.__dict__
    checkpoint_calls.clear()
    assert_same_step(reference, run_step(model, WAN), what="after remove")
    assert builtin == ["WanTransformerBlock"] * 5 and checkpoint_calls == []


def test_builtin_flag_set_while_patched_is_deferred(checkpoint_calls):
    model = build(WAN)
    reference = run_step(model, WAN)
    handle = gradseam.patch(model, TRAIN)
    builtin: list[str] = []
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model.enable_gradient_checkpointing(_counting_flag_func(builtin))
    messages = gradseam_warnings(record)
    assert len(messages) == 1
    assert "enable_gradient_checkpointing() called on a model patched by gradseam" in messages[0]
    assert "deferred until handle.remove()" in messages[0]
    assert model.gradient_checkpointing is False
    assert_same_step(reference, run_step(model, WAN))
    assert builtin == []

    handle.remove()
    assert model.gradient_checkpointing is True  # the deferred call ran, with its arguments
    checkpoint_calls.clear()
    assert_same_step(reference, run_step(model, WAN))
    assert builtin == ["WanTransformerBlock"] * 5 and checkpoint_calls == []


def test_disable_while_patched_wins_over_flag_before_patch():
    model = build(WAN)
    model.enable_gradient_checkpointing()
    handle = gradseam.patch(model, TRAIN)
    with pytest.warns(GradseamWarning, match="disable_gradient_checkpointing"):
        model.disable_gradient_checkpointing()
    handle.remove()
    assert model.gradient_checkpointing is False
    assert "disable_gradient_checkpointing" not in model.__dict__


# -- controlnet residuals between blocks ------------------------------------------------------------


def _controlnet_inputs(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    inputs = flux_inputs(g)
    inner = 2 * 8  # heads x head dim of the tiny Flux
    inputs["controlnet_block_samples"] = [torch.randn(1, 16, inner, generator=g).requires_grad_(True)]
    # 5 single blocks, 3 samples: residual index 0, 0, 1, 1, 2 (the one after block 1 lands inside a chunk)
    inputs["controlnet_single_block_samples"] = [
        torch.randn(1, 16, inner, generator=g).requires_grad_(True) for _ in range(3)
    ]
    return inputs


def _controlnet_step(model: nn.Module, seed: int) -> tuple[torch.Tensor, list[torch.Tensor], dict]:
    model.zero_grad(set_to_none=True)
    inputs = _controlnet_inputs(seed)
    out = model(**inputs)[0]
    out.square().mean().backward()
    leaves = [inputs["hidden_states"], inputs["encoder_hidden_states"], *inputs["controlnet_block_samples"],
              *inputs["controlnet_single_block_samples"]]
    grads = [t.grad.clone() for t in leaves]
    params = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach().clone(), grads, params


def test_flux_controlnet_residuals_fall_back_exactly(checkpoint_calls):
    model = build(FLUX)
    references = [_controlnet_step(model, seed) for seed in (1, 2)]
    handle = gradseam.patch(model, INTERVAL_2)
    try:
        for step, (seed, reference) in enumerate(zip((1, 2), references), start=1):
            checkpoint_calls.clear()
            out, grads, params = _controlnet_step(model, seed)
            assert torch.equal(out, reference[0]), f"step {step}: output differs"
            for i, (a, b) in enumerate(zip(reference[1], grads)):
                assert torch.equal(a, b), f"step {step}: gradient of input {i} differs"
            assert reference[2].keys() == params.keys()
            for name, grad in params.items():
                assert torch.equal(reference[2][name], grad), f"step {step}: gradient of {name} differs"
            assert len(checkpoint_calls) >= 4  # still checkpointed, never fewer regions than chunks
        # the residuals broke the chunk chains: they fell back to per-block regions
        assert _fell_back(handle)
        assert len(checkpoint_calls) == 2 + 5
    finally:
        handle.remove()
    assert instance_forwards(model) == []


# -- pipelines ------------------------------------------------------------------------------------


def _wan22_pipeline(transformer: nn.Module, transformer_2: nn.Module):
    from diffusers import DiffusionPipeline, FlowMatchEulerDiscreteScheduler

    class TinyWan22Pipeline(DiffusionPipeline):
        """Wan 2.2 A14B layout: two transformers (high and low noise) and a scheduler."""

        def __init__(self, transformer, transformer_2, scheduler):
            super().__init__()
            self.register_modules(transformer=transformer, transformer_2=transformer_2, scheduler=scheduler)

    return TinyWan22Pipeline(transformer, transformer_2, FlowMatchEulerDiscreteScheduler())


def test_pipeline_patches_both_transformers(checkpoint_calls):
    torch.manual_seed(0)
    high, low = wan_model(), wan_model()
    pipe = _wan22_pipeline(high, low)
    assert set(pipe.components) == {"transformer", "transformer_2", "scheduler"}
    references = [run_step(high, WAN), run_step(low, WAN)]

    handle = gradseam.patch(pipe, INTERVAL_2)
    assert isinstance(handle, PipelineHandle)
    assert set(handle.handles) == {"transformer", "transformer_2"}
    assert gradseam.handle_of(high) is handle["transformer"]
    assert gradseam.handle_of(low) is handle["transformer_2"]
    summary = handle.summary()
    text = str(summary)
    assert "transformer: wan: torch, interval 2" in text and "transformer_2: wan: torch, interval 2" in text
    assert {row.component for row in summary.rows} == {"transformer", "transformer_2"}
    assert text.count("WanTransformerBlock") == len(summary.rows) >= 2
    checkpoint_calls.clear()
    for model, reference in zip((high, low), references):
        assert_same_step(reference, run_step(model, WAN))
    assert len(checkpoint_calls) == 2 * 3  # blocks [0..1], [2..3], [4] in each transformer

    handle.remove()
    handle.remove()
    for model, reference in zip((high, low), references):
        assert gradseam.handle_of(model) is None and instance_forwards(model) == []
        assert_same_step(reference, run_step(model, WAN))


def test_pipeline_refusal_leaves_every_component_untouched(stack_family):
    stack_family(_family("noffn", ffn=False))

    class Pipe:
        def __init__(self):
            torch.manual_seed(0)
            self.transformer = wan_model()
            self.transformer_2 = Stack()

        @property
        def components(self):
            return {"transformer": self.transformer, "transformer_2": self.transformer_2, "tokenizer": object()}

    pipe = Pipe()
    with pytest.raises(UnsupportedStrategyError, match="'noffn'"):
        gradseam.patch(pipe, gradient_checkpointing=True, gradient_checkpointing_backend="torch-ffn")
    assert gradseam.handle_of(pipe.transformer) is None  # Wan supports torch-ffn, but was not patched alone
    assert instance_forwards(pipe.transformer) == [] and instance_forwards(pipe.transformer_2) == []


def test_pipeline_without_supported_component():
    class Pipe:
        components = {"vae": nn.Linear(2, 2), "scheduler": object()}

    with pytest.raises(UnsupportedModelError) as info:
        gradseam.patch(Pipe(), TRAIN)
    msg = str(info.value)
    assert "no component of Pipe is handled" in msg and "(components: vae=Linear;" in msg
    assert "flux" in msg and "wan" in msg and "docs/plugins.md" in msg


# -- summary, state_dict, disabled config -----------------------------------------------------------


def test_summary_names_block_lists_and_strategy():
    model = build(FLUX)
    with gradseam.patch(model, INTERVAL_2) as handle:
        summary = handle.summary()
        text = str(summary)
    assert text.splitlines()[0] == "flux: torch, interval 2"
    assert "blocks" in text.splitlines()[1] and "strategy" in text.splitlines()[1]
    for name in ("transformer_blocks[0..1]", "single_transformer_blocks[0..3]", "single_transformer_blocks[4]",
                 "FluxTransformerBlock", "FluxSingleTransformerBlock", "torch: recompute chunks of 2 blocks",
                 "torch: recompute each block"):
        assert name in text, f"{name!r} missing from:\n{text}"
    assert [row.block_class for row in summary.rows] == [
        "FluxTransformerBlock", "FluxSingleTransformerBlock", "FluxSingleTransformerBlock",
    ]

    with gradseam.patch(model, gradient_checkpointing=True, gradient_checkpointing_backend="torch-ffn",
                        gradient_checkpointing_segment_stride=2) as handle:
        text = str(handle.summary())
    assert text.splitlines()[0] == "flux: torch-ffn, stride 2"
    assert "torch-ffn: recompute ff; torch-ffn: recompute ff_context" in text
    assert "torch-ffn: recompute proj_mlp→act_mlp" in text
    assert "none (activations kept on CPU)" in text  # odd blocks are left alone with stride 2 (a CPU model)
    assert "single_transformer_blocks[1]" in text


def test_state_dict_unchanged():
    model = build(FLUX)
    before = model.state_dict()
    names = [n for n, _ in model.named_parameters()]
    with gradseam.patch(model, INTERVAL_2):
        during = model.state_dict()
        assert list(during) == list(before)
        assert all(during[k].data_ptr() == before[k].data_ptr() for k in before)
        assert [n for n, _ in model.named_parameters()] == names
        assert sum(1 for _ in model.modules()) == sum(1 for _ in build(FLUX).modules())
    assert list(model.state_dict()) == list(before)


def test_disabled_with_settings_warns_nothing_runs(checkpoint_calls):
    model = build(WAN)
    reference = run_step(model, WAN)
    with pytest.warns(GradseamWarning) as record:
        handle = gradseam.patch(
            model, gradient_checkpointing=False, gradient_checkpointing_backend="torch-ffn",
            gradient_checkpointing_interval=2,
        )
    messages = gradseam_warnings(record)
    assert len(messages) == 1
    assert messages[0].startswith(
        "gradient_checkpointing_backend, gradient_checkpointing_interval set but gradient_checkpointing is false"
    )
    assert "no checkpointing will run" in messages[0]
    checkpoint_calls.clear()
    assert_same_step(reference, run_step(model, WAN))
    assert checkpoint_calls == []
    assert "none (activations kept on CPU)" in str(handle.summary())  # a CPU model
    handle.remove()


def test_checkpointing_turned_off_explicitly_does_not_warn_but_left_out_and_idle_does():
    model = build(WAN)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        gradseam.patch(model, gradient_checkpointing=False, gradient_checkpointing_backend="torch").remove()
    assert gradseam_warnings(record) == []
    warned.clear()
    with pytest.warns(GradseamWarning, match="gradient_checkpointing is off and nothing is offloaded"):
        gradseam.patch(model).remove()


@pytest.mark.parametrize("config", [{"gradient_checkpointing_backend": "torch"}, {"gradient_checkpointing_interval": 2},
                                    {"gradient_checkpointing_backend": "unsloth-ffn"}])
def test_a_checkpointing_key_without_gradient_checkpointing_turns_it_on_everywhere(config, tmp_path):
    """One rule for patch(), patching() and `gradseam run`'s config (issue: patch() patched nothing)."""
    from gradseam.offload import cpu_test_mode
    from gradseam.tools.launch import build_config

    model = build(WAN)
    with cpu_test_mode(), gradseam.patch(model, config) as handle:
        assert handle.regions(), config
    assert gradseam.CheckpointConfig.from_dict(config).enabled
    path = tmp_path / "c.json"
    path.write_text(json.dumps(config))
    assert build_config(path).enabled
    assert not build_config(flags={"--offload-attention": True}).enabled  # attention offload alone, as in patch()
    assert build_config().enabled  # no option at all: what the launcher is for


def test_an_offload_backend_with_checkpointing_off_loads_and_warns_instead_of_crashing(tmp_path):
    """`gradseam run --no-checkpointing --backend unsloth` crashed inside from_pretrained ("needs an engine")."""
    from diffusers import WanTransformer3DModel

    build(WAN).save_pretrained(tmp_path)
    warned.clear()
    config = {"gradient_checkpointing": False, "gradient_checkpointing_backend": "unsloth"}
    idle = "gradient_checkpointing_backend set but gradient_checkpointing is false"
    with pytest.warns(GradseamWarning, match=idle), gradseam.patching(config) as handles:
        model = WanTransformer3DModel.from_pretrained(tmp_path)
    assert [h.model for h in handles] == [model] and not handles[0].regions()
    assert_same_step(run_step(WanTransformer3DModel.from_pretrained(tmp_path), WAN), run_step(model, WAN))
