"""PEFT LoRA on patched models: patch before or after injection, same outputs, gradients and saved keys.

Two ways in: diffusers' ``model.add_adapter(LoraConfig)`` and PEFT's ``get_peft_model``. Both
replace every targeted ``nn.Linear`` by a LoRA layer that calls the original as ``base_layer``.
Whole-block seams and seams on FFN *containers* (``ff``, ``ffn``) are untouched by that; Flux's
single-block FFN seam starts at the ``proj_mlp`` Linear itself, which PEFT replaces: the handle
follows the replacement before the next forward (the seam moves to the LoRA layer, and back on
unload), so the chain keeps running as one region instead of falling back.
"""

from __future__ import annotations

import copy

import pytest
import torch
from cases import FLUX, WAN
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from peft.tuners.tuners_utils import BaseTunerLayer
from seam_probe import installed_seam

import gradseam
from gradseam.offload import cpu_test_mode
from gradseam.testing import assert_same_step, config_id, record_regions, run_step

TARGETS = {
    "flux": ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
             "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp", "proj_out"],
    "wan": ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"],
}
CONFIGS = [
    {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch"},
    {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch-ffn"},
    {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch", "gradient_checkpointing_interval": 2},
    {"gradient_checkpointing": True, "gradient_checkpointing_backend": "unsloth"},
    {"gradient_checkpointing": True, "gradient_checkpointing_backend": "unsloth-ffn",
     "gradient_checkpointing_offload_attention": True},
    {"gradient_checkpointing": True, "gradient_checkpointing_keep_attention": True},
    {"gradient_checkpointing": True, "gradient_checkpointing_backend": "unsloth",
     "gradient_checkpointing_offload_attention": True, "gradient_checkpointing_interval": 2},
]


def _lora_config(case) -> LoraConfig:
    # gaussian init: lora_B is not zero, so every LoRA parameter gets a non-trivial gradient
    return LoraConfig(r=4, lora_alpha=4, target_modules=TARGETS[case.name], init_lora_weights="gaussian")


def _base(case) -> torch.nn.Module:
    torch.manual_seed(case.seed)
    return case.build().requires_grad_(False)  # LoRA training: the base is frozen


def _inject(case, model, how):
    torch.manual_seed(123)  # same LoRA init in every variant
    if how == "add_adapter":
        model.add_adapter(_lora_config(case))
        return model
    return get_peft_model(model, _lora_config(case))


def _patched_lora(case, base, how, when, config):
    model = copy.deepcopy(base)
    if when == "before":
        handle = gradseam.patch(model, config)
        top = _inject(case, model, how)
    else:
        top = _inject(case, model, how)
        handle = gradseam.patch(model, config)  # the diffusers model inside a PeftModel
    return model, top, handle


MATRIX = [(case, how, when, cfg) for case in (FLUX, WAN) for how in ("add_adapter", "get_peft_model")
          for when in ("before", "after") for cfg in CONFIGS]


@pytest.mark.parametrize(
    ("case", "how", "when", "config"), MATRIX, ids=[f"{c.name}-{h}-{w}-{config_id(k)}" for c, h, w, k in MATRIX]
)
def test_lora_outputs_and_gradients_match_unpatched(case, how, when, config):
    base = _base(case)
    reference = run_step(_inject(case, copy.deepcopy(base), how), case)
    assert reference.param_grads and all("lora_" in n for n in reference.param_grads)
    with cpu_test_mode():
        model, top, handle = _patched_lora(case, base, how, when, config)
        patched = run_step(top, case)
        with record_regions(handle) as regions:
            second = run_step(top, case)
    what = f"{case.name} LoRA via {how}, patched {when} injection, {config_id(config)}"
    assert_same_step(reference, patched, what=what)
    assert_same_step(reference, second, what=what + " (step 2)")
    assert patched.saved_bytes < reference.saved_bytes
    assert regions and not [r.label for r in regions if r.fallbacks], f"{what}: a chain fell back"
    handle.remove()
    assert_same_step(reference, run_step(top, case), what=what + " after remove()")
    assert not [n for n, m in model.named_modules() if installed_seam(m) is not None]


@pytest.mark.parametrize("when", ["before", "after"])
def test_flux_single_block_ffn_seam_sits_on_the_lora_layer(when):
    base = _base(FLUX)
    reference = run_step(base, FLUX)  # plain model, no LoRA
    model, top, handle = _patched_lora(FLUX, base, "add_adapter", when, CONFIGS[1])
    run_step(top, FLUX)  # before injection-time patches, the first forward moves the seam
    for block in model.single_transformer_blocks:
        assert isinstance(block.proj_mlp, BaseTunerLayer)
        assert installed_seam(block.proj_mlp) is not None
        assert installed_seam(block.proj_mlp.base_layer) is None
    for block in model.transformer_blocks:  # FFN containers: the seam never moved
        assert installed_seam(block.ff) is not None and not isinstance(block.ff, BaseTunerLayer)
    # unloading the LoRA layers puts the plain Linear back: the seam follows it back
    model.unload_lora()
    after_unload = run_step(model, FLUX)
    assert_same_step(reference, after_unload, what="after unload_lora()")
    for block in model.single_transformer_blocks:
        assert isinstance(block.proj_mlp, torch.nn.Linear) and installed_seam(block.proj_mlp) is not None
    handle.remove()
    assert not [n for n, m in model.named_modules() if installed_seam(m) is not None]


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("case", [FLUX, WAN], ids=lambda c: c.name)
def test_saved_lora_weights_have_the_same_keys(case, when, tmp_path):
    from safetensors.torch import load_file

    base = _base(case)
    plain = _inject(case, copy.deepcopy(base), "add_adapter")
    model, _, handle = _patched_lora(case, base, "add_adapter", when, CONFIGS[1])
    run_step(model, case)  # a forward: the handle has followed any replaced submodule
    expected = get_peft_model_state_dict(plain)
    got = get_peft_model_state_dict(model)
    assert list(got) == list(expected) and all(torch.equal(got[k], expected[k]) for k in expected)
    assert list(model.state_dict()) == list(plain.state_dict())
    plain.save_lora_adapter(tmp_path / "plain")
    model.save_lora_adapter(tmp_path / "patched")
    a = load_file(tmp_path / "plain" / "pytorch_lora_weights.safetensors")
    b = load_file(tmp_path / "patched" / "pytorch_lora_weights.safetensors")
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    # PEFT's own wrapper too
    peft_plain = _inject(case, copy.deepcopy(base), "get_peft_model")
    _, peft_model, _ = _patched_lora(case, base, "get_peft_model", when, CONFIGS[1])
    assert list(get_peft_model_state_dict(peft_model)) == list(get_peft_model_state_dict(peft_plain))
    handle.remove()
