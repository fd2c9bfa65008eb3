"""The ``gradseam`` command line (typer's CliRunner), its bench chart and table helpers."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys

import pytest
import torch
from conftest import builtin_family_plugins
from test_bench import ROW_KEYS  # the documented row schema, written once
from typer.testing import CliRunner

import gradseam
from gradseam.tools.bench_rows import real_rows
from gradseam.tools.cli import app

runner = CliRunner()
BUILTIN = builtin_family_plugins()  # pyproject.toml's entry points that declare families, sorted
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")


def _invoke(*args: str, columns: str = "200"):
    return runner.invoke(app, list(args), env={"COLUMNS": columns, "NO_COLOR": "1"}, prog_name="gradseam")


def test_families_lists_the_builtins():
    result = _invoke("families")
    assert result.exit_code == 0, result.output
    for name in BUILTIN:
        assert name in result.output


def test_families_lists_the_left_out_classes_with_their_reasons():
    left_out = gradseam.unsupported_models()
    assert "diffusers.models.transformers.prior_transformer.PriorTransformer" in left_out  # the built-in list
    result = _invoke("families", columns="80")
    assert result.exit_code == 0, result.output
    assert f"Left out ({len(left_out)} model classes no family handles" in result.output
    flat = " ".join(result.output.split())
    for path, reason in left_out.items():
        assert f"{path.rsplit('.', 1)[-1]}: {' '.join(reason.split())}" in flat


@pytest.mark.parametrize("command", [[], ["bench"], ["advise"], ["families"], ["demo"], ["run"]])
def test_help(command):
    result = _invoke(*command, "--help")
    assert result.exit_code == 0, result.output
    assert "Usage" in result.output
    assert "<bool>" not in result.output  # flags are shown as flags: they take no value


def test_version():
    result = _invoke("--version")
    assert result.exit_code == 0, result.output
    assert result.stdout == f"gradseam {gradseam.__version__}\n"


def _words(families_output: str) -> set[str]:
    return set(families_output.replace(",", " ").replace(":", " ").replace(";", " ").replace("│", " ").replace("┃", " ").split())


def test_families_never_cuts_a_word_in_an_80_column_terminal(monkeypatch):
    """In a terminal (a console that takes its width from COLUMNS), every class name and block path
    is printed whole: a name cut in two cannot be searched for or pasted."""
    from rich.console import Console

    from gradseam.tools import cli

    monkeypatch.setattr(cli, "console", lambda: Console(no_color=True))  # an 80-column terminal, as COLUMNS says
    result = _invoke("families", columns="80")
    assert result.exit_code == 0, result.output
    assert max(len(line) for line in result.output.splitlines()) <= 80
    words = _words(result.output)
    for item in gradseam.installed():
        if item.distribution is None:
            continue  # registered at runtime by an earlier test in this process (bench's synthetic family)
        fam = item.family
        wanted = [fam.name, *(n.rsplit(".", 1)[-1] for n in fam.model_names), *(bl.path for bl in fam.block_lists)]
        assert not [w for w in wanted if w not in words], f"{fam.name}: cut or missing in\n{result.output}"
    wide = _invoke("families", columns="400")  # a terminal wide enough for every word: the table
    assert wide.exit_code == 0 and "┃ family" in wide.output


def test_families_keeps_names_when_piped():
    """Not a terminal (a pipe, a CI log): no cell is cut, whatever COLUMNS says."""
    result = _invoke("families", columns="40")
    assert result.exit_code == 0, result.output
    assert "…" not in result.output
    for item in gradseam.installed():
        for name in item.family.model_names:
            assert name.rsplit(".", 1)[-1] in result.output
        row = next(line for line in result.output.splitlines() if f" {item.family.name} " in line)
        assert item.family.model_names[0].rsplit(".", 1)[-1] in row  # on the family's own line


def test_bench_help_mentions_the_real_workload_options():
    out = _invoke("bench", "--help").output
    for option in ("--family", "--preset", "--depths", "--full", "--depth", "--row", "--full-row", "--tokens", "--synthetic", "--json", "--png", "--blocks",
                   "--dim", "--device", "--steps"):
        assert option in out


@no_cuda
def test_bench_family_without_cuda_exits_2():
    result = _invoke("bench", "--family", "flux", "--depths", "2,4")
    assert result.exit_code == 2
    assert "needs a CUDA GPU" in result.output and "real-size" in result.output


def test_bench_warns_that_a_fit_from_depth_1_overstates_offload_growth():
    assert "note: --depths starts at 1" not in _invoke("bench", "--family", "flux", "--depths", "2,4").output
    result = _invoke("bench", "--family", "flux", "--depths", "1,2")
    assert "note: --depths starts at 1" in result.output and "Prefer 2,4" in result.output


def test_bench_skip_row_names_known_rows_and_excludes_row():
    result = _invoke("bench", "--family", "flux", "--skip-row", "ref: save_on_cpu", "--skip-row", "bogus")
    assert result.exit_code == 2 and "--skip-row" in result.output and "bogus" in result.output
    result = _invoke("bench", "--family", "flux", "--row", "torch", "--skip-row", "ref: save_on_cpu")
    assert result.exit_code != 0 and "exclude each other" in result.output
    assert "need --family" in _invoke("bench", "--skip-row", "torch").output


def test_bench_skip_row_runs_every_other_row(monkeypatch):
    from gradseam.tools import bench, cli

    seen = {}

    def fake_real(family, preset, *, rows, **kwargs):
        seen["rows"] = rows
        raise gradseam.GradseamError("stop here")

    monkeypatch.setattr(cli, "_need_cuda", lambda *args: None)
    monkeypatch.setattr(bench, "real", fake_real)
    result = _invoke("bench", "--family", "flux", "--skip-row", "ref: save_on_cpu", "--skip-row", "torch")
    assert "stop here" in result.output
    assert seen["rows"] == [n for n, _ in real_rows() if n not in ("ref: save_on_cpu", "torch")]


def test_bench_base_and_lora_reach_the_workload(monkeypatch, tmp_path):
    """--base and --lora go to bench.real (the quantized base and the LoRA rank); a base bench does not
    know is refused naming every one it does, and both need --family."""
    from gradseam.tools import bench, cli
    from gradseam.tools.bases import BASES
    from gradseam.tools.depth import DepthPlan
    from gradseam.tools.results import RealRun, Result

    seen = {}

    def fake_real(family, preset, **kwargs):
        seen.update(kwargs)
        kwargs["on_build"](RealRun(DepthPlan({"blocks": 4}), (1, 2), 4, weights_gib=11.123))
        kwargs["on_row"](Result("flux dev (16 seq, bnb-nf4, LoRA r=16)", 16, "none", 1.0, 2.0, depth=1))
        raise gradseam.GradseamError("stop here")

    monkeypatch.setattr(cli, "_need_cuda", lambda *args: None)
    monkeypatch.setattr(bench, "real", fake_real)
    path = tmp_path / "b.json"
    assert "stop here" in _invoke("bench", "--family", "flux", "--base", "bnb-nf4", "--lora", "16",
                                  "--json", str(path)).output
    assert seen["base"] == "bnb-nf4" and seen["lora"] == 16
    doc = json.loads(path.read_text())  # the partial file a row writes says what was measured on
    assert (doc["base"], doc["lora"], doc["weights_gib"]) == ("bnb-nf4", 16, 11.12)
    result = _invoke("bench", "--family", "flux", "--base", "int4")
    assert result.exit_code == 2 and "'int4'" in result.output and all(name in result.output for name in BASES)
    assert "need --family" in _invoke("bench", "--base", "bnb-nf4").output
    result = _invoke("bench", "--family", "flux", "--lora", "0")
    assert result.exit_code == 2 and "LoRA rank >= 1, got 0" in result.output


def test_bench_option_errors():
    result = _invoke("bench", "--depths", "2,4")
    assert result.exit_code == 2 and "need --family" in result.output
    result = _invoke("bench", "--synthetic", "--family", "flux")
    assert result.exit_code == 2 and "exclude each other" in result.output
    result = _invoke("bench", "--family", "flux", "--blocks", "2")
    assert result.exit_code == 2 and "synthetic stack" in result.output
    result = _invoke("bench", "--device", "tpu")
    assert result.exit_code == 2 and "cpu or cuda" in result.output


TINY_BENCH = ["bench", "--device", "cpu", "--blocks", "2", "--tokens", "64", "--dim", "128", "--steps", "1"]


def _bench_json(tmp_path, *extra: str, path=None):
    path = path or tmp_path / "bench.json"
    result = _invoke(*TINY_BENCH, "--json", str(path), *extra, columns="60")
    assert result.exit_code == 0, result.output
    return result, json.loads(path.read_text()), path


def test_bench_synthetic_on_cpu_writes_json_and_png(tmp_path):
    from gradseam.tools.bench import CPU_SKIPPED
    from gradseam.tools.bench_report import MEMORY_CPU
    from gradseam.tools.bench_rows import CPU_STATUS_WHY

    result, doc, path = _bench_json(tmp_path)
    # the documented schema (gradseam.tools.bench's module docstring)
    assert set(doc) == {"title", "device", "gpu", "torch", "memory", "family", "preset", "steps", "base", "lora", "weights_gib",
                        "gpu_memory_gib", "host_memory_gib", "depth", "full_depth", "rows"}
    assert doc["device"] == "cpu" and "CPU" in doc["title"] and doc["memory"] == MEMORY_CPU
    assert doc["family"] is None and doc["steps"] == 1
    assert doc["gpu"] is None and doc["torch"] == torch.__version__  # which machine measured it
    assert all(set(r) == ROW_KEYS for r in doc["rows"])
    by = {r["strategy"]: r for r in doc["rows"]}
    assert {r["workload"] for r in doc["rows"]} == {"synthetic 2x64x128"}
    assert by["none"]["status"] == "ok" and by["none"]["vs_none"] == 1.0
    assert all(len(r["step_times_ms"]) == 1 for r in doc["rows"] if r["status"] == "ok")  # --steps 1
    assert all(r["step_times_ms"] is None for r in doc["rows"] if r["status"] != "ok")
    assert by["torch"]["status"] == "ok" and by["torch"]["vs_torch"] == 1.0
    assert 0 < by["torch"]["peak_gib"] < by["none"]["peak_gib"]
    # every row the CPU leaves out has its status, and only those: offload "needs CUDA", kept kernels and
    # compiled rows (which run on the CPU too) "not measured on the CPU (...)"
    assert {n: r["status"] for n, r in by.items() if r["status"] != "ok"} == {n: CPU_SKIPPED[n] for n in by
                                                                              if n in CPU_SKIPPED}
    out = result.output
    assert "CPU" in out and "kept for backward" in out and "| torch |" in out
    assert "error" not in out
    for status, why in CPU_STATUS_WHY.items():  # each status shown is explained under the table, once
        assert out.count(f"'{status}': {why}.") == 1
    # --steps 1: no spread, and the ratios say they are one step against one step
    assert "spread: none, each row was timed in a single step (--steps 1)" in out and " (1 step) |" in out
    assert "| torch | " in out and f"{by['torch']['vs_none']:.2f}*" in out
    # pasteable markdown even at COLUMNS=60 into a pipe: every row whole, on its own line
    table = [line for line in out.splitlines() if line.startswith("|")]
    assert len(table) == 2 + len(doc["rows"]) and all(line.endswith("|") and line.count("|") == 8 for line in table)
    if importlib.util.find_spec("matplotlib"):
        assert path.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_oom_cell_is_reported_and_the_sweep_continues(tmp_path, monkeypatch):
    from gradseam.tools import bench

    real, calls = bench.measuring.measure, []

    def measure(step, **kwargs):  # the 5th measured row is gradseam's "torch" (rows in ladder order)
        calls.append(1)
        if len(calls) == 5:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(step, **kwargs)

    monkeypatch.setattr(bench.measuring, "measure", measure)
    result, doc, _ = _bench_json(tmp_path, "--png", str(tmp_path / "oom.png"))
    by = {r["strategy"]: r for r in doc["rows"]}
    assert by["torch"]["status"] == "OOM" and by["torch"]["peak_gib"] is None
    assert by["torch-ffn"]["status"] == by["torch, interval 2"]["status"] == "ok"  # rows after it still ran
    assert len(calls) == 6  # every row the CPU can measure: references, torch, torch-ffn, interval 2
    assert "torch: OOM" in result.output and "| torch | OOM |" in result.output


def test_a_row_that_breaks_the_device_is_named_and_the_json_kept(tmp_path, monkeypatch):
    from gradseam.tools import bench

    real, calls = bench.measuring.measure, []

    def measure(step, **kwargs):  # the 2nd measured row breaks the device
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real(step, **kwargs)

    monkeypatch.setattr(bench.measuring, "measure", measure)
    monkeypatch.setattr(bench.measuring, "context_lost", lambda device="cuda": True)
    path = tmp_path / "lost.json"
    result = _invoke("bench", "--json", str(path), "--steps", "1")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "broke the GPU's context" in result.output and "--skip-row" in result.output
    doc = json.loads(path.read_text())
    assert [r["status"][:6] for r in doc["rows"]] == ["ok", "error:"]


def test_an_interrupted_bench_keeps_the_rows_it_measured(tmp_path, monkeypatch):
    from gradseam.tools import bench

    real, calls = bench.measuring.measure, []

    def measure(step, **kwargs):  # a time limit kills the sweep at its 3rd measured row
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(step, **kwargs)

    monkeypatch.setattr(bench.measuring, "measure", measure)
    path = tmp_path / "cut.json"
    _invoke("bench", "--json", str(path), "--steps", "1")
    doc = json.loads(path.read_text())
    assert "partial" in doc["title"]
    assert [r["status"] for r in doc["rows"]] == ["ok", "ok"]  # the two rows measured before the cut
    assert all(r["peak_gib"] > 0 for r in doc["rows"])


@no_cuda
def test_advise_without_cuda_errors_clearly():
    result = _invoke("advise", "--family", "flux", "--gpu", "40GiB", "--depths", "1,2")
    assert result.exit_code == 2
    assert "needs a CUDA GPU" in result.output


def test_advise_bad_gpu_size():
    result = _invoke("advise", "--family", "flux", "--gpu", "forty")
    assert result.exit_code == 2
    assert "Invalid value for '--gpu': GPU memory size: cannot read 'forty'" in result.output
    assert "budget" not in result.output  # "budget" is the compiler's activation fraction, not the GPU's size


def test_advise_needs_family_and_gpu():
    assert _invoke("advise", "--gpu", "40GiB").exit_code != 0
    result = _invoke("advise", "--family", "flux")
    assert result.exit_code == 2 and result.stderr == "gradseam advise: error: Missing option '--gpu'.\n"


def test_advise_help_names_gpu_and_hides_budget():
    out = _invoke("advise", "--help").output
    assert "--gpu, --gpu-memory SIZE" in out and "GPU memory available to the run" in out
    assert "--host-memory SIZE" in out and "pin at most 3/4 of it" in out
    assert "--budget" not in out and "budget" not in out.lower().replace("--", "")


@pytest.fixture
def advise_stopped(monkeypatch) -> list[float]:
    """``gradseam advise`` as if on a GPU, stopped ("stop here") where it would build the model; the GPU sizes
    that reached the measurement."""
    from gradseam.tools import cli

    seen: list[float] = []

    def measure(out, fam, preset, gpu_gib, **kwargs):
        seen.append(gpu_gib)
        cli.fail("stop here")

    monkeypatch.setattr(cli, "_need_cuda", lambda *args: None)
    monkeypatch.setattr(cli, "_model_class", lambda fam: None)
    monkeypatch.setattr(cli, "_measure_advice", measure)
    return seen


def test_advise_budget_is_a_deprecated_alias_of_gpu(advise_stopped):
    """``--budget SIZE`` still works as ``--gpu SIZE``: it reaches the measurement as the GPU's size in GiB,
    and a one-line warning names --gpu once the command line has been accepted (a refused one stays
    one error line)."""
    seen = advise_stopped
    for option in ("--gpu", "--budget"):
        result = _invoke("advise", "--family", "flux", option, "40960MiB")
        assert result.exit_code == 2 and seen.pop() == 40.0, result.output
        lines = result.stderr.splitlines()
        assert lines[-1] == "gradseam advise: error: stop here"
        if option == "--gpu":
            assert len(lines) == 1
        else:
            assert lines == ["gradseam advise: warning: --budget is deprecated; use --gpu SIZE (the GPU memory "
                             "available to the run).", "gradseam advise: error: stop here"]
    # refused before the warning: one error line, naming the option as typed
    result = _invoke("advise", "--family", "flux", "--budget", "40XB")
    assert result.stderr == ("gradseam advise: error: Invalid value for '--budget': GPU memory size: cannot read "
                             "'40XB'; write a number with a unit, e.g. '40GiB', '40 GB', '40960MiB', or a plain "
                             "number of GiB like 42.5.\n")
    assert not seen


def test_advise_refuses_an_unknown_base_or_rank_before_building(advise_stopped):
    """An unknown base is refused before anything is built, listing the bases (--base reaching the workload:
    test_advise_measures_with_the_gpu_size_and_prints_the_advice)."""
    from gradseam.tools.bases import BASES

    seen = advise_stopped
    result = _invoke("advise", "--family", "flux", "--gpu", "24GiB", "--base", "int4")
    assert result.exit_code == 2 and not seen
    assert "unknown base 'int4'" in result.stderr and all(name in result.stderr for name in BASES), result.stderr
    assert "a LoRA rank" in _invoke("advise", "--family", "flux", "--gpu", "24GiB", "--lora", "0").stderr


def test_python_m_gradseam_help():
    done = subprocess.run([sys.executable, "-m", "gradseam", "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "bench" in done.stdout and "advise" in done.stdout


# -- bench output helpers (no GPU needed) ---------------------------------------------------------


def _rows():
    from gradseam.tools.bench import Result
    from gradseam.tools.bench_report import with_ratios

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
    from gradseam.tools.bench_report import to_markdown

    text = to_markdown(_rows())
    assert "| OOM |" in text and "unsupported: no attention" in text
    assert "| w 1024 | torch | 1.00 |  | 30.0 |  | 1.000 |" in text


def test_chart_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    from gradseam.tools.bench_report import chart

    path = tmp_path / "bench.png"
    assert chart(_rows(), path, "test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    json.dumps(_rows())  # the JSON rows serialise as they are


def _boxes(fig, ax):
    from matplotlib.text import Text

    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    return [Text.get_window_extent(t, renderer) for t in ax.texts]  # the words, not their leaders


def test_crowded_labels_stay_apart_and_inside_the_axes():
    """Twenty rows within a few pixels of each other (as at full depth) still get readable names."""
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from gradseam.tools.bench_report import _label

    fig, ax = plt.subplots(figsize=(7, 6), dpi=120)
    points = [(f"configuration number {i}", 2.0 + 0.01 * i, 600.0 + i) for i in range(20)]
    points.append(("none, at the right edge", 17.5, 470.0))
    ax.scatter([x for _, x, _ in points], [y for _, _, y in points])
    _label(ax, points)
    boxes, frame = _boxes(fig, ax), ax.get_window_extent()
    plt.close(fig)
    assert len(boxes) == len(points)
    for i, a in enumerate(boxes):
        assert frame.x0 - 1 <= a.x0 and a.x1 <= frame.x1 + 1 and frame.y0 - 1 <= a.y0 and a.y1 <= frame.y1 + 1
        for b in boxes[i + 1:]:
            assert not a.overlaps(b) or min(a.x1, b.x1) - max(a.x0, b.x0) < 2 or min(a.y1, b.y1) - max(a.y0, b.y0) < 2


def test_chart_draws_a_wide_memory_span_on_a_log_axis(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from gradseam.tools.bench_report import chart

    scales = []
    real_close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig: (scales.extend(ax.get_xscale() for ax in fig.axes), real_close(fig)))
    narrow = [dict(r, peak_gib=4.0 + i) for i, r in enumerate(_rows()) if r["peak_gib"] is not None]
    assert chart(narrow, tmp_path / "narrow.png") and scales == ["linear", "linear"]
    scales.clear()
    wide = _rows()  # 20 GiB (none) against 1 GiB (torch at 1024): a 20x span is still linear
    wide[0] = dict(wide[0], peak_gib=443.0)
    assert chart(wide, tmp_path / "wide.png") and scales[0] == "log"


def test_chart_of_streamed_and_capped_rows_shows_the_whole_gpu_and_each_card(tmp_path, monkeypatch):
    """Where weights stream or rows are capped, what must fit the card is the whole GPU's peak (a streamed row's
    2 GiB of activations beside its resident weights), so x is that, and each cap a dotted line; a row without the
    figure keeps the activation axis."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from gradseam.tools.bench_report import chart

    seen: list[tuple[str, list[float], list[float]]] = []
    real_close = plt.close

    def close(fig):
        ax = fig.axes[0]
        xs = [float(p[0]) for c in ax.collections for p in c.get_offsets()]
        lines = [line.get_xdata()[0] for line in ax.get_lines()]
        seen.append((ax.get_xlabel(), xs, lines))
        real_close(fig)

    monkeypatch.setattr(plt, "close", close)
    rows = [{"workload": "flux", "strategy": "unsloth-compile", "peak_gib": 0.83, "gpu_peak_gib": 23.12,
             "step_ms": 535.8},
            {"workload": "flux", "strategy": "unsloth-compile + stream 25 @ 16GiB", "peak_gib": 1.87,
             "gpu_peak_gib": 14.62, "step_ms": 614.0},
            {"workload": "flux", "strategy": "unsloth-compile + stream 35 @ 12GiB", "peak_gib": 2.03,
             "gpu_peak_gib": 10.65, "step_ms": 708.7}]
    assert chart(rows, tmp_path / "gpu.png")
    label, xs, lines = seen[-1]
    assert label.startswith("GPU peak, weights included") and sorted(xs) == [10.65, 14.62, 23.12]
    assert sorted(lines) == [12.0, 16.0]
    unknown = [dict(rows[0], gpu_peak_gib=None), *rows[1:]]
    assert chart(unknown, tmp_path / "act.png")
    label, xs, lines = seen[-1]
    assert label.startswith("activation peak") and sorted(xs) == [0.83, 1.87, 2.03] and lines == []


