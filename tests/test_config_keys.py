"""Each config key is stated once: its field in CheckpointConfig with a KeySpec (issue 38).

What is made from the specs is checked against them here: the parsing, NEEDS_CHECKPOINTING and the
keys whose null means "left out", ``gradseam run``'s flags (launch.FLAG_KEYS, the typer options, their
help and sections, the option names of its "did you mean"), and docs/options.md's table of keys.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Annotated, Any

import pytest
import typer
from typer.testing import CliRunner

from gradseam import CheckpointConfig
from gradseam.config import (
    GROUP_ATTENTION,
    GROUP_AUTO,
    GROUP_CHECKPOINTING,
    GROUP_COMPILED,
    GROUP_WEIGHTS,
    KEY_SPECS,
    LEFT_OUT,
    NEEDS_CHECKPOINTING,
    KeySpec,
    key_spec,
    render_options_table,
)
from gradseam.tools import cli_support, launch
from gradseam.tools.cli import app

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "gradient_checkpointing_"
runner = CliRunner()

# one valid value per key, away from its default, as a command line writes it
SET = {
    "gradient_checkpointing": True,
    "gradient_checkpointing_backend": "torch",  # the default value, but given: it counts
    "gradient_checkpointing_interval": "2",
    "gradient_checkpointing_segment_stride": "3",
    "gradient_checkpointing_offload_attention": True,
    "gradient_checkpointing_offload_pin_memory_max_buckets": "3",
    "gradient_checkpointing_keep_attention": True,
    "gradient_checkpointing_memory_budget": "0.3",
    "gradient_checkpointing_stream_weights": "all",
    "gradient_checkpointing_stream_prefetch": "2",
    "gradient_checkpointing_blocks": '[{"blocks": "blocks[0:2]", "gradient_checkpointing_backend": "unsloth"}]',
}
# The budgets of "auto" act with it alone (beside another backend they are refused), so they are set beside it.
AUTO_SET = {
    "gradient_checkpointing_backend": "auto",
    "gradient_checkpointing_gpu_memory": "24GiB",
    "gradient_checkpointing_host_memory": "48",
}
AUTO_ONLY = {"gradient_checkpointing_gpu_memory", "gradient_checkpointing_host_memory"}
# Per-block entries are written as JSON text on the command line (the spec's value type) and held as tuples
# (hashable, as the frozen config is); an empty list is no entries, as null is.
STRUCTURED = {"gradient_checkpointing_blocks": tuple}


def _invoke(*args: str):
    env = {"COLUMNS": "200", "NO_COLOR": "1", "RANK": None, "WORLD_SIZE": None}
    return runner.invoke(app, list(args), env=env, prog_name="gradseam")


def _run_command() -> Any:
    group = typer.main.get_command(app)
    return group.commands["run"]  # type: ignore[attr-defined]


# -- the specs ------------------------------------------------------------------------------------


def test_every_field_carries_its_spec():
    fields = dataclasses.fields(CheckpointConfig)
    assert tuple(KEY_SPECS) == CheckpointConfig.keys() == tuple(f.name for f in fields)
    assert set(SET) | AUTO_ONLY == set(KEY_SPECS) and set(AUTO_SET) >= AUTO_ONLY
    for f in fields:
        spec = key_spec(f.name)
        assert isinstance(spec, KeySpec) and spec is KEY_SPECS[f.name]
        assert spec.group in (GROUP_CHECKPOINTING, GROUP_ATTENTION, GROUP_COMPILED, GROUP_WEIGHTS, GROUP_AUTO), f.name
        assert spec.help and "\n" not in spec.help and spec.doc and spec.doc_type and spec.doc_default, f.name
        # the value type is the field's, besides null; a bool is a switch and takes no metavar
        # (a size is command-line text, held as GiB: a float)
        assert spec.value.__name__ in str(f.type) or f.name in STRUCTURED or f.name in AUTO_ONLY, (f.name, f.type)
        assert (spec.value is bool) == (spec.metavar == "") == (spec.negative_flag is not None), f.name
        if spec.nullable:
            assert f.default is None and "None" in str(f.type), f.name
    flags = [flag for spec in KEY_SPECS.values() for flag in spec.flags]
    assert len(flags) == len(set(flags))


def test_each_flag_is_its_key_without_the_prefix():
    for key, spec in KEY_SPECS.items():
        short = key.removeprefix(PREFIX) if key != "gradient_checkpointing" else "checkpointing"
        assert spec.flag == "--" + short.replace("_", "-"), key


def test_needs_checkpointing_is_what_turns_checkpointing_on():
    """Left out, gradient_checkpointing is on exactly where a key of NEEDS_CHECKPOINTING is set."""
    turns_on = {key for key, value in SET.items() if key != "gradient_checkpointing"
                and CheckpointConfig.from_dict({key: value}).enabled}
    assert turns_on == set(NEEDS_CHECKPOINTING)
    assert NEEDS_CHECKPOINTING == ("gradient_checkpointing_backend", "gradient_checkpointing_interval",
                                   "gradient_checkpointing_segment_stride", "gradient_checkpointing_keep_attention",
                                   "gradient_checkpointing_memory_budget", "gradient_checkpointing_stream_weights")
    # set at their defaults, only the backend counts (given at all); the others need a value that acts
    assert CheckpointConfig.from_dict({"gradient_checkpointing_keep_attention": False}).enabled is False
    assert CheckpointConfig.from_dict({"gradient_checkpointing_interval": None}).enabled is False


def test_left_out_keys_are_decided_and_refuse_a_written_null():
    assert LEFT_OUT == ("gradient_checkpointing", "gradient_checkpointing_backend")
    cfg = CheckpointConfig(gradient_checkpointing_interval=2)
    assert cfg.enabled is True and cfg.backend == "torch" and cfg.given_keys() == {
        k: v for k, v in cfg.to_dict().items() if k not in LEFT_OUT}
    for key in LEFT_OUT:
        with pytest.raises(ValueError, match=rf"^gradseam config key '{key}': expected .*got None \(NoneType\)"):
            CheckpointConfig.from_dict({key: None})
        assert CheckpointConfig(**{key: None}) == CheckpointConfig()  # a keyword None: left out


@pytest.mark.parametrize("key", list(KEY_SPECS))
def test_null_is_a_value_exactly_for_the_nullable_keys(key):
    spec = KEY_SPECS[key]
    if spec.nullable:
        assert getattr(CheckpointConfig.from_dict({key: None}), key) is None
        assert getattr(launch.build_config(flags={spec.flag: "null"}), key) is None
        assert getattr(launch.build_config(flags={spec.flag: " None "}), key) is None
    elif key not in LEFT_OUT:
        with pytest.raises(ValueError, match=f"gradseam config key '{key}'"):
            CheckpointConfig.from_dict({key: None})
    if not spec.nullable and spec.value is not bool:
        with pytest.raises(launch.LaunchError, match=f"^{spec.flag} null: "):
            launch.build_config(flags={spec.flag: "null"})


@pytest.mark.parametrize("key", list(KEY_SPECS))
def test_a_keys_parser_is_its_specs(key):
    spec = KEY_SPECS[key]
    given = AUTO_SET if key in AUTO_ONLY else SET
    value = spec.read(key, given[key])
    assert type(value) is STRUCTURED.get(key, float if key in AUTO_ONLY else spec.value)
    beside = {"gradient_checkpointing_backend": "auto"} if key in AUTO_ONLY else {}
    assert getattr(CheckpointConfig.from_dict({"gradient_checkpointing": True, **beside, key: given[key]}), key) == value
    with pytest.raises(ValueError, match=f"^gradseam config key '{key}': "):
        spec.read(key, [] if key not in STRUCTURED else 7)


# -- gradseam run ---------------------------------------------------------------------------------


def test_launch_tables_come_from_the_specs():
    assert {spec.flag: key for key, spec in KEY_SPECS.items()} == launch.FLAG_KEYS
    assert {key for key, spec in KEY_SPECS.items() if spec.nullable} == launch._NULLABLE
    assert {flag: key for key, spec in KEY_SPECS.items() for flag in spec.flags} == launch._SPELLINGS


def test_run_has_one_option_per_key_made_from_its_spec():
    command = _run_command()
    by_flag = {param.opts[0]: param for param in command.params if param.opts and param.opts[0].startswith("--")}
    for key, spec in KEY_SPECS.items():
        param = by_flag[spec.flag]
        assert list(param.secondary_opts) == ([spec.negative_flag] if spec.negative_flag else [])
        assert param.help == spec.option_help(key) and param.help.startswith(f"{key}: {spec.help}")
        assert param.rich_help_panel == spec.group
        assert param.default is None  # left out unless given: the config decides the default
        if spec.value is not bool:
            assert param.metavar == spec.metavar
    others = {flag for flag in by_flag if flag not in launch.FLAG_KEYS}
    assert others == {"--config", "--ignore-unknown", "--report"}


def test_run_help_lists_every_option_with_its_help_under_its_group():
    out = _invoke("run", "--help").output
    sections: dict[str, str] = {}
    for match in re.finditer(r"^(\w[\w ]*):\n((?:  .*\n|\n(?=  ))*)", out, re.MULTILINE):
        sections[match.group(1)] = match.group(2)
    assert list(sections)[:7] == ["Arguments", GROUP_CHECKPOINTING, GROUP_ATTENTION, GROUP_COMPILED, GROUP_WEIGHTS, GROUP_AUTO,
                                  "Options"]
    flat = {name: " ".join(text.split()) for name, text in sections.items()}
    for key, spec in KEY_SPECS.items():
        shown = spec.flag + (f" / {spec.negative_flag}" if spec.negative_flag else f" {spec.metavar}")
        assert shown in flat[spec.group], (key, flat[spec.group])
        help_words = " ".join(spec.option_help(key).split())
        assert help_words.replace(" ", "") in flat[spec.group].replace(" ", ""), key  # wrapped anywhere
    for option in ("--config FILE", "--ignore-unknown", "--report FILE"):
        assert option in flat["Options"]


def test_every_key_option_reaches_the_config(tmp_path, monkeypatch):
    """Each option given on the command line arrives in the program's config (through the report)."""
    import json

    monkeypatch.chdir(tmp_path)
    (tmp_path / "prog.py").write_text("pass\n")
    for values in ({**SET, "gradient_checkpointing_offload_attention": False,
                    "gradient_checkpointing_memory_budget": None}, AUTO_SET):
        args = []
        for key, value in values.items():
            spec = KEY_SPECS[key]
            if spec.value is bool:
                args.append(spec.flag if value else spec.negative_flag)
            else:
                args += [spec.flag, "null" if value is None else str(value)]
        result = _invoke("run", *args, "--report", "run.json", "--", "prog.py")
        assert result.exit_code == 0, result.output
        config = json.loads((tmp_path / "run.json").read_text())["config"]
        assert config == CheckpointConfig.from_dict(values).to_dict()


