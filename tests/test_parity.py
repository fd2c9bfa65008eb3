"""Every family x strategy gives the unpatched model's outputs and gradients, to the bit."""

from __future__ import annotations

import pytest
from cases import ALL, WAN_TI2V

from gradseam.testing import check_strategy, config_id, cpu_configs

MATRIX = [(case, cfg) for case in ALL for cfg in cpu_configs()]


@pytest.mark.parametrize(("case", "config"), MATRIX, ids=[f"{c.name}-{config_id(k)}" for c, k in MATRIX])
def test_parity(case, config):
    report = check_strategy(case, config)
    assert report.saved_ratio < 1.0


@pytest.mark.parametrize("config", cpu_configs(), ids=config_id)
def test_wan_per_token_timesteps(config):
    check_strategy(WAN_TI2V, config)
