"""The built-in list of left-out classes (``gradseam.adapters.left_out``): patching one is refused with its
reason and leaves it untouched, and a pipeline holding one next to a supported model patches that model alone.

Anima's ``AnimaTextConditioner`` was on the list until family ``anima-text-conditioner`` claimed it (trainers
fine-tune it next to the transformer): it is off the list now, and an Anima-like pipeline patches both its
models. unCLIP's ``PriorTransformer``, still on the list, is the left-out class checked here."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradseam
from gradseam.adapters.left_out import LEFT_OUT
from gradseam.errors import UnsupportedModelError

ANIMA_CONDITIONER = "diffusers.models.condition_embedders.condition_embedder_anima.AnimaTextConditioner"
PRIOR = "diffusers.models.transformers.prior_transformer.PriorTransformer"
TRAIN = {"gradient_checkpointing": True}


def tiny_conditioner() -> nn.Module:
    from diffusers import AnimaTextConditioner

    torch.manual_seed(0)
    return AnimaTextConditioner(source_dim=8, target_dim=8, model_dim=8, num_layers=2, num_attention_heads=2,
                                target_vocab_size=16, min_sequence_length=6)


def tiny_prior() -> nn.Module:
    from diffusers import PriorTransformer

    torch.manual_seed(0)
    return PriorTransformer(num_attention_heads=2, attention_head_dim=4, num_layers=2, embedding_dim=8,
                            num_embeddings=4, additional_embeddings=4)


def tiny_cosmos() -> nn.Module:
    from diffusers import CosmosTransformer3DModel

    return CosmosTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=12, num_layers=2,
        text_embed_dim=8, adaln_lora_dim=8, max_size=(4, 8, 8), rope_scale=(1.0, 4.0, 4.0),
        concat_padding_mask=False, extra_pos_embed_type=None)


def instance_forwards(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if "forward" in m.__dict__]


class Pipe:
    """The components of a diffusers pipeline that matter to ``gradseam.patch``: ``components``."""

    def __init__(self, **models: nn.Module) -> None:
        self.models = models
        for name, model in models.items():
            setattr(self, name, model)

    @property
    def components(self) -> dict:
        return {**self.models, "scheduler": object()}


def test_the_anima_conditioner_has_a_family_and_is_off_the_list() -> None:
    from diffusers import AnimaTextConditioner

    assert f"{AnimaTextConditioner.__module__}.{AnimaTextConditioner.__qualname__}" == ANIMA_CONDITIONER
    assert ANIMA_CONDITIONER not in LEFT_OUT and ANIMA_CONDITIONER not in gradseam.unsupported_models()
    assert gradseam.registry.REGISTRY.for_model_type(AnimaTextConditioner).name == "anima-text-conditioner"


def test_patching_a_left_out_class_is_refused_with_its_reason() -> None:
    from diffusers import PriorTransformer

    assert f"{PriorTransformer.__module__}.{PriorTransformer.__qualname__}" == PRIOR
    assert gradseam.unsupported_models()[PRIOR] == LEFT_OUT[PRIOR]
    model = tiny_prior()
    with pytest.raises(UnsupportedModelError) as info:
        gradseam.patch(model, TRAIN)
    assert f"gradseam does not patch {PRIOR}: {LEFT_OUT[PRIOR]}." in str(info.value)
    assert gradseam.handle_of(model) is None and instance_forwards(model) == []


def test_a_pipeline_patches_the_model_next_to_a_left_out_one_alone() -> None:
    pipe = Pipe(prior=tiny_prior(), transformer=tiny_cosmos())
    with gradseam.patch(pipe, TRAIN) as handle:
        assert set(handle.handles) == {"transformer"}
        assert gradseam.handle_of(pipe.transformer) is handle["transformer"]
        assert gradseam.handle_of(pipe.prior) is None and instance_forwards(pipe.prior) == []


def test_an_anima_pipeline_patches_both_its_models() -> None:
    # the components of AnimaModularPipeline that are models: the conditioner and the Cosmos transformer
    pipe = Pipe(text_conditioner=tiny_conditioner(), transformer=tiny_cosmos())
    with gradseam.patch(pipe, TRAIN) as handle:
        assert set(handle.handles) == {"text_conditioner", "transformer"}
        assert handle["text_conditioner"].family.name == "anima-text-conditioner"
        assert handle["transformer"].family.name == "cosmos"
        assert gradseam.handle_of(pipe.text_conditioner) is handle["text_conditioner"]
    assert gradseam.handle_of(pipe.text_conditioner) is None and instance_forwards(pipe.text_conditioner) == []
