"""SANA-WM, the camera-controlled world model: diffusers' ``SanaWMTransformer3DModel`` (family ``sana-wm``,
the stage-1 DiT the release calls 1600M) and ``SanaWMLTX2RefinerTransformer3DModel`` (family ``sana-wm-refiner``, the stage-2
LTX-2 refiner run video-only over a sliding-window KV cache). Both run on LTX-2 VAE latents.

**sana-wm.** One list, ``blocks``, of ``SanaVideoMSCamCtrlBlock`` s (20 in the release). Every
``softmax_every_n``-th block's ``attn`` is the softmax variant (``_SoftmaxUCPESinglePathLiteLA``), the others
the bidirectional gated-delta-net linear attention (``BidirectionalGDNUCPESinglePathLiteLA``); the block class
is the same, and both variants carry the UCPE camera branch inside ``attn``. The model's loop calls every
block positionally as ``block(x, y, t0, y_lens, (T, H, W), rope, block_mask, camera_conditions,
ucpe_ray_transforms, plucker_emb, frame_valid_mask, chunk_size)`` and keeps its return value as the next
``x``. The prompt states, the adaLN tensor ``t0``, the text mask, the complex RoPE table, the raw camera
conditions, the UCPE ray transforms (one tuple, built once), the embedded Plücker map, the frame mask and
``chunk_size`` are computed before the loop and are the same objects for every block; the layout ``(T, H,
W)`` is a fresh tuple per call but of equal ints, and ``block_mask`` is always ``None`` (the loop's ``if i > 1``
only chooses between ``None`` and ``None``). Nothing happens between blocks, so the list carries
``{"x": None}`` and interval chunks run whole.

FFN seam: ``mlp`` (``GLUMBConvTemp``: a 1x1 inverted convolution to ``2·mlp_ratio·d`` channels, a depthwise
3x3 convolution, the SiLU gate, a 1x1 point convolution, then a temporal convolution added as a residual, all
inside the module). The block calls it as ``mlp(x_mlp_in, HW=THW)``: ``x_mlp_in`` is a fresh tensor (the
``norm2`` output scaled and shifted per frame, masked by the frame mask when one is given) that nothing else
reads, and its return value is only reshaped, gated, masked and added to the residual. The keyword is no
obstacle: a seam of one module is one checkpointed call of that module with the arguments the block gave it
(a keyword included); only a *later* member of a longer seam must take the previous one's output alone.
Recomputing it drops the ``6·d``-wide (13440 channels at full size) activations of the inverted and depthwise
convolutions, the gate's SiLU and product. ``norm2`` cannot join: its output is modulated first.

Attention side: ``attn`` (the fused QKV, short temporal convolutions, Q/K norms, the GDN recurrence or the
softmax SDPA, the camera branch with its own projections and its UCPE transforms or its SDPA, the shared output
gate and projection: every layer call lives in this module's forward and its two parameter-free children) and
``cross_attn`` (``MultiHeadCrossAttention`` to the Gemma-2 prompt, one dispatched SDPA). The GDN recurrence is
matmuls, not a scaled-dot-product operator, so inside whole-block regions it is recomputed like any other op;
only the softmax blocks' two kernels and the cross-attention's are kept by the keep/offload-attention options.
Blocks built with the Plücker post-attention projection (``plucker_proj``, every block in the release) apply it
between the two attentions; it is a plain ``Linear`` on the shared Plücker embedding and belongs to neither side.

**sana-wm-refiner.** One list, ``transformer_blocks``, of ``SanaWMLTX2RefinerTransformerBlock`` s (LTX-2's
block, 48 with LTX-2's config, with LTX-2's submodules so its checkpoints load; only the video stream runs:
``audio_attn1/2``, ``audio_ff``, ``audio_to_video_attn`` and ``video_to_audio_attn`` exist but are never
called). The loop calls each block by keyword with ``hidden_states``, ``encoder_hidden_states``, ``temb``,
``video_rotary_emb``, ``encoder_attention_mask``, ``sink_rotary_emb``, ``kv_cache`` and ``kv_cache_mode``, and
each block returns the new ``hidden_states``: ``Carry({"hidden_states": None})``. Everything but ``kv_cache`` is
one object (or one string) for every block.

``kv_cache`` is ``kv_cache.get(i)``: each block's own ``SanaWMRefinerKVLayerCache``. Its self-attention reads
the layer's attention-sink and recent-history K/V (``"inject"`` modes) and, in the capture modes, *overwrites*
a readback slot of that layer with detached clones of its current K/V. A chunk running its later blocks ahead
with the first block's arguments would hand them the first block's layer, so the list declares
``per_block=("kv_cache",)``: whenever a cache is passed, a chunk computes block by block (a counted fall-back)
and each layer is the unpatched model's; without a cache the chunks run whole. A block recomputed in backward
gets the same layer again: the inject modes read the K/V they read in forward (what they read is checked
unchanged before a recompute runs: a history replaced before backward is refused with an error, never silently
recomputed from the new values), and a capture mode overwrites its slot with clones equal to the first ones
(it stores, it never appends).

The one trace a recompute can leave is in such a slot. gradseam notes what a state argument holds when the
block is called; a ``"capture_pre_rope"`` forward into a fresh cache (the pipeline's sink seeding) finds the
layer empty, so there is nothing to check: read back with ``get_captured_pre_rope()`` (which empties the slot)
*before* backward, the slot holds the recomputed clones again after backward, equal to what was read (outputs
and gradients exact; the unpatched model's slot stays empty). In ``"inject_and_capture_post_rope"`` the layer
already holds the sink and history, so reading the slot back before backward is refused like any other
rewrite. The pipeline runs every capture forward without gradients, where nothing is recomputed.

FFN seam: ``ff`` (LTX-2's tanh-GELU ``FeedForward``, 4·d wide), called on exactly ``norm3``'s output scaled and
shifted (a fresh tensor), its return value only gated and added to the residual; ``norm3`` cannot join. Attention
side: ``attn1`` (the cache-aware self-attention over ``[sink, history, current]`` K/V, one SDPA) and ``attn2``
(the prompt cross-attention). The refiner has no checkpointing flag of its own (``enable_gradient_checkpointing``
refuses it), so gradseam is the only way to checkpoint it.
"""

