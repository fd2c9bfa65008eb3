"""``gradseam bench`` rows with streamed weights and a capped GPU (issue 40): the labels, the options' errors and
the table's whole-GPU column, on the CPU (the rows themselves need CUDA: ``tests/test_gpu_streaming.py`` and
docs/benchmarks.md)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from gradseam.errors import GradseamError
from gradseam.tools import bench as b
from gradseam.tools.bench_report import to_markdown, with_ratios
from gradseam.tools.bench_rows import (
    CPU_STATUS_WHY,
    GPU_CAP_KEY,
    NAIVE_KEY,
    NEEDS_CUDA,
    cpu_status,
    real_rows,
)
from gradseam.tools.cli import app
from gradseam.tools.results import Result

STREAM = "gradient_checkpointing_stream_weights"


def test_any_gradseam_row_can_stream_its_weights_by_label():
    rows = dict(real_rows(["none", "unsloth-compile + stream all", "torch + stream 20"]))
    assert rows["none"] is None
    assert rows["unsloth-compile + stream all"] == {**dict(real_rows(["unsloth-compile"]))["unsloth-compile"],
                                                    STREAM: "all"}
    assert rows["torch + stream 20"][STREAM] == 20
    assert rows["torch + stream 20"]["gradient_checkpointing_backend"] == "torch"


def test_a_row_can_say_its_prefetch_and_its_own_gpu_cap():
    rows = dict(real_rows(["unsloth-compile + stream all prefetch 0 @ 12GiB", "unsloth-compile @ 24 GB"]))
    streamed = rows["unsloth-compile + stream all prefetch 0 @ 12GiB"]
    assert streamed[STREAM] == "all" and streamed["gradient_checkpointing_stream_prefetch"] == 0
    assert streamed[GPU_CAP_KEY] == 12.0
    assert rows["unsloth-compile @ 24 GB"][GPU_CAP_KEY] == pytest.approx(24e9 / 2**30)
    assert STREAM not in rows["unsloth-compile @ 24 GB"]
    assert cpu_status("unsloth-compile @ 24 GB") == NEEDS_CUDA


def test_a_rows_cap_is_taken_out_before_gradseam_sees_the_config(monkeypatch):
    """The cap is bench's, not a gradseam key: the row patches with the rest (an unknown key would raise)."""
    seen = []
    monkeypatch.setattr(b, "capped", lambda gib: (seen.append(gib), __import__("contextlib").nullcontext())[1])
    monkeypatch.setattr(b.measuring, "measure", lambda step, **kw: b.measuring.Measurement(0.0, 1.0, 0.0, None))
    model = __import__("cases").WAN.fresh()
    config = dict(real_rows(["torch @ 12GiB"]))["torch @ 12GiB"]
    sweep = b._Sweep("w", 1, model, lambda: (lambda: 0), 1, "blocks", "cpu", None, None, None)
    result = b._measure_row(sweep, "torch @ 12GiB", config)
    assert seen == [12.0] and result.status == "ok"
    assert GPU_CAP_KEY in config, "the row's own config is left as it was"


