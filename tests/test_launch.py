"""``gradseam run``: an unmodified program runs with load-time patching, as Python would run it.

In-process (typer's CliRunner) for what the program sees (argv, ``__main__``, ``__file__``,
``sys.path[0]``, exit status) and for the config and command-line checks; subprocesses for the
real thing: a diffusers-style LoRA trainer (tests/scripts/train_lora_flux.py) run plainly and under
``python -m gradseam run`` must train bit-identically on the CPU, and under ``torchrun`` and
``accelerate launch`` every rank is patched.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from gradseam import CheckpointConfig
from gradseam.tools.cli import app
from gradseam.tools.launch import LaunchError, build_config, report_path

TRAINER = Path(__file__).parent / "scripts" / "train_lora_flux.py"
runner = CliRunner()

PROBE = """
import json, os, sys
with open(os.environ["PROBE_OUT"], "w") as f:
    json.dump({"argv": sys.argv, "name": __name__, "file": __file__, "path0": sys.path[0],
               "main": sys.modules["__main__"].__dict__ is globals()}, f)
"""


def _run(*args: str, env: dict[str, str] | None = None):
    clean = {"RANK": None, "WORLD_SIZE": None}
    return runner.invoke(app, ["run", *args], env={**clean, **(env or {})}, prog_name="gradseam")


def _script(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(body))
    return path


# -- what the program sees -------------------------------------------------------------------------


def test_script_sees_its_argv_main_file_and_path(tmp_path):
    script = _script(tmp_path / "dir" / "probe.py", PROBE)
    out = tmp_path / "seen.json"
    # options after the script, and a second --, belong to the script
    result = _run("--backend", "torch-ffn", "--", str(script), "--lr", "1e-4", "-x", "--", "--backend", "y",
                  env={"PROBE_OUT": str(out)})
    assert result.exit_code == 0, result.output
    seen = json.loads(out.read_text())
    assert seen == {
        "argv": [str(script), "--lr", "1e-4", "-x", "--", "--backend", "y"],
        "name": "__main__", "file": str(script), "path0": str(script.parent), "main": True,
    }
    # left as the program had them for the rest of the process (its threads, atexit), as under python;
    # conftest puts them back for the next test
    assert sys.argv == seen["argv"] and sys.path[0] == str(script.parent)
    assert sys.modules["__main__"].__file__ == str(script)
    assert "[gradseam] running " in result.stderr and "torch-ffn" in result.stderr


def test_without_double_dash_the_program_starts_at_the_first_argument(tmp_path):
    script = _script(tmp_path / "probe.py", PROBE)
    out = tmp_path / "seen.json"
    result = _run(str(script), "--interval", "2", env={"PROBE_OUT": str(out)})
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["argv"][1:] == ["--interval", "2"]


@pytest.mark.parametrize("form", [["-m", "gs_pkg_a.train"], ["-mgs_pkg_b.train"]])
def test_module_runs_like_python_dash_m(tmp_path, monkeypatch, form):
    package = form[-1].removeprefix("-m").split(".")[0]  # one per case: this process keeps imported packages
    _script(tmp_path / package / "__init__.py", "")
    module = _script(tmp_path / package / "train.py", PROBE)
    out = tmp_path / "seen.json"
    monkeypatch.chdir(tmp_path)
    result = _run(*form, "a", "--b", env={"PROBE_OUT": str(out)})
    assert result.exit_code == 0, result.output
    seen = json.loads(out.read_text())
    assert seen["argv"] == [str(module), "a", "--b"] and seen["name"] == "__main__"
    assert seen["path0"] == str(tmp_path) and seen["main"]


@pytest.mark.parametrize(("body", "code", "stderr"), [
    ("pass", 0, None),
    ("import sys; sys.exit()", 0, None),
    ("import sys; sys.exit(3)", 3, None),
    ("import sys; sys.exit('stopped: no data')", 1, "stopped: no data"),
    ("def train():\n    raise ValueError('boom')\ntrain()", 1, "ValueError: boom"),
    ("raise KeyboardInterrupt", 130, "KeyboardInterrupt"),
], ids=["ok", "exit-none", "exit-3", "exit-str", "exception", "ctrl-c"])
def test_exit_status_is_the_programs(tmp_path, body, code, stderr):
    script = _script(tmp_path / "prog.py", body + "\n")
    result = _run(str(script))
    assert result.exit_code == code, result.output
    assert f"[gradseam] exit code {code}" in result.stderr
    if stderr is not None:
        assert stderr in result.stderr
    if "Error" in (stderr or "") or "Interrupt" in (stderr or ""):
        # a traceback as Python prints it: starting in the program, without the launcher's frames
        tb = result.stderr[result.stderr.index("Traceback"):]
        assert f'File "{script}", line ' in tb.splitlines()[1]
        assert "launch.py" not in tb and "runpy" not in tb


def test_nothing_patched_is_said_at_exit(tmp_path):
    result = _run(str(_script(tmp_path / "prog.py", "x = 1\n")))
    assert result.exit_code == 0
    assert "no model was patched" in result.stderr and "flux" in result.stderr


# -- models loaded by the program ------------------------------------------------------------------

LOADER = """
import sys, torch
from diffusers import FluxTransformer2DModel