def test_real_rows_cover_references_and_strategies():
    from gradseam.tools.bench_rows import DIFFUSERS_ROW, real_rows

    names = [n for n, _ in real_rows()]
    assert names[:3] == ["none", DIFFUSERS_ROW, "ref: save_on_cpu"]
    for wanted in ("torch-ffn", "torch", "unsloth-ffn", "unsloth", "attention offload",
                   "torch-ffn + attention offload", "unsloth-ffn + attention offload", "torch, interval 2"):
        assert wanted in names


# -- every option is checked before work starts: one line on stderr, exit code 2 --------------------

INSTALLED = "installed: ace-step, allegro, anima-text-conditioner, anyflow, anyflow-far, auraflow, "  # the list goes on alphabetically (the synthetic stack too, once bench ran)
OPTION_ERRORS = [
    (["demo", "--steps", "0"], "Invalid value for '--steps': expected a number of timed steps >= 1, got 0."),
    (["demo", "--tokens", "0"], "Invalid value for '--tokens': image tokens must be a square number >= 1 (side x "
                                "side patches), got 0; e.g. 256 (16x16) or 4096 (64x64)."),
    (["demo", "--tokens", "-4"], "image tokens must be a square number >= 1 (side x side patches), got -4"),
    (["demo", "--tokens", "99"], "Invalid value for '--tokens': 99 is not a square number, and the demo's image is "
                                 "side x side patches; nearest: 81 (9x9) or 100 (10x10)."),
    (["demo", "--device", "tpu"], "Invalid value for '--device': expected cpu or cuda, got 'tpu'."),
    (["demo", "--stpes", "2"], "No such option: --stpes"),
    (["demo", "--threads", "0"], "Invalid value for '--threads': expected a number of CPU threads >= 1, got 0."),
    (["demo", "--threads", "-3"], "Invalid value for '--threads': expected a number of CPU threads >= 1, got -3."),
    (["bench", "--family", "nosuch"], f"Invalid value for '--family': no installed family 'nosuch'; {INSTALLED}"),
    (["bench", "--family", "flux", "--preset", "nope"], "Invalid value for '--preset': family 'flux' has no preset "
                                                        "'nope'; presets: dev-1024."),
    (["bench", "--family", "flux", "--depths", "0,2"], "Invalid value for '--depths': expected two different depths "
                                                        ">= 1 like '2,4', got '0,2'."),
    (["bench", "--family", "flux", "--depth", "0"], "Invalid value for '--depth'"),
    (["bench", "--steps", "0"], "Invalid value for '--steps': expected a number of timed steps >= 1, got 0."),
    (["bench", "--threads", "0"], "Invalid value for '--threads': expected a number of CPU threads >= 1, got 0."),
    (["bench", "--tokens", "64", "--tokens", "0"], "Invalid value for '--tokens': expected a number of tokens >= 1, "
                                                   "got 0."),
    (["bench", "--blocks", "-1"], "Invalid value for '--blocks': expected a number of blocks >= 1, got -1."),
    (["bench", "--dim", "0"], "Invalid value for '--dim': expected a model width >= 1, got 0."),
    (["bench", "--family", "flux", "--threads", "2"], "--threads sets the CPU's torch threads; this bench runs on "
                                                       "the GPU: --family models always run there."),
    (["bench", "--dim", "257"], "Invalid value for '--dim': 257 does not split into the synthetic stack's 2 heads "
                                "(one per 128 of width); nearest widths that do: 256 and 258."),
    (["bench", "--device", "tpu"], "Invalid value for '--device': expected cpu or cuda, got 'tpu'."),
    (["bench", "--synthetic", "false"], "Got unexpected extra argument(s) (false)"),
    (["bench", "--json", "{file}/x.json"], "Invalid value for '--json': cannot create the directory"),
    (["bench", "--json", "{dir}"], "is a directory; name a file."),
    (["bench", "--json", "{dir}/r.png"], "Invalid value for '--png': the chart would overwrite the results file"),
    (["bench", "--png", "{dir}/chart.txt"], "Invalid value for '--png': matplotlib cannot write '.txt'"),
    (["advise", "--family", "nosuch", "--gpu", "40GiB"], f"no installed family 'nosuch'; {INSTALLED}"),
    (["advise", "--family", "flux", "--gpu", "40XB"], "Invalid value for '--gpu': GPU memory size: cannot read "
                                                      "'40XB'"),
    (["advise", "--family", "flux", "--gpu", "0"], "GPU memory size: must be a positive finite size, got '0'."),
    (["advise", "--family", "flux", "--budget", "0"], "Invalid value for '--budget': GPU memory size: must be a "
                                                      "positive finite size, got '0'."),
    (["advise", "--family", "flux", "--gpu", "40GiB", "--budget", "40GiB"], "--budget is the deprecated old name "
                                                                              "of --gpu; give --gpu only."),
    (["advise", "--family", "flux"], "Missing option '--gpu'."),
    (["advise", "--family", "flux", "--gpu", "40GiB", "--preset", "x"], "family 'flux' has no preset 'x'"),
    (["advise", "--family", "flux", "--gpu", "40GiB", "--tokens", "0"], "Invalid value for '--tokens': expected "
                                                                         "a number of tokens >= 1, got 0."),
    (["advise", "--family", "flux", "--gpu", "40GiB", "--depth", "-2"], "Invalid value for '--depth': expected "
                                                                         "a depth in units of depth >= 1, got -2."),
    (["advise", "--family", "flux", "--gpu", "40GiB", "--depths", "4"], "Invalid value for '--depths'"),
    (["advise", "--family", "flux", "--gpu", "40GiB", "--json", "{dir}"], "Invalid value for '--json'"),
    (["advise", "--gpu", "40GiB"], "Missing option '--family'"),
    (["families", "extra"], "Got unexpected extra argument(s) (extra)"),
    (["nosuch"], "No such command 'nosuch'."),
]