def test_a_mistyped_option_is_matched_against_every_spelling(tmp_path):
    """The "did you mean" of `gradseam run` reads the command's own options, ``--no-`` forms included."""
    (tmp_path / "prog.py").write_text("pass\n")
    result = _invoke("run", "--no-keep-atention", str(tmp_path / "prog.py"))
    assert result.exit_code == 2
    assert "no such option: --no-keep-atention. Did you mean --no-keep-attention?" in result.stderr
    result = _invoke("run", "--gradient_checkpointing_keep_attention", str(tmp_path / "prog.py"))
    assert "The option for config key 'gradient_checkpointing_keep_attention' is --keep-attention." in result.stderr


def test_with_key_options_makes_an_option_of_a_new_key(monkeypatch):
    """Adding a key is its field and its spec: the command's options follow the specs they are made from."""
    extra = KeySpec(flag="--new-knob", value=int, metavar="K", parse=lambda key, value, nullable: int(value),
                    group=GROUP_COMPILED, help="a knob added later", nullable=True, doc_type="int",
                    doc_default="null", doc="a knob")
    monkeypatch.setattr(cli_support, "KEY_SPECS", {**KEY_SPECS, "gradient_checkpointing_new_knob": extra})
    seen: list[dict[str, Any]] = []
    probe = typer.Typer(cls=cli_support.Group, rich_markup_mode=None)

    @probe.command(cls=cli_support.Command)
    @cli_support.with_key_options
    def go(
        name: Annotated[str, typer.Option(help="a parameter of the command's own")] = "x",
        *,
        flags: dict[str, Any],
    ) -> None:
        seen.append({"name": name, **flags})

    @probe.command(cls=cli_support.Command)
    def other() -> None:
        pass

    result = runner.invoke(probe, ["go", "--new-knob", "4", "--no-keep-attention", "--name", "y"])
    assert result.exit_code == 0, result.output
    assert seen == [{"name": "y", "--new-knob": "4", "--keep-attention": False}]
    help_text = " ".join(runner.invoke(probe, ["go", "--help"], env={"COLUMNS": "200"}).output.split())
    assert "--new-knob K gradient_checkpointing_new_knob: a knob added later; 'null' clears it" in help_text


# -- docs/options.md ------------------------------------------------------------------------------


def _page_table() -> str:
    lines = (ROOT / "docs" / "options.md").read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| key |"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return "\n".join(lines[start:end]) + "\n"


def test_the_options_page_table_is_the_rendering_of_the_specs():
    rendered = render_options_table()
    assert _page_table() == rendered, (
        "docs/options.md's table of keys differs from the keys' specs; replace it with "
        "gradseam.config.render_options_table():\n" + rendered)


def test_the_rendering_has_a_row_per_key_in_order():
    rows = render_options_table().splitlines()[2:]
    assert [row.split("|")[1].strip() for row in rows] == [f"`{key}`" for key in KEY_SPECS]
    first = rows[0]
    for key in NEEDS_CHECKPOINTING:  # the left-out rule names every key that needs checkpointing
        assert KEY_SPECS[key].flag.removeprefix("--") in first
    assert "{needs_checkpointing}" not in render_options_table()