model = FluxTransformer2DModel.from_pretrained(sys.argv[1])
g = torch.Generator().manual_seed(0)
for _ in range(2):  # two training forwards
    out = model(hidden_states=torch.randn(1, 16, 4, generator=g), encoder_hidden_states=torch.randn(1, 8, 16, generator=g),
                pooled_projections=torch.randn(1, 8, generator=g), timestep=torch.tensor([0.5]),
                img_ids=torch.randn(16, 3, generator=g), txt_ids=torch.zeros(8, 3)).sample
    out.square().mean().backward()
with torch.no_grad():  # sampling: no region runs
    model(hidden_states=torch.randn(1, 16, 4), encoder_hidden_states=torch.randn(1, 8, 16),
          pooled_projections=torch.randn(1, 8), timestep=torch.tensor([0.5]), img_ids=torch.randn(16, 3),
          txt_ids=torch.zeros(8, 3))
"""


@pytest.fixture(scope="module")
def tiny_flux(tmp_path_factory):
    from cases import FLUX

    path = tmp_path_factory.mktemp("flux") / "transformer"
    torch.manual_seed(FLUX.seed)
    FLUX.build().save_pretrained(path)
    return path


def test_loaded_model_is_patched_reported_and_counted(tmp_path, tiny_flux):
    script = _script(tmp_path / "load.py", LOADER)
    report = tmp_path / "reports" / "run.json"  # the directory is created before the run
    result = _run("--backend", "torch", "--interval", "2", "--report", str(report), str(script), str(tiny_flux))
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("[gradseam] patched")]
    assert lines == ["[gradseam] patched FluxTransformer2DModel: family flux, torch, interval 2; checkpointed "
                     "blocks: transformer_blocks 2/2, single_transformer_blocks 5/5 (4 regions)"]
    assert "exit code 0; patched 1 model(s): FluxTransformer2DModel: flux, torch, interval 2, 4/4 regions ran " \
           "(8 region runs)" in result.stderr
    assert "single_transformer_blocks[4]" in result.stderr  # the summary table
    doc = json.loads(report.read_text())
    assert doc["exit_code"] == 0 and doc["world_size"] == 1
    assert doc["config"] == CheckpointConfig(gradient_checkpointing=True, gradient_checkpointing_interval=2).to_dict()
    (model,) = doc["models"]
    assert model["family"] == "flux" and model["component"] is None and model["regions"] == 4
    assert model["blocks"] == {"transformer_blocks": {"checkpointed": 2, "total": 2},
                               "single_transformer_blocks": {"checkpointed": 5, "total": 5}}
    runs = {r["label"]: r for r in model["region_runs"]}
    assert set(runs) == {"transformer_blocks[0, 1]", "single_transformer_blocks[0, 1]",
                         "single_transformer_blocks[2, 3]", "single_transformer_blocks[4]"}
    # each region ran once per training forward, as one region (no_grad sampling runs none)
    assert all(r["runs"] == 2 and r["whole"] and set(r["calls"]) == {2} for r in runs.values())


def test_config_errors_stop_before_the_program(tmp_path):
    marker = tmp_path / "ran"
    script = _script(tmp_path / "prog.py", f"open({str(marker)!r}, 'w')\n")
    result = _run("--backend", "torch_fnn", str(script))
    assert result.exit_code == 2 and not marker.exists()
    assert result.stderr.strip().count("\n") == 0 and "Traceback" not in result.stderr
    assert "Did you mean 'torch-ffn'?" in result.stderr


# -- the config ------------------------------------------------------------------------------------


def test_config_precedence_file_then_flags(tmp_path):
    assert build_config() == CheckpointConfig(gradient_checkpointing=True)  # checkpointing is on by default
    file = tmp_path / "gs.json"
    file.write_text(json.dumps({"gradient_checkpointing_backend": "torch-ffn", "gradient_checkpointing_interval": 3}))
    assert build_config(file) == CheckpointConfig(
        gradient_checkpointing=True, gradient_checkpointing_backend="torch-ffn", gradient_checkpointing_interval=3)
    cfg = build_config(file, flags={"--backend": "unsloth", "--interval": "null", "--offload-attention": True,
                                    "--offload-pin-memory-max-buckets": "4"})
    assert cfg == CheckpointConfig(
        gradient_checkpointing=True, gradient_checkpointing_backend="unsloth",
        gradient_checkpointing_offload_attention=True, gradient_checkpointing_offload_pin_memory_max_buckets=4)
    file.write_text(json.dumps({"gradient_checkpointing": "false", "gradient_checkpointing_offload_attention": True}))
    assert not build_config(file).gradient_checkpointing  # the file's explicit false wins over the default
    assert build_config(file, flags={"--checkpointing": True}).gradient_checkpointing
    assert build_config(flags={"--keep-attention": True}).keep_attention


def test_memory_budget_flag_reaches_the_config(tmp_path, monkeypatch):
    """``--memory-budget`` is a float flag for gradient_checkpointing_memory_budget; "null" clears it."""
    cfg = build_config(flags={"--backend": "unsloth-compile", "--memory-budget": "0.3"})
    assert cfg == CheckpointConfig(gradient_checkpointing=True, gradient_checkpointing_backend="unsloth-compile",
                                   gradient_checkpointing_memory_budget=0.3)
    assert cfg.memory_budget == 0.3 and isinstance(cfg.gradient_checkpointing_memory_budget, float)
    file = tmp_path / "gs.json"
    file.write_text(json.dumps({"gradient_checkpointing_backend": "compile", "gradient_checkpointing_memory_budget": 0.5}))
    assert build_config(file).memory_budget == 0.5
    assert build_config(file, flags={"--memory-budget": "0.25"}).memory_budget == 0.25  # the flag wins
    cleared = build_config(file, flags={"--memory-budget": "null"})
    assert cleared.gradient_checkpointing_memory_budget is None and cleared.memory_budget == 0.1  # the default
    # a budget no model could use is refused before the program starts; from the file it is named by its key
    with pytest.raises(LaunchError, match=r"^gradient_checkpointing_memory_budget=0.5 .*backend 'torch' compiles nothing"):
        build_config(file, flags={"--backend": "torch"})
    # through the command line, as a user types it: the report records the config the program ran under
    monkeypatch.chdir(tmp_path)
    _script(tmp_path / "prog.py", "pass\n")
    result = _run("--backend", "unsloth-compile", "--memory-budget", "0.3", "--report", "run.json", "--", "prog.py")
    assert result.exit_code == 0, result.output
    assert "memory budget 0.3" in result.stderr
    doc = json.loads((tmp_path / "run.json").read_text())
    assert doc["config"]["gradient_checkpointing_backend"] == "unsloth-compile"
    assert doc["config"]["gradient_checkpointing_memory_budget"] == 0.3


def test_every_config_key_has_a_run_flag():
    from gradseam.tools.launch import FLAG_KEYS

    assert sorted(FLAG_KEYS.values()) == sorted(CheckpointConfig.keys())
    assert all(flag == "--" + key.removeprefix("gradient_checkpointing_").replace("_", "-")
               for flag, key in FLAG_KEYS.items() if key != "gradient_checkpointing")
    help_text = CliRunner().invoke(app, ["run", "--help"], env={"COLUMNS": "200"}).output
    assert all(flag in help_text for flag in FLAG_KEYS)


def test_trainer_config_needs_ignore_unknown(tmp_path):
    file = tmp_path / "trainer.json"
    file.write_text(json.dumps({"learning_rate": 1e-4, "gradient_checkpointing_backend": "torch-ffn"}))
    with pytest.raises(LaunchError, match=r"unknown gradseam config key 'learning_rate'.*Add --ignore-unknown") as err:
        build_config(file)
    assert "ignore_unknown=True" not in str(err.value)  # the Python API's remedy, not the command line's
    assert build_config(file, ignore_unknown=True).backend == "torch-ffn"


def test_unknown_key_errors_speak_the_command_lines_words(tmp_path, monkeypatch):
    """A key in the file is named as a config key (that is what a file holds), the remedy is the
    --ignore-unknown flag, a value that came from a flag is named by its flag, and a config key
    typed as an option is pointed to its flag."""
    monkeypatch.chdir(tmp_path)
    _script(tmp_path / "prog.py", "raise SystemExit('the program must not run')\n")
    (tmp_path / "typo.json").write_text(json.dumps({"gradient_checkpointing_backnd": "torch"}))
    (tmp_path / "flagname.json").write_text(json.dumps({"segment-stride": 4}))
    (tmp_path / "interval.json").write_text(json.dumps({"gradient_checkpointing_interval": 3}))
    cases = [
        (["--config", "typo.json"], "--config: 'typo.json' holds the unknown gradseam config key "
         "'gradient_checkpointing_backnd'. Did you mean 'gradient_checkpointing_backend'? Valid keys: "),
        (["--config", "flagname.json"], "Did you mean 'gradient_checkpointing_segment_stride'? A config file holds "
         "the config keys; 'segment-stride' is the name of the --segment-stride option."),
        (["--interval", "3", "--segment-stride", "2"], "--segment-stride: must be >= --interval (3), got 2."),
        (["--config", "interval.json", "--segment-stride", "2"],  # the interval came from the file: its key
         "--segment-stride: must be >= gradient_checkpointing_interval (3), got 2."),
        (["--gradient_checkpointing_backend", "torch"], "no such option: --gradient_checkpointing_backend. The "
         "option for config key 'gradient_checkpointing_backend' is --backend."),
    ]
    for args, message in cases:
        result = _run(*args, "prog.py")
        assert result.exit_code == 2, result.output
        assert result.stderr.startswith("gradseam run: error: ") and result.stderr.count("\n") == 1
        assert message in result.stderr, result.stderr
        assert "ignore_unknown=True" not in result.stderr and "Pass ignore_unknown" not in result.stderr
    assert "Add --ignore-unknown to read the gradseam keys out of a whole trainer config." in _run(
        "--config", "typo.json", "prog.py").stderr


@pytest.mark.parametrize(("args", "message"), [
    (["--interval", "0"], "--interval 0: must be >= 1, got 0 (use null to disable)."),
    (["--interval", "two"], "--interval two: expected an integer >= 1 or null, got 'two'"),
    (["--segment-stride", "-1"], "--segment-stride -1: must be >= 1"),
    (["--interval", "3", "--segment-stride", "2"], "--segment-stride: must be >= --interval (3), got 2"),
    (["--offload-pin-memory-max-buckets", "-2"], "--offload-pin-memory-max-buckets -2: must be >= 0"),
    (["--backend", "unsloth_ffn"], "--backend unsloth_ffn: 'unsloth_ffn' is not a backend; allowed: ['torch', "
                                   "'torch-ffn', 'unsloth', 'unsloth-ffn', 'compile', 'unsloth-compile', 'auto']. "
                                   "Did you mean 'unsloth-ffn'?"),
    (["--memory-budget", "2"], "--memory-budget 2: must be >= 0 and <= 1, got 2.0."),
    (["--memory-budget", "-0.1"], "--memory-budget -0.1: must be >= 0 and <= 1, got -0.1."),
    (["--memory-budget", "half"], "--memory-budget half: expected a number 0 <= B <= 1 or null, got 'half'"),
    (["--backend", "torch", "--memory-budget", "0.3"], "--memory-budget=0.3 is the compiler's activation memory "
     "budget for compiled blocks; backend 'torch' compiles nothing. Use it with ['compile', 'unsloth-compile']"),
    (["--no-checkpointing", "--memory-budget", "0.3"], "(checkpointing is off)' compiles nothing"),
    (["--backend", "compile", "--interval", "2"], "--interval=2: backend 'compile' makes every compiled block its own "
     "region (the compiler decides what each keeps), so blocks cannot be chunked."),
    (["--backend", "compile", "--offload-attention"], "--offload-attention: backend 'compile' already keeps attention "
     "outputs (the compiler's partitioner keeps what is costly to recompute); to hold them in CPU memory use "
     "'unsloth-compile'."),
    (["--ignore-unknown"], "--ignore-unknown reads the gradseam keys out of a trainer config; it needs --config FILE."),
    (["--config", "missing.json"], "--config: cannot read 'missing.json': No such file or directory."),
    (["--backen", "torch"], "no such option: --backen. Did you mean --backend?"),
    (["-m"], "-m needs a module name"),
    (["-m", "gradseam_no_such_module"], "-m gradseam_no_such_module: no module named 'gradseam_no_such_module'."),
    ([], "name the program to run: gradseam run [OPTIONS] [--] script.py [ARGS]... or -m module [ARGS]..."),
    (["no_such_script.py"], "can't open file 'no_such_script.py': no such file (the program to run)."),
    (["--report"], "Option '--report' requires an argument."),
])
def test_run_option_errors_are_one_line_and_exit_2(tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    _script(tmp_path / "prog.py", "raise SystemExit('the program must not run')\n")
    program = [] if any(a in args for a in ("-m", "no_such_script.py", "--report")) or not args else ["prog.py"]
    result = _run(*args, *program)
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("gradseam run: error: ") and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr
    assert "the program must not run" not in result.output


def test_config_file_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    result = _run("--config", str(bad), "x.py")
    assert result.exit_code == 2 and f"--config: gradseam config file '{bad}' is not valid JSON" in result.stderr
    result = _run("--config", str(tmp_path), "x.py")
    assert result.exit_code == 2 and f"--config: cannot read '{tmp_path}'" in result.stderr


def test_report_path_per_rank(tmp_path):
    assert report_path("r.json", 0, 1) == Path("r.json")
    assert report_path("out/r.json", 3, 8) == Path("out/r.rank3.json")
    assert report_path("r-{rank}.json", 3, 8) == Path("r-3.json")
    script = _script(tmp_path / "prog.py", "raise SystemExit('the program must not run')\n")
    result = _run("--report", str(tmp_path), str(script))
    assert result.exit_code == 2 and "the program must not run" not in result.output
    assert result.stderr == f"gradseam run: error: Invalid value for '--report': {str(tmp_path)!r} is a directory; name a file.\n"


def test_report_lands_where_the_command_said_though_the_program_changes_directory(tmp_path, monkeypatch):
    """A hydra-style trainer moves into its own run directory; the report still goes to the path as
    typed, relative to the directory ``gradseam run`` was started in."""
    script = _script(tmp_path / "prog.py", """
        import os
        os.makedirs("outputs/run-1", exist_ok=True)
        os.chdir("outputs/run-1")
    """)
    monkeypatch.chdir(tmp_path)  # restores the test's directory after the program moved it
    result = _run("--report", "report.json", str(script))
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "report.json").read_text())["exit_code"] == 0
    assert not (tmp_path / "outputs" / "run-1" / "report.json").exists()
    assert f"wrote {tmp_path / 'report.json'}" in result.stderr  # says where, absolutely


CLOSES_STREAMS = """
import io, sys
sys.stdout.close()
sys.stdout = io.StringIO()
sys.stderr.close()
sys.stderr = io.StringIO()
sys.stderr.close()
"""


# A program that closes its streams and ends well is the exit-3 case with status 0: one subprocess pair fewer (~7 s
# on a 2-core runner); exit status 0 through `gradseam run` is the trainer tests' and the in-process CLI tests'.
@pytest.mark.parametrize(("tail", "code", "stderr"), [
    ("sys.exit(3)", 3, None),
    ("raise ValueError('boom')", 1, "ValueError: boom"),
], ids=["exit-3", "exception"])
def test_a_program_that_closes_its_streams_keeps_its_exit_code(tmp_path, tail, code, stderr):
    """Python exits with the program's status whatever it did to sys.stdout / sys.stderr; so does
    ``gradseam run``, and its summary (and the program's last words) still reach the stderr it was
    started with. A subprocess: only real file descriptors show this."""
    script = _script(tmp_path / "prog.py", CLOSES_STREAMS + tail + "\n")
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=_env(), timeout=60)
    assert plain.returncode == code
    done = subprocess.run([sys.executable, "-m", "gradseam", "run", str(script)], capture_output=True, text=True,
                          env=_env(), cwd=tmp_path, timeout=300)
    assert done.returncode == code, done.stderr[-3000:]
    assert f"[gradseam] exit code {code}; no model was patched" in done.stderr
    if stderr is not None:  # the program's last words, on the stderr it had closed
        assert stderr in done.stderr
    if "Error" in (stderr or ""):  # the program's traceback, starting in the program
        assert f'File "{script}", line ' in done.stderr and "launch.py" not in done.stderr
    else:
        assert "Traceback" not in done.stderr


def test_kept_stream_writes_through_a_duplicate_once_the_stream_is_closed(tmp_path):
    from gradseam.tools.launch import KeptStream

    read, write = os.pipe()
    stream = open(write, "w", encoding="utf-8")  # noqa: SIM115 - closed below, as a program would
    kept = KeptStream(stream)
    kept.write("before\n")
    stream.close()  # closes the descriptor too; the kept duplicate stays open
    kept.write("after\n")
    kept.close()
    with open(read, encoding="utf-8") as pipe:
        assert pipe.read() == "before\nafter\n"
    no_fd = KeptStream(io.StringIO())
    no_fd.stream.close()
    no_fd.write("dropped, not raised\n")  # nothing to fall back to: the line is lost, the launch is not
    no_fd.close()


# -- the real thing: subprocesses ------------------------------------------------------------------


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("GRADSEAM_PLUGINS", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


@pytest.fixture(scope="module")
def tiny_pipeline(tmp_path_factory):
    """A pipeline directory as diffusers' trainers expect it: transformer/ and scheduler/ subfolders."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel

    root = tmp_path_factory.mktemp("tiny-flux")
    torch.manual_seed(0)
    FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 6, 6],
    ).save_pretrained(root / "transformer")
    FlowMatchEulerDiscreteScheduler().save_pretrained(root / "scheduler")
    return root