@pytest.mark.parametrize(("args", "message"), OPTION_ERRORS, ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_option_errors_are_one_line_and_exit_2(tmp_path, args, message):
    if "{dir}/chart.txt" in args:
        pytest.importorskip("matplotlib")
    (tmp_path / "file").write_text("")
    args = [a.format(file=tmp_path / "file", dir=tmp_path) for a in args]
    result = _invoke(*args)
    assert result.exit_code == 2, result.output
    command = args[0] if args[0] in ("demo", "bench", "advise", "families") else ""
    assert result.stderr.startswith(f"gradseam {command}: error: ".replace(" :", ":"))
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert message in result.stderr
    assert result.stdout == ""  # nothing ran
    assert not (tmp_path / "r.png").exists() and not (tmp_path / "r.json").exists()


@no_cuda
def test_demo_cuda_without_cuda_is_refused():
    result = _invoke("demo", "--device", "cuda")
    assert result.exit_code == 2
    assert result.stderr == ("gradseam demo: error: Invalid value for '--device': cuda asked for, but torch sees no "
                             "CUDA GPU here (torch.cuda.is_available() is False); use --device cpu, or leave --device "
                             "out.\n")


def test_demo_runs_the_size_its_title_says():
    threads = torch.get_num_threads()
    result = _invoke("demo", "--device", "cpu", "--tokens", "16", "--steps", "1", "--threads", "2")
    assert result.exit_code == 0, result.output
    assert torch.get_num_threads() == threads  # the demo's thread count does not outlive it
    assert "small Flux (cpu, 16 image tokens)" in result.output
    assert "spread: none, each row was timed in a single step (--steps 1)" in result.output
    from gradseam.tools.demo import strategies

    # every row's gradient equals the unpatched one ("none" included: its difference to itself)
    assert result.output.count("0.0e+00") == len(strategies(cuda=False)) == 5


def test_bench_threads_are_set_for_the_sweep_and_restored(tmp_path, monkeypatch):
    from gradseam.tools import bench

    seen = []
    real = bench.measuring.measure

    def measure(step, **kwargs):
        seen.append(torch.get_num_threads())
        return real(step, **kwargs)

    monkeypatch.setattr(bench.measuring, "measure", measure)
    before = torch.get_num_threads()
    target = 2 if before != 2 else 1
    result, doc, _ = _bench_json(tmp_path, "--threads", str(target), "--steps", "2")
    assert seen and set(seen) == {target} and torch.get_num_threads() == before
    assert all(len(r["step_times_ms"]) == 2 for r in doc["rows"] if r["status"] == "ok")
    assert "spread: (slowest - fastest) / median of the 2 timed steps." in result.output
    assert "| step ms (spread) |" in result.output


def test_bench_creates_the_output_directory_before_running(tmp_path):
    path = tmp_path / "new" / "dir" / "bench.json"
    _, doc, _ = _bench_json(tmp_path, path=path)
    assert path.parent.is_dir() and doc["device"] == "cpu"


def test_bench_family_sweep_writes_full_depth_rows(tmp_path, monkeypatch):
    """The --family path end to end on the CPU: a tiny Flux stands for the preset (bench.real is called as
    the command calls it, on the CPU), so the progress, the partial JSON, the full-depth table and the
    final JSON are those of a real-model sweep."""
    from cases import tiny_flux_bench_family

    from gradseam.tools import bench, cli

    tiny = tiny_flux_bench_family()
    real, calls = bench.real, []

    def on_cpu(name, preset_name, **kwargs):
        calls.append((name, preset_name, kwargs["rows"], kwargs["full_rows"], kwargs["depths"]))
        return real(tiny, "tiny", device="cpu", **kwargs)

    monkeypatch.setattr(cli, "_need_cuda", lambda *args: None)
    monkeypatch.setattr(bench, "real", on_cpu)
    path = tmp_path / "flux.json"
    result = _invoke("bench", "--family", "flux", "--depths", "1,2", "--full", "--full-row", "torch", "--row", "none",
                     "--row", "torch", "--steps", "1", "--json", str(path), "--png", str(tmp_path / "flux.png"))
    assert result.exit_code == 0, result.output
    assert calls == [("flux", "dev-1024", ["none", "torch"], ["torch"], "1,2")]
    doc = json.loads(path.read_text())
    assert doc["family"] == "flux" and doc["preset"] == "dev-1024" and doc["steps"] == 1
    assert "partial" not in doc["title"] and doc["title"] == "gradseam bench: flux dev-1024"
    assert {r["depth"] for r in doc["rows"]} == {1, 2} | {doc["depth"]["full"]}
    assert [r["strategy"] for r in doc["full_depth"]] == ["none", "torch"]
    assert "Measured:" in result.output and f"wrote {path}" in result.output


def test_advise_measures_with_the_gpu_size_and_prints_the_advice(tmp_path, monkeypatch):
    """The command around the ladder, without a GPU: the workload is built on "cuda", the ladder gets the
    GPU's size in GiB (positionally) and the static memory, the table, the JSON and the recommendation
    are printed; nothing that fits exits 1 with the reason."""
    import types

    from gradseam.tools import advise, cli, workloads

    seen = {}
    workload = types.SimpleNamespace(
        model="model", dropped_gib=0.5, fit_depths=(2, 4), plan="plan", preset_name="dev-1024",
        weights_note=", torchao-fp8, LoRA r=16",
        family=types.SimpleNamespace(name="flux"), inputs=lambda tokens: {"tokens": tokens})

    def build(fam, preset, **kwargs):
        seen["build"] = (fam.name, preset, kwargs)
        return workload

    trial = types.SimpleNamespace(label="torch", peak_gib=3.0, growth_gib=0.25, pinned_gib=None, step_ms=120.0,
                                  reason="", status="fits")
    advice = types.SimpleNamespace(
        depth_note="57 blocks (the preset's depth)", pinnable_gib=None, static_gib=24.0, trials=[trial],
        chosen=trial, compile=None, to_dict=lambda: {"chosen": "torch"},
        to_json=lambda: '{"gradient_checkpointing": true}', no_fit_message=lambda: "nothing fits: raise --gpu",
        per_block=None, per_block_note="")

    def run_ladder(model, inputs, gpu_gib, *, progress, **kwargs):
        assert callable(progress)  # a line per candidate (test_advise_prints_a_line_per_candidate_as_it_is_measured)
        seen["advise"] = (model, inputs, gpu_gib, kwargs)
        if gpu_gib < 10:
            raise advise.NoFitError(advice)  # type: ignore[arg-type]
        return advice

    monkeypatch.setattr(cli, "_need_cuda", lambda *args: None)
    monkeypatch.setattr(cli, "_model_class", lambda fam: None)
    monkeypatch.setattr(workloads, "build", build)
    monkeypatch.setattr(advise, "advise", run_ladder)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 2 << 30)
    path = tmp_path / "out" / "advice.json"
    result = _invoke("advise", "--family", "flux", "--gpu", "40GiB", "--tokens", "64", "--depth", "3",
                     "--json", str(path), "--base", "torchao-fp8", "--lora", "16")
    assert result.exit_code == 0, result.output
    assert seen["build"] == ("flux", "dev-1024", {"depth": "fit", "depths": None, "device": "cuda",
                                                  "base": "torchao-fp8", "lora": 16})
    assert seen["advise"] == ("model", {"tokens": 64}, 40.0, {"static_gib": 2.5, "depths": (2, 4), "depth": 3,
                                                              "plan": "plan", "pinnable_gib": None})
    out = result.stdout
    assert "flux dev-1024, torchao-fp8, LoRA r=16: planned for 57 blocks" in out and "strategies within 40.00 GiB (static 24.00 GiB" in out
    assert "recommended (torch)" in out and '"gradient_checkpointing": true' in out
    assert json.loads(path.read_text()) == {"chosen": "torch"}
    result = _invoke("advise", "--family", "flux", "--gpu-memory", "16GiB", "--host-memory", "64GiB")
    assert result.exit_code == 0, result.output
    assert seen["advise"][2] == 16.0 and seen["advise"][3]["pinnable_gib"] == 48.0, "3/4 of the host's memory"
    bad = _invoke("advise", "--family", "flux", "--gpu", "16GiB", "--host-memory", "lots")
    assert bad.exit_code == 2 and "host memory size: cannot read 'lots'" in bad.output
    # a per-block plan that beats the chosen rung is the recommendation: its figures, then its keys
    mix = types.SimpleNamespace(
        report=lambda keys=True: "per-block plan (predicted): units: 30 x compile, 10 x torch\n   step 90.0 ms: "
                                 "25.0% faster than torch (120.0 ms)",
        config={"gradient_checkpointing": True, "gradient_checkpointing_backend": "compile",
                "gradient_checkpointing_blocks": [{"blocks": "transformer_blocks[0:10]",
                                                   "gradient_checkpointing_backend": "torch"}]})
    advice.per_block = mix
    result = _invoke("advise", "--family", "flux", "--gpu", "40GiB")
    assert result.exit_code == 0, result.output
    out = " ".join(result.stdout.split())
    assert "per-block plan (predicted): units: 30 x compile, 10 x torch" in out and "recommended (torch)" not in out
    assert "recommended (the per-block plan" in out and '"gradient_checkpointing_backend": "compile"' in out
    assert out.index("recommended (the per-block plan") < out.index('"transformer_blocks[0:10]"')
    # no uniform candidate fits, the mix does: it is recommended, not "nothing fits"
    advice.chosen = None
    result = _invoke("advise", "--family", "flux", "--gpu", "40GiB")
    assert result.exit_code == 0 and "nothing fits" not in result.stdout, result.output
    assert "no uniform candidate fits both budgets; recommended: the per-block plan" in " ".join(result.stdout.split())
    advice.per_block = None
    result = _invoke("advise", "--family", "flux", "--gpu", "8GiB")
    assert result.exit_code == 1 and "nothing fits: raise --gpu" in result.stdout


