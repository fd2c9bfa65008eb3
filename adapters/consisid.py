"""ConsisID identity-preserving text-to-video (diffusers' ``ConsisIDTransformer3DModel``): a CogVideoX-5B-I2V
trunk with face modules, ConsisID-preview's transformer.

One block list, ``transformer_blocks``, of ``ConsisIDBlock`` s, ConsisID's own copy of the CogVideoX
expert-adaLN block: text and video tokens as two streams of one sequence, each modulated by ``norm1`` with
its own shift, scale and gate, meeting in the joint attention ``attn1``, modulated again by ``norm2``, then
one ``ff`` over both. The block returns ``(hidden_states, encoder_hidden_states)``. The loop calls every
block by keyword with ``temb=emb`` (the timestep embedding, made once) and the caller's RoPE tuple.

**No carry.** With ``is_train_face`` (every ConsisID checkpoint; the pipeline then must pass the face
inputs, or the model fails) the loop runs ``local_facial_extractor`` once before the blocks, turning the
face embedding and the EVA-CLIP hidden states into 32 face tokens, and after block ``i`` for every ``i``
divisible by ``cross_attn_interval`` (2 in the released model: blocks 0, 2, 4, ..., 40) adds
``local_face_scale * perceiver_cross_attention[k](face_tokens, hidden_states)`` to the video stream before
the next block sees it. An interval chunk whose first block (or any block but its last) is followed by such
an injection cannot run whole: its next block gets a tensor other than the one its predecessor returned,
and computes alone (exact, but its later blocks were computed twice in forward). With the released
interval of 2 that is every chunk, whatever the interval: chunks start at multiples of it, so a chunk of
two starts at an even block, which an injection follows, and a longer chunk always holds an even block
other than its last. Whole chunks would have to start at odd blocks, an offset the interval cannot
express. So the list declares no carry, is checkpointed block by block, and
``gradient_checkpointing_interval`` is ignored, with a warning. (A config without ``is_train_face`` would
chunk, but no checkpoint has one.)

**The perceiver cross-attentions are not patched.** Each ``PerceiverCrossAttention`` (LayerNorms of both
inputs, ``to_q`` over the video tokens, ``to_kv`` over the 32 face tokens, an attention written out as two
matmuls and a float32 softmax, ``to_out``) runs between two blocks, outside every region, like the facial
extractor before the loop. Declaring ``perceiver_cross_attention`` as a block list would need a block class
for it: one without an FFN seam (it has no MLP), which would refuse the ``-ffn`` backends for the whole
family, and without an attention side (its attention, two matmuls and a softmax in the module's own
forward, is no kernel gradseam recognises and sits in no submodule), which would refuse attention offload
too. So whole-block
backends keep their activations. A trained perceiver keeps its input and normed input (``tokens x 3072``
each), the scaled query and the attention output (``tokens x 2048`` each) and the softmax (``tokens x 16 x
32``, in float32 and again in the model's dtype): about 3.5 block inputs' worth (a little more in bf16, where
the float32 softmax counts double), so the 21 perceivers keep nearly twice what the 42 checkpointed block
inputs do. Frozen (a LoRA on the blocks), a perceiver keeps its input and the softmax, about 1.2 block
inputs.

FFN seam ``("ff",)``: the block calls ``ff`` once, on ``cat([norm_encoder_hidden_states,
norm_hidden_states])`` (the two ``norm2``-modulated streams, a fresh tensor), and only slices, gates and
adds its return value outside it; recomputing it drops the 4·d-wide tanh-GELU activations of every token.
``norm2`` cannot join (it returns four tensors, and the concatenation sits between it and ``ff``). The
blocks build ``ff`` with a final dropout at the model's ``dropout``, 0.0 in the released config, which
draws no random numbers.

Attention side: ``attn1`` (diffusers' ``Attention`` with ``CogVideoXAttnProcessor2_0``: the joint QKV
projections, the QK LayerNorms, the RoPE on the video part and one SDPA call).
"""

from __future__ import annotations

from typing import Any

from gradseam.family import BlockClass, BlockList, Family, Preset
from gradseam.hookspecs import hookimpl
from gradseam.inputs import tensor_maker, video_latent_size

_M = "diffusers.models.transformers.consisid_transformer_3d"

# EVA02-CLIP-L-14-336 hidden states of the aligned face crop, one per extracted layer: 24 x 24 patches + CLS.
VIT_TOKENS = 577


