"""Model classes in diffusers that no gradseam family will handle, each with the reason a user reads.

Not a family: a plugin of the ``register_unsupported_models`` hook, so that patching one of these
raises :class:`gradseam.errors.UnsupportedModelError` with its reason instead of "no family handles it",
and ``gradseam families`` lists them. Only classes that should never get a family are here: a layer
that lives inside another model, an autoencoder, a wrapper without blocks of its own, a model outside
image, video and audio diffusion. A class still waiting for its family is not (issue 42 tracks those),
and a family that claims one of these classes, built in or from a plugin, wins over its entry here.
"""

from __future__ import annotations

from typing import Any

from gradseam.hookspecs import hookimpl

_T = "diffusers.models.transformers"

LEFT_OUT: dict[str, str] = {
    f"{_T}.prior_transformer.PriorTransformer":
        "the embedding prior of unCLIP, Kandinsky 2 and Shap-E, not a latent diffusion transformer; its sequences "
        "are a few dozen to a thousand tokens, so checkpointing it saves little",
    f"{_T}.transformer_2d.Transformer2DModel":
        "the legacy generic class: the spatial-transformer layer inside SD-style UNets; DiT and PixArt checkpoints "
        "saved under this name load as DiTTransformer2DModel / PixArtTransformer2DModel, which are the classes "
        "to patch",
    f"{_T}.transformer_temporal.TransformerTemporalModel":
        "a temporal-attention layer inside UNet video models; gradseam patches top-level transformers, not a "
        "UNet's parts",
    f"{_T}.transformer_2d_dreamlite.DreamLiteTransformer2DModel":
        "a cross-attention layer inside DreamLiteUNetModel, which is what the DreamLite pipelines run; gradseam "
        "patches top-level transformers, not a UNet's parts",
    "diffusers.models.autoencoders.autoencoder_longcat_audio_dit.LongCatAudioDiTVae":
        "the LongCat-AudioDiT autoencoder, not a transformer a trainer fine-tunes (its transformer is "
        "LongCatAudioDiTTransformer)",
    f"{_T}.transformer_rfd4_proteina.RFD4ProteinaTransformer":
        "a protein-structure denoiser (backbone coordinates, pair features, triangle updates), outside image, "
        "video and audio diffusion",
    "diffusers.models.controlnets.controlnet_hunyuan.HunyuanDiT2DControlNetModel":
        "a ControlNet (gradseam has no ControlNet families yet; its blocks are HunyuanDiT's, so a plugin "
        "family could claim it)",
    "diffusers.models.controlnets.controlnet_hunyuan.HunyuanDiT2DMultiControlNetModel":
        "a wrapper summing several HunyuanDiT2DControlNetModel outputs, with no blocks of its own",
}


@hookimpl
def register_unsupported_models(register: Any) -> None:
    for model, reason in LEFT_OUT.items():
        register(model, reason)
