"""OmniGen v1 (OmniGenTransformer2DModel): a Phi-3-style decoder trunk over one multimodal sequence.

The sequence is the prompt's token embeddings (with each condition image's patch tokens written
into the placeholder slots the processor reserved for it), one timestep token, then the noisy
latent's patch tokens. One block list, ``layers``, all ``OmniGenBlock``: a pre-norm LLM layer,
``h + self_attn(input_layernorm(h))`` then ``h + mlp(post_attention_layernorm(h))``, returning the
new hidden states alone. The loop calls ``block(hidden_states, attention_mask=, image_rotary_emb=)``;
the additive mask (causal over the prompt, bidirectional inside each image, built once from the
processor's 3-D mask) and the ``(cos, sin)`` RoPE tuple are computed before the loop and are the same
objects for every block, and nothing is added between blocks, so the list carries
``{"hidden_states": None}``. Condition images, padded prompts and the classifier-free-guidance rows
only change what is built before the loop.

FFN seam ``("post_attention_layernorm", "mlp")``: the MLP branch is exactly
``mlp(post_attention_layernorm(h))`` with the residual added outside and no modulation anywhere
(OmniGen conditions on the timestep through its token, not through adaLN), so the norm and the MLP
are a strict chain. ``mlp`` is ``OmniGenFeedForward``, a SwiGLU with one fused ``gate_up_proj`` to
``2 x intermediate_size``: recomputing the seam drops that fused projection, the SiLU output, the
product and the normalised copy for every token; only ``h`` (already kept for the residual) is
kept. The FFN is dense, so a recompute replays it exactly.

Attention side: ``self_attn`` (projections, Phi-3 RoPE and the SDPA call with the multimodal mask).
"""

from __future__ import annotations

from gradseam.family import BlockClass, BlockList, Carry, Family, Preset
from gradseam.hookspecs import hookimpl
from gradseam.inputs import square_side, tensor_maker

_M = "diffusers.models.transformers.transformer_omnigen"


def multimodal_mask(valid: list[int], image_tokens: int, spans: dict | None = None, device=None):
    """The processor's ``(attention_mask, position_ids)`` for prompts left-padded to ``max(valid)`` tokens,
    followed by the timestep token and ``image_tokens`` output-image tokens.

    A prompt token (and the timestep token) sees the valid prompt tokens up to itself; an image token
    sees every valid token; a padding row sees everything (it is never read). ``spans`` maps a sample to
    the ``[start, end)`` slots of its condition images (counted in the padded prompt), whose tokens also
    see each other. Positions count the valid tokens from 0, padding at 0.
    """
    import torch

    text = max(valid)
    seq = text + 1 + image_tokens
    mask = torch.zeros(len(valid), seq, seq, device=device)
    positions = torch.zeros(len(valid), seq, dtype=torch.long, device=device)
    for i, n in enumerate(valid):
        pad = text - n
        prompt = slice(pad, text + 1)
        mask[i, :pad] = 1
        mask[i, prompt, prompt] = torch.ones(n + 1, n + 1, device=device).tril()
        mask[i, text + 1:, pad:] = 1
        for start, end in (spans or {}).get(i, ()):
            mask[i, start:end, start:end] = 1
        positions[i, pad:] = torch.arange(seq - pad, device=device)
    return mask, positions


def make_inputs(model, device, dtype, tokens=None, *, image_tokens=4096, text_tokens=128, images=0) -> dict:
    """One real-size batch as ``OmniGenPipeline`` builds it for one prompt: the output latent
    ``(1, 4, H/8, W/8)`` (grad), ``text_tokens`` prompt token ids (template included), and ``images``
    condition latents of the same size whose patch tokens fill placeholder slots after the prompt's
    first tokens; the processor's mask and position ids over the whole sequence. ``tokens`` overrides
    the image token count (each image is the square patch grid nearest it)."""
    import torch

    cfg = model.config
    side = square_side(tokens or image_tokens)
    n = side * side
    randn = tensor_maker(device, dtype)
    lead = min(8, text_tokens)  # "<|user|>\n" and the instruction before the first image tag
    ids = torch.randint(3, cfg.vocab_size, (1, text_tokens + images * n), device=device)
    spans = [[lead + k * n, lead + (k + 1) * n] for k in range(images)]
    for start, end in spans:
        ids[:, start:end] = 0
    mask, positions = multimodal_mask([ids.shape[1]], n, {0: spans} if images else None, device)
    latent = side * cfg.patch_size
    return {
        "hidden_states": randn(1, cfg.in_channels, latent, latent, grad=True),
        "timestep": torch.full((1,), 0.5, device=device, dtype=dtype),
        "input_ids": ids,
        "input_img_latents": [randn(1, cfg.in_channels, latent, latent) for _ in range(images)],
        "input_image_sizes": {0: spans} if images else {},
        "attention_mask": mask.to(dtype),
        "position_ids": positions,
    }


def _factors(heads: int = 32, hidden: int = 3072) -> dict:
    half = hidden // heads // 2
    return {"short_factor": [1.0] * half, "long_factor": [1.0] * half}


OMNIGEN = Family(
    name="omnigen",
    description="OmniGen v1 (OmniGenTransformer2DModel)",
    models=(f"{_M}.OmniGenTransformer2DModel",),
    block_lists=(BlockList("layers", carry=Carry({"hidden_states": None})),),
    block_classes=(
        BlockClass(f"{_M}.OmniGenBlock", ffn=(("post_attention_layernorm", "mlp"),), attention=("self_attn",)),
    ),
    presets={
        "v1-1024": Preset(
            "OmniGen v1 3.8B (Phi-3-mini trunk: 32 layers, 32 x 96 heads, SwiGLU 8192; the class defaults, with "
            "RoPE scaling factors of 1.0 standing in for Phi-3's released ones, which change no shape or cost) "
            "at 1024x1024: 128 prompt tokens (assumed: a long prompt with the template) + the timestep token + "
            "4096 image tokens",
            config={"rope_scaling": _factors()},
            inputs={"image_tokens": 4096, "text_tokens": 128},
            make_inputs=make_inputs,
        ),
        "v1-edit-1024": Preset(
            "OmniGen v1 (as 'v1-1024') at 1024x1024 conditioned on one 1024x1024 image: its 4096 patch tokens in "
            "the prompt, then 128 prompt tokens (assumed), the timestep token and 4096 output tokens",
            config={"rope_scaling": _factors()},
            inputs={"image_tokens": 4096, "text_tokens": 128, "images": 1},
            make_inputs=make_inputs,
        ),
    },
)


@hookimpl
def register_families(register):
    register(OMNIGEN)
