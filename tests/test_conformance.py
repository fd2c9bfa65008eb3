"""Every built-in family through the conformance kit's own suite: the path plugin authors use.

One ``ConformanceSuite`` per tiny model and input variant (masks, per-token timesteps, batched
padding, audio, SigLIP, STG). Each runs the kit's whole matrix: exact outputs and every
parameter and input gradient for ``torch`` / ``torch-ffn`` x interval {1, 2} x stride {none, 4},
the offload backends through the engine's CPU test mode, sampling under ``no_grad``, and the
refusal of what the family cannot do. Family-specific behaviour lives in the per-family files.
"""

from __future__ import annotations

import pytest
import torch
from cases import FLUX, WAN, WAN_TI2V
from cases_image import CHROMA, CHROMA_MASKED, KREA2, KREA2_MASKED, ZIMAGE, ZIMAGE_BATCH, ZIMAGE_OMNI
from cases_video import LTX2, LTX2_MASKED, LTX2_STG, LTX23, MAGEFLOW, MAGEFLOW_BATCH

from gradseam.testing import ConformanceSuite


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Tiny models gain nothing from intra-op threads; on a busy 2-core machine their waits made
    # steps several times slower. Reference and patched runs share the setting.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class TestFlux(ConformanceSuite):
    case = FLUX


class TestWan(ConformanceSuite):
    case = WAN


class TestWanPerTokenTimesteps(ConformanceSuite):
    case = WAN_TI2V


class TestChroma(ConformanceSuite):
    case = CHROMA


class TestChromaMasked(ConformanceSuite):
    case = CHROMA_MASKED


class TestKrea2(ConformanceSuite):
    case = KREA2


class TestKrea2Masked(ConformanceSuite):
    case = KREA2_MASKED


class TestZImage(ConformanceSuite):
    case = ZIMAGE


class TestZImageBatch(ConformanceSuite):
    case = ZIMAGE_BATCH


class TestZImageOmni(ConformanceSuite):
    case = ZIMAGE_OMNI


class TestLTX2(ConformanceSuite):
    case = LTX2


class TestLTX2Masked(ConformanceSuite):
    case = LTX2_MASKED


class TestLTX2STG(ConformanceSuite):
    case = LTX2_STG
    whole_regions = False  # STG gives two blocks their own perturbation mask: those chunks fall back on purpose


class TestLTX23(ConformanceSuite):
    case = LTX23


class TestMageFlow(ConformanceSuite):
    case = MAGEFLOW


class TestMageFlowBatch(ConformanceSuite):
    case = MAGEFLOW_BATCH
