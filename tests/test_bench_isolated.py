"""``gradseam bench --isolate-rows``: each row measured by a ``gradseam bench`` process of its own, read back and
shown as one sweep (:mod:`gradseam.tools.bench_isolated`).

The row processes are faked here (a real one builds a billion-parameter model on a GPU): each writes the JSON a real
one writes for its row, through bench's own report functions, with figures chosen per row. One test runs real
processes, which stop on this machine's missing GPU: how a failed row reads.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from gradseam.tools import bench_isolated, checks, cli
from gradseam.tools import bench_report as report
from gradseam.tools.depth import DepthPlan
from gradseam.tools.results import RealRun, Result

runner = CliRunner()
WORKLOAD = "flux dev (4096 seq)"
# per row: step ms at depths 2 and 4 (and, measured at the full depth 8, the step there)
STEPS = {"none": (100.0, 180.0, 340.0), "torch": (130.0, 240.0, 460.0), "unsloth-compile @ 16GiB": (120.0, 220.0, None)}


def _invoke(*args: str):
    return runner.invoke(cli.app, list(args), env={"COLUMNS": "200", "NO_COLOR": "1"}, prog_name="gradseam")


def _option(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def fake_process(calls: list[list[str]], fail: set[str] = frozenset()):
    """A row's process: the JSON ``gradseam bench --row LABEL`` writes for its one row (or, for a label in ``fail``,
    nothing and exit code 1, as a process that crashed)."""

    def spawn(argv: list[str], log: Path) -> int:
        calls.append(argv)
        label = _option(argv, "--row")
        log.write_text(f"building flux\nTraceback ...\nRuntimeError: {label} broke\n")
        if label in fail:
            return 1
        shallow, deep, full = STEPS[label]
        run = RealRun(DepthPlan({"transformer_blocks": 8}), (2, 4), 8, weights_gib=22.18)
        run.results = [Result(WORKLOAD, 4096, label, 0.5 * d, ms, depth=d, pinned_gib=0.0,
                              blocks=f"{d} blocks") for d, ms in ((2, shallow), (4, deep))]
        if "--full" in argv and full is not None:
            run.results.append(Result(WORKLOAD, 4096, label, 4.0, full, depth=8, pinned_gib=0.0, blocks="8 blocks"))
        rows = report.with_ratios(run.results, [(ms, ms) for ms in (r.step_ms for r in run.results)])
        doc = report.payload(rows, "gradseam bench: flux dev", family="flux", preset="dev", weights_gib=22.18,
                             depth=report.depth_info(run, measured_full="--full" in argv),
                             full_depth=report.full_depth_rows(run))
        Path(_option(argv, "--json")).write_text(json.dumps(doc))
        return 0

    return spawn


@pytest.fixture
def gpu(monkeypatch):
    monkeypatch.setattr(cli, "_need_cuda", lambda *args: None)
    monkeypatch.setattr(cli, "_model_class", lambda fam: None)


def test_each_row_runs_alone_and_the_rows_are_set_side_by_side_with_ratios_across_processes(gpu, monkeypatch,
                                                                                            tmp_path):
    calls: list[list[str]] = []
    monkeypatch.setattr(bench_isolated, "spawn_process", fake_process(calls))
    path = tmp_path / "flux.json"
    result = _invoke("bench", "--family", "flux", "--row", "none", "--row", "torch", "--row",
                     "unsloth-compile @ 16GiB", "--full", "--full-row", "none", "--full-row", "torch", "--steps", "3",
                     "--json", str(path), "--isolate-rows")
    assert result.exit_code == 0, result.output
    assert [_option(argv, "--row") for argv in calls] == ["none", "torch", "unsloth-compile @ 16GiB"]
    for argv in calls:  # alone: one --row each, the sweep's own options, a JSON of its own
        assert argv.count("--row") == 1 and _option(argv, "--family") == "flux" and _option(argv, "--steps") == "3"
        assert Path(_option(argv, "--json")).parent == tmp_path / "flux-rows"
    assert ["--full" in argv for argv in calls] == [True, True, False], "--full only where --full-row names the row"
    doc = json.loads(path.read_text())
    deep = {row["strategy"]: row for row in doc["full_depth"]}
    assert deep["torch"]["step_ms"] == 460.0 and deep["torch"]["step_source"] == "measured"
    assert deep["torch"]["vs_none"] == pytest.approx(460.0 / 340.0, abs=1e-3), "vs none across processes"
    assert deep["unsloth-compile @ 16GiB"]["step_source"] == "predicted"
    assert deep["unsloth-compile @ 16GiB"]["step_ms"] == pytest.approx(120.0 + 50.0 * 6)
    torch_at_4 = next(r for r in doc["rows"] if r["strategy"] == "torch" and r["depth"] == 4)
    assert torch_at_4["vs_none"] == pytest.approx(240.0 / 180.0, abs=1e-3)
    assert torch_at_4["step_times_ms"] == [240.0, 240.0]
    assert doc["depth"]["measured_full"] and doc["weights_gib"] == 22.18 and doc["steps"] == 3
    assert "each row in a process of its own" in doc["title"]
    assert "| torch |" in result.output and "flux-rows" in result.output
    assert (tmp_path / "flux.png").exists() or "matplotlib is not installed" in result.output


def test_a_row_whose_process_wrote_nothing_is_a_row_naming_its_exit_and_last_line_and_the_others_go_on(
        gpu, monkeypatch, tmp_path):
    calls: list[list[str]] = []
    monkeypatch.setattr(bench_isolated, "spawn_process", fake_process(calls, fail={"torch"}))
    path = tmp_path / "flux.json"
    result = _invoke("bench", "--family", "flux", "--row", "none", "--row", "torch", "--row",
                     "unsloth-compile @ 16GiB", "--json", str(path), "--isolate-rows")
    assert result.exit_code == 0, result.output
    assert len(calls) == 3, "a failed row stopped the sweep"
    doc = json.loads(path.read_text())
    failed = next(r for r in doc["rows"] if r["strategy"] == "torch")
    log = tmp_path / "flux-rows" / "02-torch.log"
    assert failed["status"] == (f"error: its process exited with code 1 without writing its row (RuntimeError: "
                                f"torch broke; the whole output: {log})")
    assert failed["workload"] == WORKLOAD, "the failed row is not in the others' table"
    assert next(r for r in doc["full_depth"] if r["strategy"] == "torch")["status"] == failed["status"]
    assert "torch: error: its process exited with code 1" in result.output


def test_a_file_an_earlier_sweep_left_is_not_read_as_this_rows(gpu, monkeypatch, tmp_path):
    folder = tmp_path / "flux-rows"
    folder.mkdir()
    (folder / "01-none.json").write_text(json.dumps({"rows": [{"workload": "old", "tokens": 1, "strategy": "none",
                                                               "peak_gib": 1.0, "step_ms": 1.0}]}))
    monkeypatch.setattr(bench_isolated, "spawn_process", fake_process([], fail={"none"}))
    _invoke("bench", "--family", "flux", "--row", "none", "--json", str(tmp_path / "flux.json"), "--isolate-rows")
    (row,) = json.loads((tmp_path / "flux.json").read_text())["rows"]
    assert row["status"].startswith("error: its process exited with code 1")


def test_the_host_memory_and_a_config_row_go_to_their_own_rows_only(tmp_path):
    sweep = bench_isolated.Sweep("flux", "dev", gpu_memory="16GiB", host_memory="64GiB",
                                 config_rows=("mine @ 12GiB=plan.json",))
    auto = sweep.argv("auto @ 16GiB", tmp_path / "a.json")
    mine = sweep.argv("mine @ 12GiB", tmp_path / "m.json")
    plain = sweep.argv("none", tmp_path / "n.json")
    assert _option(auto, "--host-memory") == "64GiB" and "--host-memory" not in plain + mine
    assert _option(mine, "--config-row") == "mine @ 12GiB=plan.json" and "--config-row" not in plain + auto
    assert all(_option(argv, "--gpu-memory") == "16GiB" for argv in (auto, mine, plain))
    assert _option(plain, "--png") == str(tmp_path / "n.png")


def test_isolate_rows_needs_a_family():
    result = _invoke("bench", "--isolate-rows")
    assert result.exit_code == 2 and "--isolate-rows" in result.output and "needs --family" in result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="the rows' processes stop on the missing GPU")
def test_real_row_processes_that_stop_say_why_in_their_rows(gpu, tmp_path):
    """Real ``gradseam bench`` processes, one per row: on this machine each stops before building the model, and
    its row carries the process's own last line."""
    path = tmp_path / "flux.json"
    result = _invoke("bench", "--family", "flux", "--row", "none", "--row", "torch", "--json", str(path),
                     "--isolate-rows")
    assert result.exit_code == 0, result.output
    rows = json.loads(path.read_text())["rows"]
    assert [r["strategy"] for r in rows] == ["none", "torch"]
    for row in rows:
        assert row["status"].startswith("error: its process exited with code 2")
        assert "it needs a CUDA GPU" in row["status"], row["status"]


