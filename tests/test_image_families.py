"""Chroma, Krea 2 and Z-Image beyond the conformance suite (tests/test_conformance.py runs every
strategy on them): their optional inputs really reach the patched path, Chroma's mask survives
where the built-in flag drops it, and the presets plan at full size."""

from __future__ import annotations

import warnings

import pytest
import torch
from cases_image import (
    CHROMA,
    CHROMA_MASKED,
    KREA2,
    KREA2_MASKED,
    ZIMAGE,
    ZIMAGE_BATCH,
    ZIMAGE_OMNI,
)
from family_checks import assert_chunks_chain_without_fallback

import gradseam
from gradseam.errors import GradseamWarning
from gradseam.patcher import family_for
from gradseam.planning import plan
from gradseam.testing import Case, assert_same_step, config_id, run_step


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # These models are a few hundred tokens wide: intra-op threads only add synchronisation, and
    # on a busy 2-core machine OpenMP spinning made the file several times slower. Reference and
    # patched runs share the setting, so exactness is unaffected.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _output(model: torch.nn.Module, case: Case) -> torch.Tensor:
    with torch.no_grad():
        out = case.output(model(**case.inputs(torch.Generator().manual_seed(1))))
        return torch.cat([o.flatten() for o in (out if isinstance(out, tuple) else (out,))])


@pytest.mark.parametrize(("masked", "plain"), [(CHROMA_MASKED, CHROMA), (KREA2_MASKED, KREA2)], ids=["chroma", "krea2"])
def test_masked_cases_exercise_the_mask(masked: Case, plain: Case) -> None:
    # Otherwise the masked parity runs would prove nothing about masks reaching the blocks.
    model = masked.fresh()
    assert not torch.equal(_output(model, masked), _output(model, plain))


def _masks_seen(case: Case) -> dict[str, bool]:
    """For each Z-Image block list the forward ran: whether its first block got an attention mask."""
    model = case.fresh()
    seen: dict[str, bool] = {}
    for name in ("noise_refiner", "context_refiner", "siglip_refiner", "layers"):
        blocks = getattr(model, name)
        if blocks is not None:
            blocks[0].register_forward_pre_hook(
                lambda _m, args, name=name: seen.__setitem__(name, args[1] is not None)
            )
    _output(model, case)
    return seen


def test_zimage_cases_exercise_padding_masks_and_siglip() -> None:
    # Batched samples of different lengths are padded, so the blocks receive a mask; the Omni case
    # must actually run the SigLIP refiner, and the plain case must leave it out (optional list).
    assert _masks_seen(ZIMAGE_BATCH) == {
        "noise_refiner": True, "context_refiner": True, "layers": True,
    }
    assert "siglip_refiner" in _masks_seen(ZIMAGE_OMNI)
    assert set(_masks_seen(ZIMAGE)) == {"noise_refiner", "context_refiner", "layers"}


# -- Chroma and diffusers' own checkpointing flag -----------------------------------------------


def test_chroma_builtin_flag_drops_the_mask_but_gradseam_does_not() -> None:
    model = CHROMA_MASKED.fresh()
    reference = run_step(model, CHROMA_MASKED)

    # diffusers 0.42.1 calls single blocks as (hidden_states, temb, image_rotary_emb) under the
    # flag, so the mask never reaches them and the output changes.
    model.enable_gradient_checkpointing()
    builtin = run_step(model, CHROMA_MASKED)
    model.disable_gradient_checkpointing()
    assert not torch.equal(builtin.outputs[0], reference.outputs[0])
    # ...and what it computes is exactly the model with no mask in its single blocks.
    unmasked_single = CHROMA_MASKED.fresh()

    def drop_mask(_module, args, kwargs):
        return args, {**kwargs, "attention_mask": None}

    for block in unmasked_single.single_transformer_blocks:
        block.register_forward_pre_hook(drop_mask, with_kwargs=True)
    assert torch.equal(builtin.outputs[0], run_step(unmasked_single, CHROMA_MASKED).outputs[0])

    with gradseam.patch(model, gradient_checkpointing=True):
        assert_same_step(reference, run_step(model, CHROMA_MASKED), what="gradseam with mask")


@pytest.mark.parametrize(
    "config",
    [{"gradient_checkpointing": True}, {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch-ffn"}],
    ids=config_id,
)
def test_chroma_flag_enabled_before_patch_is_overridden(config: dict) -> None:
    model = CHROMA_MASKED.fresh()
    reference = run_step(model, CHROMA_MASKED)
    model.enable_gradient_checkpointing()
    handle = gradseam.patch(model, config)
    try:
        assert model.gradient_checkpointing is False
        assert_same_step(reference, run_step(model, CHROMA_MASKED), what="flag on, then patched")
    finally:
        handle.remove()
    assert model.gradient_checkpointing is True  # the user's setting comes back with remove()


def test_chroma_declines_interval_chunks() -> None:
    # Each Chroma block gets its own temb slice, built by the model loop only right before the
    # call, so chunks are impossible; gradseam must say so rather than chunk wrongly.
    model = CHROMA.fresh()
    family = family_for(model)
    assert not family.supports_interval
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = gradseam.patch(model, gradient_checkpointing=True, gradient_checkpointing_interval=2)
    handle.remove()
    assert any(issubclass(w.category, GradseamWarning) and "interval" in str(w.message) for w in caught)
    assert all(r.shape == "block" for r in handle.plan.regions)


# -- Interval chunks really chain (no fallback) where the adapters claim they do ----------------


@pytest.mark.parametrize(
    ("case", "lists"),
    [
        (KREA2_MASKED, ("text_fusion.layerwise_blocks", "text_fusion.refiner_blocks", "transformer_blocks")),
        (ZIMAGE_BATCH, ("noise_refiner", "context_refiner", "layers")),
        (ZIMAGE_OMNI, ("noise_refiner", "context_refiner", "siglip_refiner", "layers")),
    ],
    ids=["krea2", "zimage-batch", "zimage-omni"],
)
def test_interval_chunks_chain_without_fallback(case: Case, lists: tuple[str, ...]) -> None:
    assert_chunks_chain_without_fallback(case, lists)


# -- Presets: the real-size configs build (on the meta device) and plan as documented ------------


@pytest.mark.parametrize(
    ("model_name", "expected"),
    [
        ("ChromaTransformer2DModel", {"transformer_blocks": 19, "single_transformer_blocks": 38}),
        (
            "Krea2Transformer2DModel",
            {"text_fusion.layerwise_blocks": 2, "text_fusion.refiner_blocks": 2, "transformer_blocks": 28},
        ),
        ("ZImageTransformer2DModel", {"noise_refiner": 2, "context_refiner": 2, "layers": 30}),
    ],
)
def test_presets_plan_at_full_size(model_name: str, expected: dict[str, int]) -> None:
    import diffusers

    cls = getattr(diffusers, model_name)
    with torch.device("meta"):
        probe = cls()
    family = family_for(probe)
    assert family.presets
    for preset in family.presets.values():
        with torch.device("meta"):
            model = cls(**preset.config)
        the_plan = plan(model, family, gradseam.CheckpointConfig.coerce(gradient_checkpointing=True))
        counts: dict[str, int] = {}
        for region in the_plan.regions:
            counts[region.list_path] = counts.get(region.list_path, 0) + len(region.blocks)
        assert counts == expected