def rotary_embedding(model: Any, frames: int, grid_h: int, grid_w: int, device: Any) -> tuple[Any, Any]:
    """The ``image_rotary_emb`` ``ConsisIDPipeline`` builds for ``frames`` latent frames on a ``grid_h x
    grid_w`` patch grid: ``(cos, sin)``, each ``(tokens, attention_head_dim)``, the grid spread over the part
    of the training grid (``sample_height/width // patch_size``) it covers after a resize-and-center-crop."""
    from diffusers.models.embeddings import get_3d_rotary_pos_embed
    from diffusers.pipelines.consisid.pipeline_consisid import get_resize_crop_region_for_grid

    cfg = model.config
    crops = get_resize_crop_region_for_grid((grid_h, grid_w), cfg.sample_width // cfg.patch_size,
                                            cfg.sample_height // cfg.patch_size)
    return get_3d_rotary_pos_embed(cfg.attention_head_dim, crops, (grid_h, grid_w), frames, device=device)


def make_inputs(
    model: Any, device: Any, dtype: Any, tokens: int | None = None, *, frames: int = 49, height: int = 480,
    width: int = 720, text_tokens: int | None = None, vit_tokens: int = VIT_TOKENS,
) -> dict:
    """One real-size batch as ``ConsisIDPipeline`` (and ConsisID's training script) feed the transformer: the
    latent video ``(1, (frames-1)/4+1, C, H/8, W/8)`` (grad; frames first, the 32 channels being the noisy
    latents and the face image's latents, zero-padded after the first frame), T5-XXL states padded to
    ``max_text_seq_length`` (226) tokens, an integer timestep (500) and the RoPE table; with ``is_train_face``
    the face inputs: ``id_cond`` (the antelopev2 embedding and the EVA-CLIP image embedding, ``LFE_id_dim``
    wide) and ``id_vit_hidden`` (``LFE_num_scale`` EVA-CLIP hidden states, ``(1, vit_tokens, LFE_vit_dim)``).

    ``tokens`` overrides the video token count by changing the number of latent frames (the learned
    positional embedding fixes the picture size, not the frame count).
    """
    import torch

    cfg = model.config
    t, h, w = video_latent_size(frames, height, width, patch=(1, cfg.patch_size, cfg.patch_size), tokens=tokens)
    randn = tensor_maker(device, dtype)
    inputs = {
        "hidden_states": randn(1, t, cfg.in_channels, h, w, grad=True),
        "encoder_hidden_states": randn(1, text_tokens or cfg.max_text_seq_length, cfg.text_embed_dim),
        "timestep": torch.full((1,), 500, device=device, dtype=torch.int64),
    }
    if cfg.use_rotary_positional_embeddings:
        inputs["image_rotary_emb"] = rotary_embedding(model, t, h // cfg.patch_size, w // cfg.patch_size, device)
    if cfg.is_train_face:
        inputs["id_cond"] = randn(1, cfg.LFE_id_dim)
        inputs["id_vit_hidden"] = [randn(1, vit_tokens, cfg.LFE_vit_dim) for _ in range(cfg.LFE_num_scale)]
    return inputs


# BestWishYsh/ConsisID-preview: ConsisID is trained from CogVideoX-5B-I2V, so its trunk is that config (42
# blocks of 48 x 64 heads, FFN 12288, 3-D RoPE and the learned positional embedding of the 720x480, 49-frame
# training size; 32 input channels: the noisy and the image latents). Its face modules are diffusers' class
# defaults (the checkpoint's own config and the training script's defaults could not be read here): a
# 10-layer local facial extractor over 5 EVA-CLIP scales giving 32 face tokens 2048 wide, and a perceiver
# cross-attention (16 x 128 heads) after every second block.
# 6.16B parameters, 0.44B of them in the 21 perceivers.
CONSISID_PREVIEW = {
    "num_attention_heads": 48, "attention_head_dim": 64, "in_channels": 32, "out_channels": 16,
    "time_embed_dim": 512, "text_embed_dim": 4096, "num_layers": 42, "dropout": 0.0, "attention_bias": True,
    "sample_width": 90, "sample_height": 60, "sample_frames": 49, "patch_size": 2, "temporal_compression_ratio": 4,
    "max_text_seq_length": 226, "use_rotary_positional_embeddings": True,
    "use_learned_positional_embeddings": True, "is_train_face": True, "is_kps": False, "cross_attn_interval": 2,
    "cross_attn_dim_head": 128, "cross_attn_num_heads": 16, "LFE_id_dim": 1280, "LFE_vit_dim": 1024,
    "LFE_depth": 10, "LFE_dim_head": 64, "LFE_num_heads": 16, "LFE_num_id_token": 5, "LFE_num_querie": 32,
    "LFE_output_dim": 2048, "LFE_ff_mult": 4, "LFE_num_scale": 5, "local_face_scale": 1.0,
}

CONSISID = Family(
    name="consisid",
    description="ConsisID identity-preserving text-to-video, a CogVideoX trunk (ConsisIDTransformer3DModel)",
    models=(f"{_M}.ConsisIDTransformer3DModel",),
    block_lists=(BlockList("transformer_blocks"),),  # no carry: face residuals between blocks (see above)
    block_classes=(BlockClass(f"{_M}.ConsisIDBlock", ffn=(("ff",),), attention=("attn1",)),),
    presets={
        "preview-480p": Preset(
            "ConsisID-preview (CogVideoX-5B-I2V trunk: 42 blocks, 48 x 64 heads, FFN 12288; face extractor and 21 "
            "perceiver cross-attentions) at 720x480, 49 frames (13 x 30 x 45 = 17550 video tokens, 226 text "
            "tokens, 32 face tokens)",
            config=CONSISID_PREVIEW,
            inputs={"frames": 49, "height": 480, "width": 720},
            make_inputs=make_inputs,
        ),
    },
)


@hookimpl
def register_families(register: Any) -> None:
    register(CONSISID)
