"""``gradseam bench --config-row 'LABEL=FILE.json'``: a user's own explicit config (a hand-chosen per-block plan, an
``auto`` row's ``plan.config``) measured as a row beside the built-in rows. On the CPU: the file's reading and every
refusal (before torch is imported), the rows chosen, the CPU status a config earns, and the --family path end to end
with a tiny Flux standing for the preset (as ``tests/test_cli.py`` runs it)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from gradseam import CheckpointConfig
from gradseam.config import REMEDY_FROM_DICT
from gradseam.errors import GradseamError
from gradseam.tools.bench_report import to_markdown
from gradseam.tools.bench_rows import (
    CONFIG_ROW_KEY,
    GPU_CAP_KEY,
    NEEDS_CUDA,
    NOT_ON_CPU_COMPILED,
    config_row,
    config_rows,
    cpu_status,
    full_depth_rows,
    real_rows,
    streams_weights,
)
from gradseam.tools.cli import app
from gradseam.tools.compiled import gradseam_keys

# the brief's example: a hand-chosen per-block plan, with every kind of key a user writes
PLAN = {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch",
        "gradient_checkpointing_offload_attention": True, "gradient_checkpointing_stream_weights": "all",
        "gradient_checkpointing_blocks": [{"blocks": "blocks[0:3]", "gradient_checkpointing_backend": "unsloth"}]}


def _write(tmp_path, data, name="plan.json"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def _refused(spec: str) -> str:
    with pytest.raises(GradseamError) as info:
        config_rows([spec])
    return str(info.value)


def test_a_config_row_is_its_label_and_the_files_keys_with_or_without_its_own_cap(tmp_path):
    path = _write(tmp_path, PLAN)
    label, config = config_row(f"mine={path}")
    assert label == "mine" and GPU_CAP_KEY not in config and config[CONFIG_ROW_KEY]
    assert gradseam_keys(config) == PLAN, "gradseam.patch must get the file's keys exactly, bench's own left out"
    label, config = config_row(f" mine @ 24GiB = {path} ")
    assert label == "mine @ 24GiB" and config[GPU_CAP_KEY] == 24.0 and gradseam_keys(config) == PLAN
    assert config_row(f"mine @ 24 GB={path}")[1][GPU_CAP_KEY] == pytest.approx(24e9 / 2**30)  # parse_size's units


def test_an_auto_rows_whole_plan_object_is_read_for_its_config(tmp_path):
    """What an auto row writes into bench's JSON (``plan``), pasted whole: its ``config`` is the row's keys."""
    planned = CheckpointConfig.from_dict(PLAN)
    plan = {"source": "measured", "config": planned.to_dict(), "report": "per-block plan ...",
            "predicted": {"gpu_gib": 19.3, "host_gib": 47.7, "step_ms": 15444.6}}
    _, config = config_row(f"mine={_write(tmp_path, plan)}")
    assert gradseam_keys(config) == planned.to_dict()
    assert CheckpointConfig.from_dict(gradseam_keys(config)) == planned
    _, only_config = config_row(f"again={_write(tmp_path, planned.to_dict(), 'config.json')}")
    assert gradseam_keys(only_config) == gradseam_keys(config), "plan.config alone is the same row"
    said = _refused(f"mine={_write(tmp_path, {**plan, 'config': [1, 2]}, 'bad-plan.json')}")
    assert "bad-plan.json" in said and '"config" is list' in said


def test_the_config_rows_come_after_the_built_in_rows_in_the_order_given(tmp_path):
    path = _write(tmp_path, PLAN)
    extra = config_rows([f"b @ 12GiB={path}", f"a={path}"])
    assert [label for label, _ in real_rows(["torch", "none"], extra=extra)] == ["none", "torch", "b @ 12GiB", "a"]
    everything = real_rows(extra=extra)
    assert [label for label, _ in everything[-2:]] == ["b @ 12GiB", "a"]
    assert [label for label, _ in everything[:-2]] == [label for label, _ in real_rows()]
    # --row may name them too: naming only them measures only them
    assert [label for label, _ in real_rows(["a"], extra=extra)] == ["b @ 12GiB", "a"]
    with pytest.raises(GradseamError, match=r"unknown bench rows \['c'\]"):
        real_rows(["torch", "c"], extra=extra)
    # --full-row names them by label: the others are predicted at the full depth
    assert [label for label, _ in full_depth_rows(["torch", "a"], extra)] == ["torch", "a"]
    assert full_depth_rows(None, extra) is None


def test_each_mistake_is_refused_naming_the_bad_value_and_the_fix(tmp_path):
    good = _write(tmp_path, PLAN)
    said = _refused("my-plan.json")
    assert "'my-plan.json'" in said and "expected LABEL=FILE.json" in said and "mine @ 24GiB=my-plan.json" in said
    assert "expected LABEL=FILE.json" in _refused(f"={good}") and "expected LABEL=FILE.json" in _refused("mine=")
    missing = str(tmp_path / "nope.json")
    said = _refused(f"mine={missing}")
    assert f"no file {missing!r}" in said and "check the path" in said and "JSON object of gradseam config keys" in said
    said = _refused(f"mine={_write(tmp_path, '{gradient_checkpointing: true', 'broken.json')}")
    assert "broken.json" in said and "is not valid JSON" in said
    said = _refused(f"mine={_write(tmp_path, [PLAN], 'list.json')}")
    assert "list.json" in said and "must hold a JSON object of keys, got list" in said
    said = _refused(f"mine={tmp_path}")
    assert repr(str(tmp_path)) in said and "cannot read" in said
    said = _refused(f"mine @ lots={good}")
    assert "GPU cap 'lots'" in said and "mine @ 24GiB" in said
    said = _refused(f"mine={_write(tmp_path, {'gradient_checkpointing_backend': 'auto'}, 'auto.json')}")
    assert '"auto"' in said and "--row 'auto'" in said


@pytest.mark.parametrize("label", [
    "torch", "none", "auto", "auto @ 24GiB", "torch @ 12GiB", "unsloth-compile + stream all", "ref: save_on_cpu",
    "ref: torch.utils.checkpoint", "compiled: torch + attention kept"])
def test_a_label_of_a_built_in_row_is_refused(tmp_path, label):
    said = _refused(f"{label}={_write(tmp_path, PLAN)}")
    assert f"the label {label!r} is a built-in row's" in said and "a label of its own" in said


def test_two_config_rows_under_one_label_are_refused(tmp_path):
    path = _write(tmp_path, PLAN)
    assert [label for label, _ in config_rows([f"mine={path}", f"mine @ 24GiB={path}"])] == ["mine", "mine @ 24GiB"]
    with pytest.raises(GradseamError, match=r"the label 'mine' is given twice"):
        config_rows([f"mine={path}", f"mine={path}"])


def test_an_unknown_key_is_refused_with_gradseams_own_message(tmp_path):
    typo = {"gradient_checkpointing": True, "gradient_checkpointing_backnd": "unsloth"}
    path = _write(tmp_path, typo, "typo.json")
    with pytest.raises(ValueError) as own:
        CheckpointConfig.from_dict(typo)
    said = _refused(f"mine={path}")
    assert "typo.json" in said and "'gradient_checkpointing_backnd'" in said
    assert "Did you mean 'gradient_checkpointing_backend'?" in said
    assert str(own.value).replace(" " + REMEDY_FROM_DICT, "") in said, "not gradseam's own message"
    assert "ignore_unknown" not in said, "the Python API's remedy means nothing on the command line"
    # a bad value, in a per-block entry too, is gradseam's message as well
    entry = {"gradient_checkpointing_blocks": [{"blocks": "blocks[0:3]", "gradient_checkpointing_interval": 2}]}
    said = _refused(f"mine={_write(tmp_path, entry, 'entry.json')}")
    assert "'gradient_checkpointing_interval' cannot be set per block" in said


def test_the_files_are_read_before_torch_is_imported(tmp_path):
    path = _write(tmp_path, PLAN)
    code = ("import sys; from gradseam.tools.bench_rows import config_rows, real_rows; "
            f"real_rows(['torch'], extra=config_rows(['mine @ 24GiB={path}'])); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_a_config_rows_cpu_status_is_what_its_keys_run(tmp_path):
    def status(data, label="mine"):
        return cpu_status(label, config_row(f"{label}={_write(tmp_path, data)}")[1])

    assert status({"gradient_checkpointing_backend": "torch"}) is None
    assert status({"gradient_checkpointing_backend": "torch"}, "mine @ 24GiB") == NEEDS_CUDA
    assert status({"gradient_checkpointing_backend": "unsloth"}) == NEEDS_CUDA  # copies to pinned host memory
    assert status({"gradient_checkpointing_backend": "unsloth-compile"}) == NEEDS_CUDA
    assert status({"gradient_checkpointing_backend": "compile"}) == NOT_ON_CPU_COMPILED
    assert status({"gradient_checkpointing_backend": "torch", "gradient_checkpointing_stream_weights": 2}) == NEEDS_CUDA
    # a per-block entry counts as the top level does
    assert status({"gradient_checkpointing_backend": "torch", "gradient_checkpointing_blocks": [
        {"blocks": "blocks[0:1]", "gradient_checkpointing_offload_attention": True}]}) == NEEDS_CUDA
    # a label that reads like a built-in variant says nothing: the config does
    assert status({"gradient_checkpointing_backend": "torch"}, "mine + stream all") is None


def test_weights_streamed_by_a_config_show_the_whole_gpu_column(tmp_path):
    assert streams_weights(PLAN) and not streams_weights({"gradient_checkpointing": True})
    assert streams_weights({"gradient_checkpointing_backend": "torch", "gradient_checkpointing_blocks": [
        {"blocks": "blocks[0:2]", "gradient_checkpointing_stream_weights": "all"}]})
    row = {"workload": "w", "tokens": 1, "strategy": "mine", "peak_gib": 1.0, "gpu_peak_gib": 9.5, "step_ms": 10.0,
           "pinned_gib": 2.0, "status": "ok", "depth": None, "vs_none": None, "vs_torch": None, "config": PLAN}
    assert "GPU peak GiB" in to_markdown([row]) and "9.5" in to_markdown([row])
    assert "GPU peak GiB" not in to_markdown([{**row, "config": {"gradient_checkpointing": True}}])


# -- the command line ---------------------------------------------------------------------------------

def _invoke(*args: str):
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200", "NO_COLOR": "1"}, prog_name="gradseam")


def test_the_command_refuses_a_bad_config_row_before_anything_is_built(tmp_path):
    result = _invoke("bench", "--family", "flux", "--config-row", "my-plan.json")
    assert result.exit_code == 2
    assert "Invalid value for '--config-row'" in result.output and "'my-plan.json'" in result.output
    result = _invoke("bench", "--family", "flux", "--config-row", f"torch={_write(tmp_path, PLAN)}")
    assert result.exit_code == 2 and "is a built-in row's" in result.output
    result = _invoke("bench", "--config-row", f"mine={_write(tmp_path, PLAN)}")
    assert result.exit_code == 2 and "--config-row" in result.output and "needs --family" in result.output
    assert "--config-row" in _invoke("bench", "--help").output


def test_a_config_row_is_measured_beside_the_built_in_rows_end_to_end(tmp_path, monkeypatch):
    """The --family path on the CPU, a tiny Flux standing for the preset: a per-block plan that checkpoints only the
    single-stream blocks (checkpointing left out at the top level: only its entry turns it on) is measured at the fit
    depths and, named by --full-row, at the full depth; it keeps less than no checkpointing and more than torch on
    every block, and the JSON records its keys."""
    from cases import tiny_flux_bench_family

    from gradseam.tools import bench, cli

    tiny = tiny_flux_bench_family()
    real, calls = bench.real, []

    def on_cpu(name, preset_name, **kwargs):
        calls.append(kwargs["config_rows"])
        return real(tiny, "tiny", device="cpu", **kwargs)

    monkeypatch.setattr(cli, "_need_cuda", lambda *args: None)
    monkeypatch.setattr(bench, "real", on_cpu)
    mine = {"gradient_checkpointing_blocks": [{"blocks": "single_transformer_blocks",
                                               "gradient_checkpointing_backend": "torch"}]}
    path = tmp_path / "flux.json"
    result = _invoke("bench", "--family", "flux", "--depths", "1,2", "--full", "--row", "none", "--row", "torch",
                     "--config-row", f"mine={_write(tmp_path, mine, 'mine.json')}", "--full-row", "mine",
                     "--steps", "1", "--json", str(path), "--png", str(tmp_path / "flux.png"))
    assert result.exit_code == 0, result.output
    assert [[label for label, _ in rows] for rows in calls] == [["mine"]]
    doc = json.loads(path.read_text())
    full = doc["depth"]["full"]
    rows = {(r["strategy"], r["depth"]): r for r in doc["rows"]}
    assert sorted(rows) == sorted([(s, d) for s in ("none", "torch", "mine") for d in (1, 2)] + [("mine", full)])
    assert [r["strategy"] for r in doc["rows"] if r["depth"] == 1] == ["none", "torch", "mine"]
    for depth in (1, 2, full):
        got = rows["mine", depth]
        assert got["status"] == "ok" and got["config"] == mine
    for depth in (1, 2):
        none, torch_, got = (rows[s, depth]["peak_gib"] for s in ("none", "torch", "mine"))
        assert torch_ < got < none, f"depth {depth}: the plan did not checkpoint (only) the single-stream blocks"
    assert all("config" not in r for r in doc["rows"] if r["strategy"] != "mine"), "other rows' fields changed"
    by = {r["strategy"]: r for r in doc["full_depth"]}
    assert by["mine"]["peak_source"] == "measured" and by["torch"]["peak_source"] == "predicted"
    assert "| mine |" in result.output
