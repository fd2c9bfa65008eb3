"""The ``gradseam`` command line (typer's CliRunner), its bench chart and table helpers."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from gradseam.cli import app

runner = CliRunner()
BUILTIN = ["chroma", "flux", "krea2", "ltx2", "mageflow", "wan", "zimage"]
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")


def _invoke(*args: str):
    return runner.invoke(app, list(args), env={"COLUMNS": "200", "NO_COLOR": "1"})


def test_families_lists_the_builtins():
    result = _invoke("families")
    assert result.exit_code == 0, result.output
    for name in BUILTIN:
        assert name in result.output


@pytest.mark.parametrize("command", [[], ["bench"], ["advise"], ["families"], ["demo"]])
def test_help(command):
    result = _invoke(*command, "--help")
    assert result.exit_code == 0, result.output
    assert "Usage" in result.output


def test_bench_help_mentions_the_real_workload_options():
    out = _invoke("bench", "--help").output
    for option in ("--family", "--preset", "--layers", "--tokens", "--synthetic", "--json", "--png", "--blocks",
                   "--dim", "--device", "--steps"):
        assert option in out


@no_cuda
def test_bench_family_without_cuda_exits_2():
    result = _invoke("bench", "--family", "flux", "--layers", "2")
    assert result.exit_code == 2
    assert "needs a CUDA GPU" in result.output and "real-size" in result.output


def test_bench_option_errors():
    result = _invoke("bench", "--layers", "2")
    assert result.exit_code == 2 and "need --family" in result.output
    result = _invoke("bench", "--synthetic", "--family", "flux")
    assert result.exit_code == 2 and "exclude each other" in result.output
    result = _invoke("bench", "--family", "flux", "--blocks", "2")
    assert result.exit_code == 2 and "synthetic stack" in result.output
    result = _invoke("bench", "--device", "tpu")
    assert result.exit_code == 2 and "cpu or cuda" in result.output


TINY_BENCH = ["bench", "--device", "cpu", "--blocks", "2", "--tokens", "64", "--dim", "128", "--steps", "1"]
ROW_KEYS = {"workload", "tokens", "strategy", "peak_gib", "step_ms", "status", "pinned_allocations_after_warmup",
            "vs_none", "vs_torch"}


def _bench_json(tmp_path, *extra: str):
    path = tmp_path / "bench.json"
    result = _invoke(*TINY_BENCH, "--json", str(path), *extra)
    assert result.exit_code == 0, result.output
    return result, json.loads(path.read_text()), path


def test_bench_synthetic_on_cpu_writes_json_and_png(tmp_path):
    from gradseam.bench import CUDA_ONLY_ROWS, MEMORY_CPU, NEEDS_CUDA

    result, doc, path = _bench_json(tmp_path)
    # the documented schema (gradseam.bench's module docstring)
    assert set(doc) == {"title", "device", "memory", "family", "preset", "layers", "steps", "rows"}
    assert doc["device"] == "cpu" and "CPU" in doc["title"] and doc["memory"] == MEMORY_CPU
    assert doc["family"] is None and doc["steps"] == 1
    assert all(set(r) == ROW_KEYS for r in doc["rows"])
    by = {r["strategy"]: r for r in doc["rows"]}
    assert {r["workload"] for r in doc["rows"]} == {"synthetic 2x64x128"}
    assert by["none"]["status"] == "ok" and by["none"]["vs_none"] == 1.0
    assert by["torch"]["status"] == "ok" and by["torch"]["vs_torch"] == 1.0
    assert 0 < by["torch"]["peak_gib"] < by["none"]["peak_gib"]
    assert {n for n, r in by.items() if r["status"] == NEEDS_CUDA} == CUDA_ONLY_ROWS
    assert all(r["status"] == "ok" for n, r in by.items() if n not in CUDA_ONLY_ROWS)
    out = result.output
    assert "CPU" in out and "kept for backward" in out and "| torch |" in out
    assert "error" not in out
    if importlib.util.find_spec("matplotlib"):
        assert path.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_oom_cell_is_reported_and_the_sweep_continues(tmp_path, monkeypatch):
    from gradseam import bench

    real, calls = bench.measure_cpu, []

    def measure_cpu(step, steps):  # the 4th measured row is gradseam's "torch"
        calls.append(1)
        if len(calls) == 4:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(step, steps)

    monkeypatch.setattr(bench, "measure_cpu", measure_cpu)
    result, doc, _ = _bench_json(tmp_path, "--png", str(tmp_path / "oom.png"))
    by = {r["strategy"]: r for r in doc["rows"]}
    assert by["torch"]["status"] == "OOM" and by["torch"]["peak_gib"] is None
    assert by["torch-ffn"]["status"] == by["torch, interval 2"]["status"] == "ok"  # rows after it still ran
    assert len(calls) == 6
    assert "torch: OOM" in result.output and "| torch | OOM |" in result.output


@no_cuda
def test_advise_without_cuda_errors_clearly():
    result = _invoke("advise", "--family", "flux", "--budget", "40GiB", "--layers", "1")
    assert result.exit_code == 2
    assert "needs a CUDA GPU" in result.output


def test_advise_bad_budget():
    result = _invoke("advise", "--family", "flux", "--budget", "forty")
    assert result.exit_code == 2
    assert "memory budget" in result.output


def test_advise_needs_family_and_budget():
    result = _invoke("advise", "--budget", "40GiB")
    assert result.exit_code != 0


def test_python_m_gradseam_help():
    done = subprocess.run([sys.executable, "-m", "gradseam", "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "bench" in done.stdout and "advise" in done.stdout


# -- bench output helpers (no GPU needed) ---------------------------------------------------------


def _rows():
    from gradseam.bench import Result, with_ratios

    results = [
        Result("w 4096", 4096, "none", 20.0, 100.0),
        Result("w 4096", 4096, "ref: save_on_cpu", 2.0, 300.0),
        Result("w 4096", 4096, "torch", 4.0, 130.0),
        Result("w 4096", 4096, "unsloth", None, None, "OOM"),
        Result("w 4096", 4096, "attention offload", None, None, "unsupported: no attention"),
        Result("w 1024", 1024, "torch", 1.0, 30.0),  # no 'none' row in this workload
    ]
    return with_ratios(results)


def test_markdown_handles_failed_cells_and_missing_ratios():
    from gradseam.bench import to_markdown

    text = to_markdown(_rows())
    assert "| OOM |" in text and "unsupported: no attention" in text
    assert "| w 1024 | torch | 1.00 | 30.0 |  | 1.000 |" in text


def test_chart_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    from gradseam.bench import chart

    path = tmp_path / "bench.png"
    assert chart(_rows(), path, "test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    json.dumps(_rows())  # the JSON rows serialise as they are


def test_real_rows_cover_references_and_strategies():
    from gradseam.bench import DIFFUSERS_ROW, real_rows

    names = [n for n, _ in real_rows()]
    assert names[:3] == ["none", DIFFUSERS_ROW, "ref: save_on_cpu"]
    for wanted in ("torch-ffn", "torch", "unsloth-ffn", "unsloth", "attention offload",
                   "torch-ffn + attention offload", "unsloth-ffn + attention offload", "torch, interval 2"):
        assert wanted in names