from __future__ import annotations

from typing import Any

from gradseam.family import BlockClass, BlockList, Carry, Family, Preset
from gradseam.hookspecs import hookimpl
from gradseam.inputs import tensor_maker, video_latent_size

_M = "diffusers.models.transformers.transformer_sana_wm"
_R = "diffusers.models.transformers.transformer_sana_wm_refiner"

# The LTX-2 VAE: 8x in time, 32x in space, 128 channels. The pipeline's defaults: 704x1280, 161 frames, 16 fps.
VAE_TEMPORAL, VAE_SPATIAL = 8, 32
HEIGHT, WIDTH, FRAMES, FPS = 704, 1280, 161, 16


def camera_inputs(batch: int, frames: int, height: int, width: int, device: Any, dtype: Any) -> dict:
    """``camera_conditions`` ``(B, T, 20)`` as ``SanaWMPipeline`` packs them per latent frame (the pose
    relative to the first frame, flattened, then ``fx, fy, cx, cy`` in latent pixels): here a camera dollying
    forward and panning slowly, a plausible trajectory (the values only steer the camera branch)."""
    import torch

    t = torch.arange(frames, dtype=torch.float32) / max(1, frames - 1)
    angle = 0.3 * t
    c2w = torch.eye(4).repeat(frames, 1, 1)
    c2w[:, 0, 0], c2w[:, 0, 2], c2w[:, 2, 0], c2w[:, 2, 2] = angle.cos(), angle.sin(), -angle.sin(), angle.cos()
    c2w[:, 2, 3] = 2.0 * t
    focal = 0.8 * width
    intrinsics = torch.tensor([focal, focal, width / 2, height / 2]).repeat(frames, 1)
    raymap = torch.cat([c2w.reshape(frames, 16), intrinsics], dim=-1)
    return {"camera_conditions": raymap.expand(batch, frames, 20).to(device=device, dtype=dtype)}


