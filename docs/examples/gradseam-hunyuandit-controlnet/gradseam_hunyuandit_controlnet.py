"""HunyuanDiT ControlNets (diffusers' ``HunyuanDiT2DControlNetModel``) for gradseam: an example plugin.

gradseam leaves this class out on purpose (without this plugin, ``gradseam families`` lists it with the
reason); a family that claims a left-out class takes precedence over that entry, so installing this plugin
is all it takes to train a ControlNet beside a frozen Hunyuan-DiT with checkpointing or offload.

The model is a copy of the first half of Hunyuan-DiT: ``blocks`` holds ``transformer_num_layers // 2 - 1``
``HunyuanDiTBlock`` s (19 for the released 40-layer trunk), every one built with ``skip=False``, so no
block has a long-skip merge and none is handed a ``skip``. The loop calls block ``i`` as
``block(hidden_states, temb=..., encoder_hidden_states=..., image_rotary_emb=...)``; the last three are
made once before the loop and are the same objects for every block, and a block returns its new
``hidden_states`` alone. Between two calls the loop only appends that output to a tuple (no copy, no
edit), so a chunk that runs its later blocks ahead with the carried ``hidden_states`` gives them exactly
the arguments the loop would: ``Carry({"hidden_states": None})``. After the loop each collected output
goes through its own ``controlnet_blocks`` Linear, which keeps it for its weight gradient, so every
block's output stays alive until backward whatever the strategy. Chunks run whole and exact, but keep
just what per-block regions keep: an interval buys no memory here, only a larger recompute in backward.

FFN seam: ``norm3 → ff``. ``norm3`` (an unmodulated ``FP32LayerNorm``) reads the residual stream, ``ff``
reads exactly ``norm3``'s output and nothing else does, and ``ff``'s output is only added back: a strict
chain whose recompute drops the 6144-wide GELU activations and keeps only the residual stream.

Attention side: ``attn1`` (self-attention, 2-D RoPE) and ``attn2`` (cross-attention to the CLIP + mT5
tokens), one SDPA call each; every block builds both. The text masks are spent before the loop (padded
tokens are swapped for the learned ``text_embedding_padding``), and the mT5 pooler's attention runs in
``time_extra_emb``, outside every block.
"""

from gradseam.family import BlockClass, BlockList, Carry, Family, Preset
from gradseam.hookspecs import hookimpl

_M = "diffusers.models.controlnets.controlnet_hunyuan"


def make_inputs(model, device, dtype, tokens=None, *, height=1024, width=1024):
    """One real-size batch as HunyuanDiTControlNetPipeline feeds the ControlNet: the latents (with grad),
    the control image's VAE latent, CLIP and mT5 states at the config's fixed lengths with all-ones
    masks, the 2-D RoPE and, for v1.1, the size and style conditions."""
    import torch  # here, not at the top: listing families must not import torch
    from diffusers.models.embeddings import get_2d_rotary_pos_embed

    cfg = model.config
    if tokens:
        height = width = max(1, round(tokens ** 0.5)) * cfg.patch_size * 8
    rows, cols = height // 8 // cfg.patch_size, width // 8 // cfg.patch_size
    # The pipeline's RoPE grid: the patch grid fitted (longer side first) and centred in a square of side
    # 512 px / 8 / patch_size.
    base = 512 // 8 // cfg.patch_size
    fit = (base, round(base / rows * cols)) if rows > cols else (round(base / cols * rows), base)
    top, left = round((base - fit[0]) / 2), round((base - fit[1]) / 2)
    rope = get_2d_rotary_pos_embed(cfg.attention_head_dim, ((top, left), (top + fit[0], left + fit[1])),
                                   (rows, cols), device=device, output_type="pt")

    def randn(*shape, grad=False):
        return torch.randn(shape, device=device, dtype=dtype, requires_grad=grad)

    def ones(length):
        return torch.ones(1, length, device=device, dtype=torch.int64)

    latent = (1, cfg.in_channels, rows * cfg.patch_size, cols * cfg.patch_size)
    inputs = {
        "hidden_states": randn(*latent, grad=True),
        "timestep": torch.full((1,), 500.0, device=device, dtype=dtype),
        "controlnet_cond": randn(*latent),  # a VAE latent too: it goes through the same pos_embed
        "encoder_hidden_states": randn(1, cfg.text_len, cfg.cross_attention_dim),
        "text_embedding_mask": ones(cfg.text_len),
        "encoder_hidden_states_t5": randn(1, cfg.text_len_t5, cfg.cross_attention_dim_t5),
        "text_embedding_mask_t5": ones(cfg.text_len_t5),
        "image_rotary_emb": rope,
    }
    if cfg.use_style_cond_and_image_meta_size:  # v1.1: original size, target size, crop corner; style 0
        size = [[height, width, height, width, 0, 0]]
        inputs["image_meta_size"] = torch.tensor(size, device=device, dtype=dtype)
        inputs["style"] = torch.zeros(1, device=device, dtype=torch.int64)
    return inputs


# diffusers' conversion script builds Tencent's released ControlNets from Hunyuan-DiT v1.2's transformer
# config (DiT-g/2: 1408 wide, 16 heads of 88, MLP 6144); the default transformer_num_layers=40 gives 19
# blocks. The v1.1 ControlNets keep the size and style conditions. conditioning_channels is never read.
V12 = {"conditioning_channels": 3, "num_attention_heads": 16, "attention_head_dim": 88, "in_channels": 4,
       "patch_size": 2, "activation_fn": "gelu-approximate", "sample_size": 128, "hidden_size": 1408,
       "transformer_num_layers": 40, "mlp_ratio": 4.3637, "cross_attention_dim": 1024,
       "cross_attention_dim_t5": 2048, "pooled_projection_dim": 1024, "text_len": 77, "text_len_t5": 256,
       "use_style_cond_and_image_meta_size": False}

CONTROLNET = Family(
    name="hunyuandit-controlnet",
    description="Hunyuan-DiT ControlNet (HunyuanDiT2DControlNetModel)",
    models=(f"{_M}.HunyuanDiT2DControlNetModel",),
    block_lists=(BlockList("blocks", carry=Carry({"hidden_states": None})),),
    block_classes=(
        BlockClass("diffusers.models.transformers.hunyuan_transformer_2d.HunyuanDiTBlock",
                   ffn=(("norm3", "ff"),), attention=("attn1", "attn2")),
    ),
    presets={
        "v1.2-1024": Preset(
            "Hunyuan-DiT v1.2 ControlNet (19 DiT-g/2 blocks, 16 x 88 heads) at 1024x1024 (4096 image tokens, "
            "77 CLIP + 256 mT5 text tokens)",
            config=V12,
            inputs={"height": 1024, "width": 1024},
            make_inputs=make_inputs,
        ),
        "v1.1-1024": Preset(
            "Hunyuan-DiT v1.1 ControlNet (the same, with the size and style conditions) at 1024x1024",
            config={**V12, "use_style_cond_and_image_meta_size": True},
            inputs={"height": 1024, "width": 1024},
            make_inputs=make_inputs,
        ),
    },
)


@hookimpl
def register_families(register):
    register(CONTROLNET)
