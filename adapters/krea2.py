"""Krea 2 (Krea2Transformer2DModel): a single-stream MMDiT plus a small text-fusion transformer.

Trunk: ``transformer_blocks``, each a ``Krea2TransformerBlock`` on the concatenated
``[text, image]`` sequence, called positionally as
``block(hidden_states, temb_mod, image_rotary_emb, attention_mask)`` and returning the new hidden
states. ``temb_mod``, the rotary table and the key-padding mask are the same objects for every
block, so interval chunks work. Attention is ``attn`` (grouped-query with a sigmoid output gate).
The FFN seam is ``("ff",)``, the SwiGLU: recomputing it drops the four ``intermediate_size``-wide
tensors (gate pre-activation, its SiLU, the up projection, their product) each block keeps, 16384
wide in the flagship. ``norm2`` cannot join the seam: its output is modulated (``(1 + scale) * x + shift``)
before ``ff`` sees it.

Text fusion: ``text_fusion.layerwise_blocks`` and ``text_fusion.refiner_blocks`` are also
patched. They are "small" only in parameters: the layerwise blocks attend across the tapped-layer
axis for every text token, i.e. over ``text_tokens x num_text_layers`` rows (512 x 12 = 6144 rows
of width 2560 with a 6912-wide SwiGLU in the flagship), more rows than the whole trunk sequence
at 1024² (4608): in bf16 a layerwise block keeps about 1.1 GB for backward against about 2.0 GB
for a trunk block (measured per row on the real widths). Their parameters train with the
transformer even when the text encoder is frozen, so those activations are kept unless
checkpointed. Patching them is exact and free of special cases: each block is a
plain pre-norm block returning its hidden states; the layerwise loop calls
``block(hidden_states.contiguous())``, which hands over the very tensor the previous block
returned (block outputs are contiguous), and the refiner loop passes the same mask to every
block, so both lists chunk too. In this block ``ff`` is called on exactly ``norm2``'s output
(there is no modulation), so the seam is ``norm2 -> ff``, which also drops the normalised copy.
"""

from __future__ import annotations

from gradseam.family import BlockClass, BlockList, Carry, Family, Preset
from gradseam.hookspecs import hookimpl
from gradseam.inputs import flux_ids

_M = "diffusers.models.transformers.transformer_krea2"
_HIDDEN = Carry({"hidden_states": None})


def make_inputs(model, device, dtype, tokens=None, *, image_tokens=4096, text_tokens=512) -> dict:
    """One real-size batch: packed latents (grad), the tapped text-encoder layers, position ids."""
    import torch


    cfg = model.config
    img_ids, txt_ids = flux_ids(text_tokens, tokens or image_tokens, device)
    return {
        "hidden_states": torch.randn(
            1, img_ids.shape[0], cfg.in_channels, device=device, dtype=dtype, requires_grad=True
        ),
        "encoder_hidden_states": torch.randn(
            1, text_tokens, cfg.num_text_layers, cfg.text_hidden_dim, device=device, dtype=dtype
        ),
        "timestep": torch.full((1,), 0.7, device=device, dtype=dtype),
        "position_ids": torch.cat([txt_ids, img_ids]).long(),
    }

KREA2 = Family(
    name="krea2",
    description="Krea 2 text-to-image (Krea2Transformer2DModel), incl. its text-fusion blocks",
    models=(f"{_M}.Krea2Transformer2DModel",),
    block_lists=(
        BlockList("text_fusion.layerwise_blocks", carry=_HIDDEN),
        BlockList("text_fusion.refiner_blocks", carry=_HIDDEN),
        BlockList("transformer_blocks", carry=_HIDDEN),
    ),
    block_classes=(
        BlockClass(f"{_M}.Krea2TransformerBlock", ffn=(("ff",),), attention=("attn",)),
        BlockClass(f"{_M}.Krea2TextFusionBlock", ffn=(("norm2", "ff"),), attention=("attn",)),
    ),
    presets={
        "1024": Preset(
            "Krea 2 (28 blocks, 48 q / 12 kv heads x 128, SwiGLU 16384; text fusion 2 + 2 blocks over "
            "12 tapped layers of width 2560) at 1024x1024 (4096 image + 512 text tokens)",
            config={},  # the class defaults are the flagship config
            inputs={"image_tokens": 4096, "text_tokens": 512},
            make_inputs=make_inputs,
        ),
    },
)


@hookimpl
def register_families(register):
    register(KREA2)