def test_advise_prints_a_line_per_candidate_as_it_is_measured(monkeypatch):
    """A large model's ladder runs for minutes: each candidate measured is a line with its time, as it ends."""
    from test_advise import LADDER_VALUES, FakeMeasure

    from gradseam.tools import advise as advise_module
    from gradseam.tools import cli, workloads
    from gradseam.tools.estimates import NoFitError

    class Built:
        fit_depths, plan, dropped_gib, model = (2, 4), None, 0.0, None

        def inputs(self, tokens):
            return {}

    def fake_advise(model, inputs, gpu, *, progress, **kwargs):
        measure = advise_module.reporting(FakeMeasure(LADDER_VALUES), progress)
        measure(dict(advise_module.LADDER)["torch"])
        raise NoFitError(advise_module.Advice(gpu, 0.0))

    monkeypatch.setattr(cli, "_need_cuda", lambda *args: None)
    monkeypatch.setattr(cli, "_model_class", lambda fam: None)
    monkeypatch.setattr(workloads, "build", lambda *args, **kwargs: Built())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *args: 0)
    monkeypatch.setattr(advise_module, "advise", fake_advise)
    monkeypatch.setattr(cli, "_print_advice", lambda *args: None)
    result = _invoke("advise", "--family", "flux", "--gpu", "24GiB")
    assert re.search(r"^  torch: measured in \d+\.\d s \(1 candidates, \d+ s so far\)$", result.output, re.M), \
        result.output
