"""Every built-in family through the conformance kit's own suite: the path plugin authors use.

One ``ConformanceSuite`` per tiny model and input variant (masks, per-token timesteps, batched
padding, audio, SigLIP, STG). Each runs the kit's whole matrix: exact outputs and every
parameter and input gradient for ``torch`` / ``torch-ffn`` x interval {1, 2} x stride {none, 4},
the offload backends through the engine's CPU test mode, sampling under ``no_grad``, and the
refusal of what the family cannot do. Family-specific behaviour lives in the per-family files.
"""

from __future__ import annotations

from cases import FLUX, WAN, WAN_TI2V
from cases_image import CHROMA, CHROMA_MASKED, KREA2, KREA2_MASKED, ZIMAGE, ZIMAGE_BATCH, ZIMAGE_OMNI
from cases_video import LTX2, LTX2_MASKED, LTX2_STG, LTX23, MAGEFLOW, MAGEFLOW_BATCH

from gradseam.testing import ConformanceSuite

# Input variants (masks, batches, per-token timesteps...) rerun the whole strategy matrix; of the
# offload matrix they run one row per mechanism (region inputs + kept kernels, FFN inputs + attention
# seams), which keeps the suite within CI's time while every plain case runs all of it.
VARIANT_OFFLOAD = [
    {"gradient_checkpointing": True, "gradient_checkpointing_backend": "unsloth",
     "gradient_checkpointing_offload_attention": True, "gradient_checkpointing_interval": 2},
    {"gradient_checkpointing": True, "gradient_checkpointing_backend": "unsloth-ffn",
     "gradient_checkpointing_offload_attention": True},
]


class TestFlux(ConformanceSuite):
    case = FLUX


class TestWan(ConformanceSuite):
    case = WAN


class TestWanPerTokenTimesteps(ConformanceSuite):
    case = WAN_TI2V
    offload = VARIANT_OFFLOAD


class TestChroma(ConformanceSuite):
    case = CHROMA


class TestChromaMasked(ConformanceSuite):
    case = CHROMA_MASKED
    offload = VARIANT_OFFLOAD


class TestKrea2(ConformanceSuite):
    case = KREA2


class TestKrea2Masked(ConformanceSuite):
    case = KREA2_MASKED
    offload = VARIANT_OFFLOAD


class TestZImage(ConformanceSuite):
    case = ZIMAGE


class TestZImageBatch(ConformanceSuite):
    case = ZIMAGE_BATCH
    offload = VARIANT_OFFLOAD


class TestZImageOmni(ConformanceSuite):
    case = ZIMAGE_OMNI
    offload = VARIANT_OFFLOAD


class TestLTX2(ConformanceSuite):
    case = LTX2


class TestLTX2Masked(ConformanceSuite):
    case = LTX2_MASKED
    offload = VARIANT_OFFLOAD


class TestLTX2STG(ConformanceSuite):
    case = LTX2_STG
    whole_regions = False  # STG gives two blocks their own perturbation mask: those chunks fall back on purpose


class TestLTX23(ConformanceSuite):
    case = LTX23
    offload = VARIANT_OFFLOAD


class TestMageFlow(ConformanceSuite):
    case = MAGEFLOW


class TestMageFlowBatch(ConformanceSuite):
    case = MAGEFLOW_BATCH
    offload = VARIANT_OFFLOAD