def test_a_streamed_row_reports_its_weights_host_memory_apart(monkeypatch):
    """As measured on a GPU (the measurement faked, the stream in the CPU test mode): the streamed weights'
    pinned bytes are a field of their own and part of the row's pinned host memory."""
    import torch

    from gradseam.offload import cpu_test_mode

    monkeypatch.setattr(b, "capped", lambda gib: __import__("contextlib").nullcontext())
    monkeypatch.setattr(b.measuring, "measure",
                        lambda step, **kw: b.measuring.Measurement(1.0, 10.0, 0.5, None, base_gib=2.0, alloc_retries=3))
    model = __import__("cases").WAN.fresh().requires_grad_(False)
    label = "torch + stream all @ 12GiB"
    sweep = b._Sweep("w", 1, model, lambda: (lambda: 0), 1, "blocks", "cuda", None, None, None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # measuring.release on this CPU machine
    with cpu_test_mode():
        result = b._measure_row(sweep, label, dict(real_rows([label]))[label])
    assert result.status == "ok" and result.gpu_peak_gib == 3.0
    assert result.pinned_weights_gib == 0.0 and result.pinned_gib == 0.5  # test mode: pageable host copies
    assert result.alloc_retries == 3  # the allocator's retries over the timed steps, kept in the row


def test_the_naive_reference_row_streams_with_bench_setting_the_stream_naive(monkeypatch):
    """``+ stream all naive``: the same stream, bench's own key taken out before gradseam sees the config, and
    the stream told to copy each block in and out on the compute stream (the reference of the overlap)."""
    import torch

    from gradseam.offload import cpu_test_mode

    label = "torch + stream all naive @ 12GiB"
    config = dict(real_rows([label]))[label]
    assert config[NAIVE_KEY] is True and config[STREAM] == "all" and config[GPU_CAP_KEY] == 12.0
    seen = []

    def measure(step, **kw):
        seen.append(__import__("gradseam").handle_of(model).weights.naive)
        return b.measuring.Measurement(1.0, 10.0, 0.5, None, base_gib=2.0)

    monkeypatch.setattr(b, "capped", lambda gib: __import__("contextlib").nullcontext())
    monkeypatch.setattr(b.measuring, "measure", measure)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    model = __import__("cases").WAN.fresh().requires_grad_(False)
    sweep = b._Sweep("w", 1, model, lambda: (lambda: 0), 1, "blocks", "cuda", None, None, None)
    with cpu_test_mode():
        result = b._measure_row(sweep, label, config)
    assert result.status == "ok" and seen == [True]
    assert NAIVE_KEY in config, "the row's own config is left as it was"


@pytest.mark.parametrize("label", ["torch + stream all naive prefetch 1", "torch naive", "torch + stream all naive x"])
def test_the_naive_reference_takes_no_prefetch_and_needs_streaming(label):
    with pytest.raises(GradseamError, match="unknown bench rows"):
        real_rows([label])


@pytest.mark.parametrize("label", ["none + stream 2", "torch + stream 0", "torch + stream -1", "torch + stream x",
                                   "ref: compile, memory budget 0.1 + stream all", "nonsense + stream all",
                                   "torch @ lots", "none @ 24GiB", "torch + stream all prefetch x"])
def test_a_row_that_cannot_stream_is_an_unknown_row_naming_the_form(label):
    with pytest.raises(GradseamError, match=r"unknown bench rows.*'\+ stream N' or '\+ stream all'.*@ 24GiB") as info:
        real_rows([label])
    assert repr(label) in str(info.value)


def test_the_cpu_mode_says_a_streamed_row_needs_cuda():
    assert cpu_status("unsloth-compile + stream all") == NEEDS_CUDA
    assert "streams weights" in CPU_STATUS_WHY[NEEDS_CUDA]
    ran = b.run_rows("w", 1, __import__("torch").nn.Linear(1, 1), lambda: (lambda: 0),
                     real_rows(["torch + stream all"]), device="cpu")
    assert [r.status for r in ran] == [NEEDS_CUDA]


def test_the_table_shows_the_whole_gpu_peak_where_a_row_streams():
    rows = [Result("w", 1, "unsloth-compile", 1.0, 100.0, pinned_gib=1.0, gpu_peak_gib=27.5),
            Result("w", 1, "unsloth-compile + stream all", 1.2, 110.0, pinned_gib=28.0, gpu_peak_gib=3.25),
            Result("w", 1, "torch + stream all", None, None, "OOM")]
    table = to_markdown(with_ratios(rows))
    header, rule, *body = table.splitlines()
    assert "| GPU peak GiB |" in header and header.count("|") == rule.count("|")
    assert all(line.count("|") == header.count("|") for line in body if line.startswith("|"))
    assert "| 3.25 | 28.00 |" in table
    plain = to_markdown(with_ratios(rows[:1]))
    assert "GPU peak" not in plain, "tables without streaming keep their columns"
    capped = to_markdown(with_ratios([Result("w", 1, "unsloth-compile @ 24GiB", 1.0, 100.0, gpu_peak_gib=23.5)]))
    assert "| GPU peak GiB |" in capped and "| 23.50 |" in capped, "a row with its own cap shows it too"


@pytest.mark.parametrize(("args", "message"), [
    (["--gpu-memory", "24GiB"], "needs --family"),
    (["--family", "wan", "--gpu-memory", "lots"], "cannot read 'lots'"),
    (["--family", "wan", "--gpu-memory", "0"], "positive"),
])
def test_gpu_memory_errors_name_the_option(args, message):
    result = CliRunner().invoke(app, ["bench", *args])
    assert result.exit_code != 0
    assert "--gpu-memory" in result.output and message in result.output


def test_capped_rows_are_measured_at_the_fit_depths_of_a_full_run_except_those_streaming_a_count():
    """A --full run builds the whole model; at a fit depth the blocks outside it are parked in host memory
    (gradseam.tools.parking), so a capped row is measured there beside the weights it runs. One streaming a count
    of blocks is not: its count is the same at every depth, and its figures there are not reported. Said, not tried."""
    rows = real_rows(["unsloth-compile", "unsloth-compile + stream all @ 12GiB", "torch + stream 30 @ 16GiB"])
    assert not b.parks_at_fit_depths(real_rows(["unsloth-compile", "torch + stream 30"]), None), "nothing capped"
    assert not b.parks_at_fit_depths(real_rows(["auto @ 24GiB", "torch + stream 30 @ 16GiB"]), None), \
        "every capped row is left to the full depth"
    assert b.parks_at_fit_depths(rows, None) and b.parks_at_fit_depths(real_rows(["torch"]), 24.0)
    rule_out = b.capped_at_fit_depth(rows, None)
    assert rule_out("unsloth-compile") is None and rule_out("unsloth-compile + stream all @ 12GiB") is None
    assert "streams a count of blocks, the same count at every depth" in rule_out("torch + stream 30 @ 16GiB")
    everything = b.capped_at_fit_depth(rows, 24.0)  # --gpu-memory caps every row
    assert everything("unsloth-compile") is None and everything("torch + stream 30 @ 16GiB") is not None
    counted = b.capped_at_fit_depth([("mine", {"gradient_checkpointing_stream_weights": 12})], 24.0)
    assert "streams a count of blocks" in counted("mine"), "a config row streaming a count by its key"


def test_a_run_without_full_parks_the_blocks_between_its_fit_depths_where_a_capped_row_runs():
    """Without --full the model is built at the deeper fit depth; at the shallower one a capped row ran beside the
    blocks between the two cuts (Wan 2.1 14B on an H100: 1.31 GiB of them under a 12 GiB cap). Every capped row is
    measured at both depths there, one streaming a count too; an auto row alone parks nothing (it plans the cut model
    it is given, parking what its own cuts leave out), nor does a run with nothing capped."""
    assert b.parks_at_fit_depths(real_rows(["unsloth-compile", "torch + stream 30 @ 16GiB"]), None, full=False)
    assert b.parks_at_fit_depths(real_rows(["torch"]), 12.0, full=False), "--gpu-memory caps every row"
    assert not b.parks_at_fit_depths(real_rows(["unsloth-compile", "torch + stream all"]), None, full=False)
    assert not b.parks_at_fit_depths(real_rows(["auto @ 12GiB"]), None, full=False)
    assert b.parks_at_fit_depths(real_rows(["auto @ 12GiB", "torch @ 12GiB"]), None, full=False)
    # the same rows in a full run: the count left to the full depth, so nothing parks for it
    assert not b.parks_at_fit_depths(real_rows(["unsloth-compile", "torch + stream 30 @ 16GiB"]), None)