def _train(prefix: list[str], model: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [*prefix, str(TRAINER), "--pretrained_model_name_or_path", str(model), "--output_dir", str(out), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=out.parent, timeout=300)


@pytest.fixture(scope="module")
def plain_run(tiny_pipeline, tmp_path_factory):
    """The unmodified trainer, run plainly: the losses and LoRA every launch through ``gradseam run`` is held to."""
    out = tmp_path_factory.mktemp("plain-run") / "plain"
    done = _train([sys.executable], tiny_pipeline, out)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[gradseam]" not in done.stderr
    return out


def test_trainer_under_gradseam_run_trains_as_the_plain_run(tmp_path, tiny_pipeline, plain_run):
    """The same unmodified trainer, plainly and through ``python -m gradseam run --backend torch-ffn`` (the same
    command, run side by side): the same losses and the same LoRA bytes, and every FFN region ran."""
    ffn, ffn_report = tmp_path / "ffn", tmp_path / "ffn.json"
    launcher = [sys.executable, "-m", "gradseam", "run", "--backend", "torch-ffn", "--report", str(ffn_report), "--"]
    done = _train(launcher, tiny_pipeline, ffn)
    assert done.returncode == 0, done.stderr[-3000:]

    # torch-ffn: bit-identical
    losses = json.loads((plain_run / "losses.json").read_text())
    assert len(losses) == 3 and json.loads((ffn / "losses.json").read_text()) == losses
    lora = (plain_run / "pytorch_lora_weights.safetensors").read_bytes()
    assert (ffn / "pytorch_lora_weights.safetensors").read_bytes() == lora
    assert "[gradseam] patched FluxTransformer2DModel: family flux, torch-ffn;" in done.stderr
    # gradseam really checkpointed: every FFN region ran once per step, as one region, LoRA'd proj_mlp included
    (model,) = json.loads(ffn_report.read_text())["models"]
    runs_by_label = {r["label"]: (r["shape"], r["runs"], r["whole"]) for r in model["region_runs"]}
    assert runs_by_label == {
        "transformer_blocks[0].ff": ("ffn", 3, True),
        "transformer_blocks[0].ff_context": ("ffn", 3, True),
        "single_transformer_blocks[0].proj_mlp→act_mlp": ("ffn", 3, True),
    }


# Under `-m compiled` only (pyproject.toml deselects the mark by default), to keep the suite within CI's time (a third
# trainer process and its compiling, ~10 s on a 2-core runner): what it adds to the torch-ffn launch above is the
# compiled backend in a training loop, which tests/test_compiled_backend.py runs in-process (steps, region counts,
# PEFT LoRA before and after patching) and tests/test_fsdp.py's script check under FSDP2.
@pytest.mark.compiled
def test_trainer_under_gradseam_run_with_compiled_blocks_trains_as_the_plain_run(tmp_path, tiny_pipeline, plain_run):
    """``--backend compile`` (``aot_eager`` on the CPU, under the memory budget): the losses and the saved LoRA match
    the plain run's to the compiled tolerance, and every block ran compiled (the report's region counts)."""
    from safetensors.torch import load_file

    from gradseam.testing import COMPILED_TOLERANCE

    compiled, compiled_report = tmp_path / "compiled", tmp_path / "compiled.json"
    compiling = [sys.executable, "-m", "gradseam", "run", "--backend", "compile", "--memory-budget", "0.3",
                 "--report", str(compiled_report), "--"]
    done = _train(compiling, tiny_pipeline, compiled)
    assert done.returncode == 0, done.stderr[-3000:]
    losses = json.loads((plain_run / "losses.json").read_text())
    got = json.loads((compiled / "losses.json").read_text())
    assert torch.allclose(torch.tensor(got), torch.tensor(losses), rtol=COMPILED_TOLERANCE)
    want = load_file(plain_run / "pytorch_lora_weights.safetensors")
    trained = load_file(compiled / "pytorch_lora_weights.safetensors")
    assert trained.keys() == want.keys() and want
    for key, value in want.items():
        assert torch.allclose(trained[key], value, rtol=COMPILED_TOLERANCE, atol=COMPILED_TOLERANCE), key
    assert "[gradseam] patched FluxTransformer2DModel: family flux, compile" in done.stderr
    (model,) = json.loads(compiled_report.read_text())["models"]
    assert all(row["strategy"].startswith("compile") for row in model["summary"]), model["summary"]
    assert [(r["runs"], r["fallbacks"]) for r in model["region_runs"]] == [(3, {}), (3, {})], model["region_runs"]


def test_every_torchrun_rank_is_patched(tmp_path, tiny_pipeline):
    pytest.importorskip("torch.distributed.run")
    out = tmp_path / "ddp"
    out.mkdir()
    done = _train([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "gradseam", "run",
                   "--backend", "torch", "--report", str(tmp_path / "r.json"), "--"], tiny_pipeline, out,
                  "--max_train_steps", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        assert f"[gradseam rank {rank}/2] patched FluxTransformer2DModel: family flux, torch;" in done.stderr
        doc = json.loads((tmp_path / f"r.rank{rank}.json").read_text())
        assert doc["rank"] == rank and doc["world_size"] == 2 and doc["exit_code"] == 0
        assert all(r["runs"] >= 1 and r["whole"] for r in doc["models"][0]["region_runs"])
    assert (out / "pytorch_lora_weights.safetensors").is_file()


def test_accelerate_launch_runs_gradseam_as_the_program(tmp_path):
    pytest.importorskip("accelerate")
    script = _script(tmp_path / "probe.py", PROBE + "sys.exit(5)\n")
    out = tmp_path / "seen.json"
    env = {**_env(), "PROBE_OUT": str(out), "HF_HOME": str(tmp_path / "hf")}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--num_machines", "1",
           "--no_python", str(Path(sys.executable).parent / "gradseam"), "run", "--", str(script), "--flag"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode != 0  # accelerate reports a failed program as its own exit status 1
    assert "[gradseam] exit code 5; no model was patched" in done.stderr
    assert json.loads(out.read_text())["argv"] == [str(script), "--flag"]