def ray_maps(camera_conditions: Any, latent: tuple[int, int, int], patch: tuple[int, int, int], device: Any,
             dtype: Any) -> dict:
    """``cam_pos_embeds`` for ``camera_conditions``: the per-token ray matrices ``P`` ``(B, N, 4, 4)`` and the
    ``absmap`` ``(B, 3, T, H, W)``, computed by upstream's own function in float32 on the CPU, then moved.

    The model would compute the same from the raw conditions before its loop, in their dtype; upstream's camera
    geometry refuses half precision on the CPU (and cannot index on the meta device), so a half-precision batch
    for ``bench`` hands it precomputed, the way the model's ``cam_pos_embeds`` argument takes them. The blocks
    receive the same ray transforms either way."""
    from diffusers.models.transformers.transformer_sana_wm import _process_camera_conditions_ucpe

    batch = camera_conditions.shape[0]
    raymats, absmap = _process_camera_conditions_ucpe(camera_conditions.float().cpu(), batch, latent, patch)
    return {
        "absmap": absmap.permute(0, 4, 1, 2, 3).to(device=device, dtype=dtype),
        "P": raymats.reshape(batch, -1, 4, 4).to(device=device, dtype=dtype),
    }


def make_inputs(
    model: Any, device: Any, dtype: Any, tokens: int | None = None, *, frames: int = FRAMES, height: int = HEIGHT,
    width: int = WIDTH, text_tokens: int = 300,
) -> dict:
    """One real-size batch as ``SanaWMPipeline`` feeds the DiT (image-to-video with a camera trajectory): the
    LTX-2 latent ``(1, 128, (frames-1)/8+1, H/32, W/32)`` (grad), one timestep per latent frame ``(1, 1, T)``
    with the conditioning first frame at 0, the Gemma-2 prompt ``(1, 1, L, 2304)`` (the pipeline's 300 tokens)
    with its mask, the camera conditions with their ray maps precomputed (:func:`ray_maps`) and the Plücker map
    ``(1, 48, T, H, W)`` (6 coordinates for each of the 8 frames a latent frame covers). ``tokens`` overrides
    the video token count through the frame count."""
    import torch

    cfg = model.config
    patch = tuple(cfg.patch_size)
    latent_frames, h, w = video_latent_size(
        frames, height, width, patch=patch, tokens=tokens, temporal=VAE_TEMPORAL, spatial=VAE_SPATIAL)
    grid = (latent_frames, h // patch[1], w // patch[2])
    randn = tensor_maker(device, dtype)
    timestep = torch.full((1, 1, latent_frames), 500.0, device=device, dtype=dtype)
    timestep[..., 0] = 0.0
    camera = camera_inputs(1, latent_frames, h, w, "cpu", torch.float32)["camera_conditions"]
    return {
        "hidden_states": randn(1, cfg.in_channels, latent_frames, h, w, grad=True),
        "timestep": timestep,
        "encoder_hidden_states": randn(1, 1, text_tokens, cfg.caption_channels),
        "mask": torch.ones(1, text_tokens, device=device, dtype=torch.long),
        "camera_conditions": camera.to(device=device, dtype=dtype),
        "cam_pos_embeds": ray_maps(camera, grid, patch, device, dtype),
        "chunk_plucker": randn(1, cfg.chunk_plucker_channels, latent_frames, h, w),
    }


def make_refiner_inputs(
    model: Any, device: Any, dtype: Any, tokens: int | None = None, *, height: int = HEIGHT, width: int = WIDTH,
    fps: int = FPS, block_frames: int = 3, block_start: int = 16, sink_frames: int = 1, history_frames: int = 10,
    text_tokens: int = 1024, sigma: float = 0.725,
) -> dict:
    """One real-size step of ``SanaWMLTX2Refiner``'s chunk-causal refinement, in its steady state: the active
    block of ``block_frames`` latent frames (the pipeline's 3) as packed tokens ``(1, N, 128)`` (grad) at one
    sigma of the distilled schedule (scaled by 1000), the Gemma-3 prompt after the LTX-2 connectors
    ``(1, 1024, caption_channels)`` with its mask, the RoPE of the block's absolute frame positions, and a KV
    cache in ``"inject"`` mode holding, in every layer, the pre-RoPE K/V of ``sink_frames`` sink frames and the
    post-RoPE K/V of ``history_frames`` refined frames (the pipeline's window: ``kv_max_frames=11`` = 1 + 10),
    with the sink's RoPE slid to sit right before the history. ``tokens`` overrides the active token count
    through the block's frame count; the cached window stays."""
    import torch
    from diffusers.models.transformers.transformer_sana_wm_refiner import SanaWMRefinerKVCache

    cfg = model.config
    h, w = height // VAE_SPATIAL, width // VAE_SPATIAL
    per_frame = (h // cfg.patch_size) * (w // cfg.patch_size) // cfg.patch_size_t
    if tokens:
        block_frames = max(1, round(tokens / per_frame))
    inner = cfg.num_attention_heads * cfg.attention_head_dim
    randn = tensor_maker(device, dtype)
    layers = len(model.transformer_blocks)
    cache = SanaWMRefinerKVCache(layers)
    for layer in cache.layer_caches:
        layer.store_sink(randn(1, sink_frames * per_frame, inner), randn(1, sink_frames * per_frame, inner))
        layer.store_history(randn(1, history_frames * per_frame, inner), randn(1, history_frames * per_frame, inner))

    def rope(first: int, count: int) -> Any:  # as the pipeline builds it (in the rope's own precision)
        return model.build_rotary_emb_for_absolute_positions(
            batch_size=1, frame_positions=list(range(first, first + count)), height=h, width=w, device=device,
            fps=float(fps))

    cache.sink_pe = rope(block_start - history_frames - sink_frames, sink_frames)
    active = block_frames * per_frame
    return {
        "hidden_states": randn(1, active, cfg.in_channels, grad=True),
        "encoder_hidden_states": randn(1, text_tokens, cfg.caption_channels),
        "timestep": torch.full((1, active), sigma * cfg.timestep_scale_multiplier, device=device,
                               dtype=torch.float32),
        "video_rotary_emb": rope(block_start, block_frames),
        "encoder_attention_mask": torch.ones(1, text_tokens, device=device, dtype=dtype),
        "kv_cache": cache,
        "kv_cache_mode": "inject",
    }


SANA_WM = Family(
    name="sana-wm",
    description="SANA-WM camera-controlled world model, stage 1 (SanaWMTransformer3DModel)",
    models=(f"{_M}.SanaWMTransformer3DModel",),
    block_lists=(BlockList("blocks", carry=Carry({"x": None})),),
    block_classes=(
        BlockClass(f"{_M}.SanaVideoMSCamCtrlBlock", ffn=(("mlp",),), attention=("attn", "cross_attn")),
    ),
    presets={
        "1600m-704x1280": Preset(
            "SANA-WM 1600M (the class defaults, the SANA-WM_bidirectional release: 20 blocks, 2240 wide, GDN "
            "linear attention with softmax every 4th block, UCPE camera branch, GLUMBConvTemp 3x; 2.66B parameters "
            "as built, camera branch, temporal convolutions and Plücker projections included) at the pipeline's "
            "704x1280, 161 frames through the LTX-2 VAE: 21 x 22 x 40 = 18480 video tokens, 300 Gemma-2 tokens, "
            "camera conditions and Plücker map",
            config={},  # the class defaults are the released config
            inputs={"frames": FRAMES, "height": HEIGHT, "width": WIDTH, "text_tokens": 300},
            make_inputs=make_inputs,
        ),
    },
)

SANA_WM_REFINER = Family(
    name="sana-wm-refiner",
    description="SANA-WM stage-2 LTX-2 refiner, video only (SanaWMLTX2RefinerTransformer3DModel)",
    models=(f"{_R}.SanaWMLTX2RefinerTransformer3DModel",),
    block_lists=(
        BlockList("transformer_blocks", carry=Carry({"hidden_states": None}), per_block=("kv_cache",)),
    ),
    block_classes=(
        BlockClass(f"{_R}.SanaWMLTX2RefinerTransformerBlock", ffn=(("ff",),), attention=("attn1", "attn2")),
    ),
    presets={
        "ltx2-704x1280-window": Preset(
            "SANA-WM refiner on LTX-2's config (the class defaults: 48 blocks, 32 x 128 heads; 18.9B parameters, "
            "12.9B of them in the blocks' video-stream modules, the only ones its forward runs) at "
            "704x1280, one step of the chunk-causal refinement: an active block of 3 latent frames (2640 tokens) "
            "attending to a cached window of 1 sink + 10 history frames (9680 tokens per layer), 1024 prompt tokens",
            config={},  # the class defaults (LTX-2's trunk), assumed to be the released refiner's
            inputs={"height": HEIGHT, "width": WIDTH, "block_frames": 3, "history_frames": 10, "text_tokens": 1024},
            make_inputs=make_refiner_inputs,
        ),
    },
)


@hookimpl
def register_families(register: Any) -> None:
    register(SANA_WM)
    register(SANA_WM_REFINER)
