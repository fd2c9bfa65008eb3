"""The config key gradient_checkpointing_stream_weights (issue 40, weight streaming): how it is read, what it
turns on, its ``gradseam run`` option and its line in ``describe()``. The planner's use of it is tested in
tests/test_weight_streaming.py; here only the key."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from gradseam import CheckpointConfig
from gradseam.config import KEY_SPECS, NEEDS_CHECKPOINTING, key_spec, render_options_table
from gradseam.tools import launch
from gradseam.tools.cli import app

KEY = "gradient_checkpointing_stream_weights"
runner = CliRunner()


def _invoke(*args: str):
    env = {"COLUMNS": "200", "NO_COLOR": "1", "RANK": None, "WORLD_SIZE": None}
    return runner.invoke(app, list(args), env=env, prog_name="gradseam")


# -- parsing -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("written", "stored"), [
    (None, None), (0, None), ("0", None), (" 0 ", None), (1, 1), (3, 3), ("3", 3), (" 8 ", 8), (10**6, 10**6),
    ("all", "all"), (" ALL ", "all"), ("All", "all"),
])
def test_accepted_forms_are_stored_as_none_an_int_or_all(written, stored):
    cfg = CheckpointConfig(**{KEY: written})
    value = getattr(cfg, KEY)
    assert value == stored and type(value) is type(stored)
    assert cfg.stream_weights == stored
    assert getattr(CheckpointConfig.from_dict({KEY: written}), KEY) == stored
    assert key_spec(KEY).read(KEY, written) == stored


@pytest.mark.parametrize(("written", "shown"), [
    (-1, "got -1"), ("-2", "got -2"), (True, "got True (bool)"), (False, "got False (bool)"),
    (2.5, "got 2.5 (float)"), (3.0, "got 3.0 (float)"), (0.0, "got 0.0 (float)"), ("half", "got 'half' (str)"),
    ("", "got '' (str)"), ("al l", "got 'al l' (str)"), ("2.0", "got '2.0' (str)"), ("²", "got '²' (str)"),
    ("9" * 5000, "got '9999"), ([3], "got [3] (list)"), ({"n": 3}, "(dict)"),
])
def test_rejected_forms_name_the_key_and_the_value_and_say_what_is_accepted(written, shown):
    with pytest.raises(ValueError, match=rf"^gradseam config key '{KEY}': ") as caught:
        CheckpointConfig(**{KEY: written})
    message = str(caught.value)
    assert shown in message
    assert '"all"' in message  # what would have been accepted
    assert ">= 0" in message


def test_a_negative_number_says_that_zero_or_null_streams_nothing():
    with pytest.raises(ValueError) as caught:
        CheckpointConfig.from_dict({KEY: -4})
    assert str(caught.value) == (f"gradseam config key '{KEY}': must be >= 0 or \"all\", got -4 "
                                 "(0 or null streams nothing).")


def test_a_json_file_and_its_round_trip(tmp_path):
    for written, stored in ((8, 8), ("all", "all"), (0, None), (None, None)):
        path = tmp_path / "gradseam.json"
        path.write_text(json.dumps({KEY: written}), encoding="utf-8")
        cfg = CheckpointConfig.from_json(path)
        assert getattr(cfg, KEY) == stored
        assert CheckpointConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    trainer = {"learning_rate": 1e-4, "blocks_to_swap": 8, KEY: "8"}
    assert getattr(CheckpointConfig.from_dict(trainer, ignore_unknown=True), KEY) == 8
    path.write_text(json.dumps({KEY: "most"}), encoding="utf-8")
    with pytest.raises(ValueError, match=f"^gradseam config key '{KEY}': .*got 'most' \\(str\\)"):
        CheckpointConfig.from_json(path)


# -- checkpointing ---------------------------------------------------------------------------------


def test_setting_it_turns_left_out_checkpointing_on():
    assert KEY in NEEDS_CHECKPOINTING and KEY_SPECS[KEY].needs_checkpointing
    for value in (1, "3", "all"):
        cfg = CheckpointConfig.from_dict({KEY: value})
        assert cfg.gradient_checkpointing is True and cfg.backend == "torch"
        assert "gradient_checkpointing" not in cfg.given_keys()  # decided, not written


@pytest.mark.parametrize("value", [None, 0, "0"])
def test_null_or_zero_does_not_turn_checkpointing_on(value):
    cfg = CheckpointConfig.from_dict({KEY: value})
    assert cfg.gradient_checkpointing is False
    assert cfg == CheckpointConfig()


def test_an_explicit_false_stays_false():
    cfg = CheckpointConfig.from_dict({"gradient_checkpointing": False, KEY: "all"})
    assert cfg.gradient_checkpointing is False and getattr(cfg, KEY) == "all"


# -- describe, docs ---------------------------------------------------------------------------------


def test_describe_mentions_the_streamed_blocks():
    assert CheckpointConfig(**{KEY: 8}).describe() == "torch, weights of 8 blocks streamed"
    assert CheckpointConfig(**{KEY: 1}).describe() == "torch, weights of 1 block streamed"
    assert CheckpointConfig(**{KEY: "ALL"}).describe() == "torch, weights of all blocks streamed"
    assert CheckpointConfig(gradient_checkpointing_backend="unsloth", **{KEY: 2}).describe() == (
        "unsloth, weights of 2 blocks streamed")
    assert "stream" not in CheckpointConfig(**{KEY: 0}).describe()
    assert "stream" not in CheckpointConfig(gradient_checkpointing=True).describe()


def test_the_options_table_has_its_row_and_counts_it_as_needing_checkpointing():
    table = render_options_table()
    row = next(line for line in table.splitlines() if line.startswith(f"| `{KEY}` |"))
    assert "blocks_to_swap" in row and "host memory" in row and "LoRA" in row
    assert "stream-weights" in table.splitlines()[2]  # the left-out rule of gradient_checkpointing names it


# -- gradseam run ----------------------------------------------------------------------------------


def test_run_help_lists_the_option_under_weight_streaming():
    result = _invoke("run", "--help")
    assert result.exit_code == 0, result.output
    out = result.output
    assert re.search(r"^Weight streaming:\n(?:  .*\n|\n(?=  ))*  --stream-weights N\|all ", out, re.MULTILINE), out
    flat = " ".join(out.split())
    assert f"{KEY}: {KEY_SPECS[KEY].help}; 'null' clears it" in flat


def test_the_option_reads_as_the_key():
    assert launch.FLAG_KEYS["--stream-weights"] == KEY
    assert getattr(launch.build_config(flags={"--stream-weights": "8"}), KEY) == 8
    assert getattr(launch.build_config(flags={"--stream-weights": " All "}), KEY) == "all"
    assert getattr(launch.build_config(flags={"--stream-weights": "null"}), KEY) is None
    with pytest.raises(launch.LaunchError, match=r"^--stream-weights -1: must be >= 0 or \"all\", got -1"):
        launch.build_config(flags={"--stream-weights": "-1"})


def test_the_option_reaches_the_program_config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "prog.py").write_text("pass\n")
    result = _invoke("run", "--stream-weights", "all", "--report", "run.json", "--", "prog.py")
    assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "run.json").read_text())["config"]
    assert config[KEY] == "all" and config["gradient_checkpointing"] is True
    result = _invoke("run", "--stream-weights", "some", "--", "prog.py")
    assert result.exit_code == 2
    assert "--stream-weights some: expected a number of blocks >= 0" in result.output + result.stderr


# -- gradient_checkpointing_stream_prefetch ---------------------------------------------------------

PREFETCH = "gradient_checkpointing_stream_prefetch"


@pytest.mark.parametrize(("given", "stored"), [(0, 0), (2, 2), ("3", 3), (" 1 ", 1)])
def test_the_prefetch_is_a_count_of_blocks(given, stored):
    config = CheckpointConfig.from_dict({"gradient_checkpointing_stream_weights": "all", PREFETCH: given})
    assert config.gradient_checkpointing_stream_prefetch == stored
    assert ("prefetch" in config.describe()) == (stored != 1)


@pytest.mark.parametrize("bad", [-1, "two", True, 1.5, None])
def test_a_bad_prefetch_names_the_key(bad):
    with pytest.raises(ValueError, match=PREFETCH):
        CheckpointConfig.from_dict({"gradient_checkpointing_stream_weights": "all", PREFETCH: bad})


def test_the_prefetch_alone_turns_nothing_on_and_warns_where_nothing_streams():
    from cases import WAN

    import gradseam

    config = CheckpointConfig.from_dict({PREFETCH: 2})
    assert not config.gradient_checkpointing, "a prefetch says how weights stream, not that checkpointing runs"
    model = WAN.fresh()
    with pytest.warns(UserWarning, match=rf"{PREFETCH}=2 set, but no weights stream.*does nothing"):
        handle = gradseam.patch(model, {"gradient_checkpointing": True, PREFETCH: 2})
    handle.remove()


def test_the_prefetch_reaches_the_stream():
    from cases import WAN

    import gradseam
    from gradseam.offload import cpu_test_mode

    model = WAN.fresh().requires_grad_(False)
    with cpu_test_mode(), gradseam.patch(model, {"gradient_checkpointing_stream_weights": 2, PREFETCH: 0}) as handle:
        assert handle.weights.prefetch == 0