def test_the_sweeps_json_holds_the_rows_so_far_after_each_row(gpu, monkeypatch, tmp_path):
    """A sweep stopped between rows (Ctrl-C, a time limit's SIGTERM) keeps the rows measured, as one sweep's JSON
    does."""
    path = tmp_path / "flux.json"
    seen: list[list[str]] = []
    write = fake_process([])

    def spawn(argv: list[str], log: Path) -> int:
        if path.exists():
            seen.append([r["strategy"] for r in json.loads(path.read_text())["rows"]])
        return write(argv, log)

    monkeypatch.setattr(bench_isolated, "spawn_process", spawn)
    _invoke("bench", "--family", "flux", "--row", "none", "--row", "torch", "--json", str(path), "--isolate-rows")
    assert seen == [["none", "none"]], "the first row's two depths were not in the file when the second started"
    assert "partial" not in json.loads(path.read_text())["title"]


@pytest.mark.parametrize("isolate", [True, False], ids=["isolated", "one process"])
def test_a_full_row_naming_no_measured_row_is_refused_before_anything_runs(gpu, monkeypatch, tmp_path, isolate):
    """``--full-row`` picks which measured rows also run at the full depth: one that no ``--row`` names was measured
    nowhere and said nothing (on an H100 a call spent 67 s on the other row's fit depths alone). Refused, naming the
    label and the ``--row`` to add; a config row it names, and a default row with no ``--row`` at all, are fine."""
    from gradseam.tools import bench

    calls: list[list[str]] = []
    monkeypatch.setattr(bench_isolated, "spawn_process", fake_process(calls))
    monkeypatch.setattr(bench, "real", lambda *args, **kwargs: pytest.fail("the bench ran"))
    streamed = "unsloth-compile, budget 0.05 + stream 34 @ 24GiB"
    result = _invoke("bench", "--family", "wan", "--preset", "14b-480p", "--row", "unsloth-compile", "--full",
                     "--full-row", streamed, "--json", str(tmp_path / "wan.json"), *(["--isolate-rows"] * isolate))
    assert result.exit_code == 2 and not calls, result.output
    said = " ".join(result.output.split())
    assert f"'{streamed}' is not among the rows this bench measures" in said, said
    assert f"add --row '{streamed}'" in said, said
    assert checks.full_rows_measured(["torch"], None, None) is None  # every default row is measured
    assert checks.full_rows_measured(["mine"], ["none"], None, [("mine", {})]) is None
    with pytest.raises(checks.OptionError, match="'torch' is not among"):
        checks.full_rows_measured(["torch"], None, ["torch"])  # skipped, so not measured
