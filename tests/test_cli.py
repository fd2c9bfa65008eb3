"""The ``gradseam`` command line (typer's CliRunner), its bench chart and table helpers."""

from __future__ import annotations

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
    for option in ("--family", "--preset", "--layers", "--tokens", "--synthetic", "--json", "--png"):
        assert option in out


@no_cuda
@pytest.mark.parametrize("args", [["bench"], ["bench", "--family", "flux", "--layers", "2"]])
def test_bench_without_cuda_exits_2(args):
    result = _invoke(*args)
    assert result.exit_code == 2
    assert "needs a CUDA GPU" in result.output


def test_bench_option_errors():
    result = _invoke("bench", "--layers", "2")
    assert result.exit_code == 2 and "need --family" in result.output
    result = _invoke("bench", "--synthetic", "--family", "flux")
    assert result.exit_code == 2 and "exclude each other" in result.output


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
