"""``gradient_checkpointing_backend: "auto"`` on a CUDA GPU (run with ``pytest -m cuda``): the first training step
measures every per-block candidate at two depths of the model, on that step's inputs, caches the table,
plans, and trains like the explicit config it then prints; the next model of the same class and shapes reads
the table and measures nothing. The plan's speed against the best uniform row is docs/benchmarks.md's to say
(issue 41's H200 rows), not a test's."""

from __future__ import annotations

import pytest
import torch
from cases import WAN
from test_gpu import _deterministic, _on_cuda, _spread  # noqa: F401  (the fixture applies here too)

import gradseam
from gradseam.testing import COMPILED_TOLERANCE, assert_same_step, run_step

pytestmark = pytest.mark.cuda

AUTO = {"gradient_checkpointing_backend": "auto", "gradient_checkpointing_gpu_memory": "4GiB",
        "gradient_checkpointing_host_memory": "8GiB"}


def test_gpu_auto_measures_at_the_first_step_caches_and_trains_like_its_config(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GRADSEAM_CACHE_DIR", str(tmp_path))
    gpu = _on_cuda(WAN)
    reference = gpu.fresh()
    want = run_step(reference, gpu, count_bytes=False)
    spread = _spread(want, run_step(reference, gpu, count_bytes=False))
    del reference
    model = gpu.fresh()
    with gradseam.patch(model, AUTO) as handle:
        got = run_step(model, gpu, count_bytes=False)
        assert handle.auto.planned.source == "measured", handle.auto.describe()
        assert "measuring 1/" in capsys.readouterr().err
        assert list(tmp_path.glob("costs/*.json"))
        assert handle.regions() or not handle.auto.config.enabled
        # compiled candidates may be chosen: the compiled tolerance then, else the GPU's own spread
        compiled = "compile" in str(handle.auto.config.to_dict())
        atol = max(1e-5, 4 * spread, COMPILED_TOLERANCE if compiled else 0.0)
        assert_same_step(want, got, atol=atol, what="auto on the GPU vs unpatched")
        config = handle.auto.config
    again = gpu.fresh()
    with gradseam.patch(again, AUTO) as second:
        run_step(again, gpu, count_bytes=False)
        assert second.auto.planned.source == "cached" and second.auto.config == config
    assert "measuring" not in capsys.readouterr().err
    torch.cuda.synchronize()
