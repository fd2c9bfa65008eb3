"""Load-time patching (``gradseam.patching``) and ``gradseam.handles``, with real save/load round trips."""

from __future__ import annotations

import threading

import pytest
import torch
from cases import FLUX, WAN
from diffusers import (
    AutoencoderKL,
    DiffusionPipeline,
    FlowMatchEulerDiscreteScheduler,
    FluxTransformer2DModel,
)
from safetensors.torch import save_file

import gradseam
from gradseam.loading import LOADERS
from gradseam.testing import assert_same_step, run_step

TORCH = {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch"}
FFN = {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch-ffn"}


def _loader_attrs() -> dict[tuple[str, str], object]:
    import importlib

    out = {}
    for module, cls, attr in LOADERS:
        owner = getattr(importlib.import_module(module), cls)
        out[(cls, attr)] = owner.__dict__[attr]
    return out


@pytest.fixture
def loaders_untouched():
    before = _loader_attrs()
    yield before
    after = _loader_attrs()
    assert all(after[k] is before[k] for k in before), "a loader was not restored to the exact same object"


class TinyPipeline(DiffusionPipeline):
    """A minimal real pipeline: a transformer, a scheduler and a model no family handles."""

    def __init__(self, transformer, scheduler, vae):
        super().__init__()
        self.register_modules(transformer=transformer, scheduler=scheduler, vae=vae)


def _tiny_vae() -> AutoencoderKL:
    return AutoencoderKL(
        block_out_channels=(8,), layers_per_block=1, latent_channels=4, norm_num_groups=8,
        down_block_types=("DownEncoderBlock2D",), up_block_types=("UpDecoderBlock2D",),
    )


def _saved(case, tmp_path):
    torch.manual_seed(case.seed)
    model = case.build()
    model.save_pretrained(tmp_path / case.name)
    return model, tmp_path / case.name


# Every reference below is a plain load of the same files with the same loader, never the in-memory
# model that was saved: a loaded tensor's memory alignment differs from the original's, and on some
# machines that alone changes CPU matmul rounding (a reload without gradseam already differed by
# ~2.4e-7), while two loads of one file compute bit for bit alike.


@pytest.mark.parametrize("config", [TORCH, FFN], ids=["torch", "torch-ffn"])
@pytest.mark.parametrize("case", [FLUX, WAN], ids=lambda c: c.name)
def test_loaded_model_is_patched_and_exact(case, config, tmp_path, loaders_untouched):
    original, path = _saved(case, tmp_path)
    cls = type(original)
    plain = cls.from_pretrained(path)  # loaded outside the block: the reference, and untouched
    assert gradseam.handle_of(plain) is None
    reference = run_step(plain, case)
    with gradseam.patching(config) as made:
        assert any(_loader_attrs()[k] is not v for k, v in loaders_untouched.items())
        model = cls.from_pretrained(path)
    handle = gradseam.handle_of(model)
    assert handle is not None and handle.active and made == [handle]
    assert handle.config == gradseam.CheckpointConfig.coerce(config)
    assert gradseam.handles(model) is handle
    patched = run_step(model, case)
    assert_same_step(reference, patched, what=f"{case.name} loaded in patching()")
    assert patched.saved_bytes < reference.saved_bytes
    assert gradseam.handle_of(cls.from_pretrained(path)) is None  # loaded after the block: untouched
    handle.remove()
    assert gradseam.handles(model) is None
    assert_same_step(reference, run_step(model, case), what="after remove()")


def test_loaders_restored_even_when_the_block_raises(tmp_path, loaders_untouched):
    _, path = _saved(FLUX, tmp_path)
    with pytest.raises(RuntimeError, match="boom"), gradseam.patching(TORCH):
        model = FluxTransformer2DModel.from_pretrained(path)
        raise RuntimeError("boom")
    assert gradseam.handle_of(model) is not None  # models keep their patches
    assert all(_loader_attrs()[k] is v for k, v in loaders_untouched.items())


def test_bad_config_raises_before_wrapping(loaders_untouched):
    with pytest.raises(ValueError, match="gradient_checkpointing_backend"), gradseam.patching(
        gradient_checkpointing=True, gradient_checkpointing_backend="torch_fnn"
    ):
        pass


def test_nested_blocks_use_the_innermost_config(tmp_path, loaders_untouched):
    _, path = _saved(FLUX, tmp_path)
    with gradseam.patching(TORCH):
        with gradseam.patching(FFN):
            inner = FluxTransformer2DModel.from_pretrained(path)
        outer = FluxTransformer2DModel.from_pretrained(path)
        assert any(_loader_attrs()[k] is not v for k, v in loaders_untouched.items())  # still wrapped
    after = FluxTransformer2DModel.from_pretrained(path)
    assert gradseam.handle_of(inner).config.backend == "torch-ffn"
    assert gradseam.handle_of(outer).config.backend == "torch"
    assert gradseam.handle_of(after) is None


def test_other_threads_are_not_patched(tmp_path, loaders_untouched):
    _, path = _saved(FLUX, tmp_path)
    loaded = {}
    with gradseam.patching(TORCH):
        worker = threading.Thread(target=lambda: loaded.setdefault("other", FluxTransformer2DModel.from_pretrained(path)))
        worker.start()
        worker.join()
        mine = FluxTransformer2DModel.from_pretrained(path)
    assert gradseam.handle_of(loaded["other"]) is None
    assert gradseam.handle_of(mine) is not None


def test_from_single_file_is_patched(tmp_path, loaders_untouched):
    original, path = _saved(FLUX, tmp_path)
    file = tmp_path / "flux.safetensors"
    save_file({k: v.contiguous() for k, v in original.state_dict().items()}, str(file))
    plain = FluxTransformer2DModel.from_single_file(str(file), config=str(tmp_path), subfolder=FLUX.name)
    with gradseam.patching(FFN):
        model = FluxTransformer2DModel.from_single_file(str(file), config=str(tmp_path), subfolder=FLUX.name)
    assert gradseam.handle_of(model).config.backend == "torch-ffn"
    assert gradseam.handle_of(plain) is None
    assert_same_step(run_step(plain, FLUX), run_step(model, FLUX))


def test_pipeline_load_patches_only_handled_components(tmp_path, loaders_untouched):
    original, _ = _saved(FLUX, tmp_path)
    TinyPipeline(transformer=original, scheduler=FlowMatchEulerDiscreteScheduler(), vae=_tiny_vae()).save_pretrained(
        tmp_path / "pipe"
    )
    plain = TinyPipeline.from_pretrained(tmp_path / "pipe")
    with gradseam.patching(FFN) as made:
        pipe = TinyPipeline.from_pretrained(tmp_path / "pipe")
    assert gradseam.handles(plain) is None
    assert gradseam.handle_of(pipe.transformer) is not None and made == [gradseam.handle_of(pipe.transformer)]
    assert gradseam.handle_of(pipe.vae) is None  # no family handles a VAE: left alone, silently
    handles = gradseam.handles(pipe)
    assert list(handles.handles) == ["transformer"] and handles["transformer"] is made[0]
    assert_same_step(run_step(plain.transformer, FLUX), run_step(pipe.transformer, FLUX))
    handles.remove()
    assert gradseam.handles(pipe) is None


def test_on_patch_reports_each_model_as_it_is_patched(tmp_path, loaders_untouched):
    """``on_patch`` (used by ``gradseam run``) sees every handle at once, with its component name."""
    original, path = _saved(FLUX, tmp_path)
    TinyPipeline(transformer=original, scheduler=FlowMatchEulerDiscreteScheduler(), vae=_tiny_vae()).save_pretrained(
        tmp_path / "pipe"
    )
    seen = []

    def on_patch(handle, component):
        assert handle.active and gradseam.handle_of(handle.model) is handle  # already installed when called
        seen.append((handle, component))

    with gradseam.patching(FFN, on_patch=on_patch) as made:
        pipe = TinyPipeline.from_pretrained(tmp_path / "pipe")
        assert seen == [(made[0], "transformer")]
        model = FluxTransformer2DModel.from_pretrained(path)
    assert seen == [(made[0], "transformer"), (gradseam.handle_of(model), None)]
    assert made[0] is gradseam.handle_of(pipe.transformer) and made[1].config.backend == "torch-ffn"


def test_components_passed_in_stay_the_callers(tmp_path, loaders_untouched):
    original, _ = _saved(FLUX, tmp_path)
    scheduler = FlowMatchEulerDiscreteScheduler()
    TinyPipeline(transformer=original, scheduler=scheduler, vae=_tiny_vae()).save_pretrained(tmp_path / "pipe")
    mine = FLUX.build()
    with gradseam.patching(TORCH):
        pipe = TinyPipeline.from_pretrained(tmp_path / "pipe", transformer=mine)
    assert pipe.transformer is mine and gradseam.handle_of(mine) is None
    # composition: patch first, hand the model to the pipeline
    handle = gradseam.patch(FLUX.build(), FFN)
    pipe = TinyPipeline(transformer=handle.model, scheduler=scheduler, vae=pipe.vae)
    assert gradseam.handles(pipe)["transformer"] is handle


def test_offload_backend_at_load_time_waits_for_the_gpu(tmp_path, loaders_untouched):
    """Loaders build on the CPU: the device check is skipped, the engine moves nothing until .to('cuda')."""
    original, path = _saved(WAN, tmp_path)
    plain = type(original).from_pretrained(path)
    with gradseam.patching(gradient_checkpointing=True, gradient_checkpointing_backend="unsloth"):
        model = type(original).from_pretrained(path)
    handle = gradseam.handle_of(model)
    assert handle.config.backend == "unsloth" and handle.engine is not None
    assert_same_step(run_step(plain, WAN), run_step(model, WAN))
    assert handle.engine.copies == 0  # CPU tensors are never offloaded outside cpu_test_mode()
    with pytest.raises(gradseam.UnsupportedStrategyError, match="CUDA"):  # patch() itself still refuses
        gradseam.patch(original, handle.config)


def test_handles_rejects_other_objects():
    assert gradseam.handles(FLUX.build()) is None
    with pytest.raises(TypeError, match="model or pipeline"):
        gradseam.handles(object())


@pytest.mark.cuda
def test_cuda_offload_backend_loaded_on_cpu_offloads_after_moving(tmp_path):
    """The flow the load-time device-check skip is for: load on the CPU, move to the GPU, train."""
    from diffusers import WanTransformer3DModel

    from gradseam.testing import Case

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    WanTransformer3DModel(  # big enough that region inputs pass the engine's 1 MiB floor
        patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=64, in_channels=4, out_channels=4,
        text_dim=64, freq_dim=64, ffn_dim=512, num_layers=3, rope_max_seq_len=64,
    ).save_pretrained(tmp_path / "wan")

    def inputs(g):
        return {
            "hidden_states": torch.randn(1, 4, 4, 64, 64, generator=g).cuda().requires_grad_(),
            "timestep": torch.tensor([500]).cuda(),
            "encoder_hidden_states": torch.randn(1, 16, 64, generator=g).cuda().requires_grad_(),
        }

    case = Case("wan-cuda", lambda: None, inputs)
    plain = WanTransformer3DModel.from_pretrained(tmp_path / "wan").cuda()
    with gradseam.patching(gradient_checkpointing=True, gradient_checkpointing_backend="unsloth"):
        model = WanTransformer3DModel.from_pretrained(tmp_path / "wan")
    handle = gradseam.handle_of(model)
    model.cuda()
    reference, got = run_step(plain, case), run_step(model, case)
    assert_same_step(reference, got, atol=1e-6)  # the GPU attention backward is not bitwise repeatable
    assert handle.engine.copies > 0 and got.saved_bytes < reference.saved_bytes
