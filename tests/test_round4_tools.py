"""Round 4 of the newcomer's findings in the tools (issue 37): ``gradseam run``'s ``__main__`` for the life of
the process, ``families``' columns, argument checks before the heavy imports, bench's CPU labels and
single-step ratios, and CLI warnings that name no internal line.

Subprocesses where only a real process shows the behaviour (a thread or an ``atexit`` handler after the
program's top level returned, what a fresh interpreter has imported, how Python prints a warning).
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
import warnings

import pytest
from typer.testing import CliRunner

from gradseam.tools import checks
from gradseam.tools.cli import app

runner = CliRunner()


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("GRADSEAM_PLUGINS", "RANK", "WORLD_SIZE")}
    env.update(OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1", **extra)
    return env


def _invoke(*args: str, columns: str = "200"):
    return runner.invoke(app, list(args), env={"COLUMNS": columns, "NO_COLOR": "1", "RANK": None, "WORLD_SIZE": None},
                         prog_name="gradseam")


class _MainState:
    """Stands for the script's ``__main__.State`` when the test reads the pickles back."""


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) == ("__main__", "State"):
            return _MainState
        return super().find_class(module, name)


# -- `gradseam run`: the program's module is __main__ for the rest of the process ----------------------

SAVES_LATE = """
import atexit, pickle, sys, threading, time

class State:
    def __init__(self, step):
        self.step = step

def save(path, step):
    with open(path, "wb") as f:
        pickle.dump(State(step), f)

out = sys.argv[1]
atexit.register(save, out + "/atexit.pkl", 2)

def writer():
    time.sleep(0.3)  # the loop is over and the top level has returned: the writer is still saving
    save(out + "/thread.pkl", 1)

threading.Thread(target=writer).start()  # not a daemon: the process waits for it, as under python
"""


def test_a_checkpoint_thread_and_an_atexit_save_pickle_the_scripts_classes(tmp_path):
    """runpy put the launcher's ``__main__`` back when the script's top level returned, so a checkpoint
    writer thread and an ``atexit`` save failed ("Can't pickle <class '__main__.State'>"), left truncated
    files, and the exit status was 0. Under ``python script.py`` both work; under ``gradseam run`` too."""
    script = tmp_path / "train.py"
    script.write_text(SAVES_LATE)
    done = subprocess.run([sys.executable, "-m", "gradseam", "run", "--", str(script), str(tmp_path)],
                          capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "pickle" not in done.stderr.lower() and "Traceback" not in done.stderr, done.stderr[-3000:]
    for name, step in (("thread.pkl", 1), ("atexit.pkl", 2)):
        with open(tmp_path / name, "rb") as f:
            assert _Unpickler(f).load().step == step, name


def test_the_programs_module_stays_main_after_its_top_level_returns(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text("class State:\n    step = 3\n")
    result = _invoke("run", str(script))
    assert result.exit_code == 0, result.output
    main = sys.modules["__main__"]  # conftest puts the test process's own back after the test
    assert main.__file__ == str(script) and main.__name__ == "__main__"
    assert pickle.loads(pickle.dumps(main.State())).step == 3  # found by pickle as __main__.State


def test_dash_m_package_runs_its_main_and_a_package_without_one_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "seen.json"
    (tmp_path / "gs_round4_pkg").mkdir()
    (tmp_path / "gs_round4_pkg" / "__init__.py").write_text("")
    (tmp_path / "gs_round4_pkg" / "__main__.py").write_text(textwrap.dedent(f"""
        import json, sys
        with open({str(out)!r}, "w") as f:
            json.dump({{"argv": sys.argv, "name": __name__, "spec": __spec__.name}}, f)
    """))
    result = _invoke("run", "-m", "gs_round4_pkg", "x")
    assert result.exit_code == 0, result.output
    seen = json.loads(out.read_text())
    assert seen == {"argv": [str(tmp_path / "gs_round4_pkg" / "__main__.py"), "x"], "name": "__main__",
                    "spec": "gs_round4_pkg.__main__"}
    (tmp_path / "gs_round4_nomain").mkdir()
    (tmp_path / "gs_round4_nomain" / "__init__.py").write_text("")
    result = _invoke("run", "-m", "gs_round4_nomain")
    assert result.exit_code == 2
    assert result.stderr.startswith("gradseam run: error: -m gs_round4_nomain: no module named "
                                    "'gs_round4_nomain.__main__'; 'gs_round4_nomain' is a package and cannot be "
                                    "directly executed."), result.stderr


# -- `gradseam families`: interval, stride and the seams, apart ----------------------------------------


def test_families_show_interval_and_stride_apart_and_the_seams():
    """`interval/stride: no` hid that a stride works for every family; the seams (what is cut where)
    were only in docs/families.md."""
    result = _invoke("families", columns="80")  # not a terminal here: the whole table, nothing cut
    assert result.exit_code == 0, result.output
    out = result.output
    header = next(line for line in out.splitlines() if "family" in line and "stride" in line)
    for column in ("FFN seams", "attention side", "interval", "stride"):
        assert column in header
    assert "interval/stride" not in out

    def row(name: str) -> str:
        return next(line for line in out.splitlines() if line.startswith(f"│ {name} "))

    assert "│ no (block by block) " in row("chroma") and row("chroma").rstrip().endswith("│ yes    │")
    assert "FluxTransformerBlock: ff, ff_context" in row("flux") and "FluxTransformerBlock: attn" in row("flux")
    assert "FluxSingleTransformerBlock: proj_mlp → act_mlp" in out
    assert "│ only vace_blocks " in row("wan-vace")
    assert "HiDreamBlock: block.ff_i, block.ff_t (optional)" in out
    assert "Stride: whether gradient_checkpointing_segment_stride picks the first N of every S blocks." in out


def test_families_narrow_entries_show_the_same(monkeypatch):
    from rich.console import Console

    from gradseam.tools import cli

    monkeypatch.setattr(cli, "console", lambda: Console(no_color=True, width=80))
    out = _invoke("families", columns="80").output
    chroma = out[out.index("\nchroma: "):out.index("\ncosmos: ")]
    assert "  interval: no (block by block); stride: yes" in chroma
    assert "  FFN seams:\n    ChromaTransformerBlock: ff, ff_context\n    ChromaSingleTransformerBlock: proj_mlp → act_mlp" in chroma
    assert "  attention side:\n    ChromaTransformerBlock: attn\n" in chroma
    assert max(len(line) for line in out.splitlines()) <= 80


# -- arguments and the GPU are checked before torch and diffusers are imported -------------------------

BAD_ARGUMENTS = [
    ["advise", "--family", "nosuch", "--budget", "40GiB"],
    ["advise", "--family", "flux", "--budget", "40xx"],
    ["advise", "--family", "flux", "--budget", "40GiB", "--depths", "4"],
    ["bench", "--family", "nosuch"],
    ["bench", "--family", "flux", "--preset", "nosuch"],
    ["bench", "--family", "flux", "--skip-row", "bogus"],
    ["bench", "--family", "flux", "--steps", "0"],
    ["run", "--", "no_such_script.py"],
    ["run", "--backend", "nosuch", "--", "no_such_script.py"],
    ["run", "-m", "gs_no_such_module_round4"],
]
NO_GPU = [["advise", "--family", "flux", "--budget", "40GiB"], ["bench", "--family", "flux"]]

PROBE_IMPORTS = """
import json, sys
from gradseam.tools.cli import main

seen = []
for args in json.loads(sys.argv[1]):
    sys.argv = ["gradseam", *args]
    try:
        main()
    except SystemExit as exc:
        code = exc.code
    seen.append({"args": args, "code": code, "heavy": sorted(m for m in ("torch", "diffusers") if m in sys.modules)})
print(json.dumps(seen))
"""


def test_bad_arguments_are_refused_before_torch_or_diffusers_is_imported(tmp_path):
    """advise, bench --family and run imported torch and diffusers (25-60 s on a busy machine) before
    saying that an argument was wrong or that there is no GPU. One fresh interpreter runs every case in
    turn and records, after each, whether torch or diffusers has been imported."""
    cases = list(BAD_ARGUMENTS)
    if checks.cuda_missing() is not None:  # a machine without a GPU: the GPU check is one of them
        cases += NO_GPU
    done = subprocess.run([sys.executable, "-c", PROBE_IMPORTS, json.dumps(cases)], capture_output=True, text=True,
                          env=_env(), cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.splitlines()[-1])
    assert [s["args"] for s in seen] == cases
    for case in seen:
        assert case["code"] == 2, case
        assert case["heavy"] == [], f"{case['args']}: imported {case['heavy']} before refusing"
    errors = done.stderr.splitlines()
    assert len(errors) == len(cases) and all(": error: " in line for line in errors), done.stderr[-3000:]
    if checks.cuda_missing() is not None:
        assert "needs a CUDA GPU; none is available (" in errors[-1]


def test_cuda_missing_reads_the_torch_build_without_importing_torch(monkeypatch):
    import torch

    built = checks.torch_build()
    assert built is not None and built["__version__"] == torch.__version__
    assert built["cuda"] == torch.version.cuda and built["hip"] == torch.version.hip
    monkeypatch.delitem(sys.modules, "torch")  # as in a fresh `gradseam advise`: torch not imported yet
    monkeypatch.setattr(checks, "torch_build", lambda: {"__version__": "2.13.0+cpu", "cuda": None, "hip": None})
    assert checks.cuda_missing() == "the installed torch 2.13.0+cpu is a CPU-only build"
    monkeypatch.setattr(checks, "torch_build", lambda: {"__version__": "2.11.0", "cuda": "13.0", "hip": None})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert checks.cuda_missing() == "CUDA_VISIBLE_DEVICES='' hides every GPU"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")

    def no_driver(name):
        raise OSError(name)

    monkeypatch.setattr(checks.ctypes, "CDLL", no_driver)
    monkeypatch.setattr(checks.sys, "platform", "linux")
    assert checks.cuda_missing() == "no CUDA driver is installed (cannot load libcuda.so.1)"
    monkeypatch.setattr(checks, "torch_build", lambda: {"__version__": "2.11.0", "cuda": None, "hip": "6.4"})
    assert checks.cuda_missing() is None  # ROCm: torch.cuda works without libcuda; torch decides


# -- bench on the CPU: why a row is left out, every reason a ratio is marked, single steps -------------


def _rows(step_times):
    from gradseam.tools.bench_report import with_ratios
    from gradseam.tools.results import Result

    names = ["none", "torch", "torch-ffn", "compile", "torch + attention kept", "unsloth"]
    from gradseam.tools.bench_rows import cpu_status

    results = [Result("w", 256, n, 0.05, 200.0 + 10 * i) if cpu_status(n) is None else
               Result("w", 256, n, None, None, cpu_status(n)) for i, n in enumerate(names)]
    return with_ratios(results, [step_times.get(r.strategy) for r in results])


def test_bench_cpu_rows_say_why_they_are_not_measured():
    from gradseam.tools.bench_report import cpu_status_note, to_markdown
    from gradseam.tools.bench_rows import NEEDS_CUDA, NOT_ON_CPU_COMPILED, NOT_ON_CPU_KEPT, cpu_status

    # the compiled backends and kept attention run on the CPU: they are "not measured" there, not "needs CUDA"
    assert cpu_status("compile") == NOT_ON_CPU_COMPILED == cpu_status("ref: compile, memory budget 0.1")
    assert cpu_status("torch + attention kept") == NOT_ON_CPU_KEPT
    assert cpu_status("unsloth") == cpu_status("unsloth-compile") == cpu_status("ref: save_on_cpu") == NEEDS_CUDA
    assert cpu_status("torch") is cpu_status("none") is cpu_status("ref: torch.utils.checkpoint") is None
    rows = _rows({"none": [200.0, 201.0], "torch": [300.0, 301.0], "torch-ffn": [250.0, 251.0]})
    table = to_markdown(rows, cpu=True)
    assert "| compile | not measured on the CPU (compiled) |" in table
    assert "| torch + attention kept | not measured on the CPU (kept kernels) |" in table
    note = cpu_status_note(rows)
    lines = note.splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("'needs CUDA': the row copies activations from GPU memory to pinned host memory")
    assert lines[1].startswith("'not measured on the CPU (kept kernels)': the row runs on the CPU")
    assert lines[2].startswith("'not measured on the CPU (compiled)': the row runs on the CPU")
    assert "pinned" not in lines[1] + lines[2]  # the pinned-memory reason is offload's only


def test_single_step_ratios_are_marked_as_such():
    from gradseam.tools.bench_report import cpu_noise_note, noise, to_markdown
    from gradseam.tools.measure import spread_line

    rows = _rows({"none": [200.0], "torch": [300.0], "torch-ffn": [250.0]})
    assert noise(rows)[:3] == [None, "single step", "single step"]
    table = to_markdown(rows, cpu=True)
    assert "| torch | 51.20 |  | 210.0 (1 step) | 1.05* |" in table
    assert "| w | none | 51.20 |  | 200.0 (1 step) | 1.00 |" in table  # 1 by definition: not marked
    note = cpu_noise_note(rows)
    assert "it was timed in a single step (--steps 1), so there is no spread to tell its time from noise" in note
    assert spread_line(1).startswith("spread: none, each row was timed in a single step (--steps 1)")
    assert spread_line(3) == "spread: (slowest - fastest) / median of the 3 timed steps."


def test_the_noise_line_names_every_reason_a_row_was_marked():
    from gradseam.tools.measure import noise_marks, noise_note

    marks = noise_marks([[250.0, 255.0, 260.0], [140.0, 200.0, 450.0], [258.0, 262.0, 266.0]])
    assert marks == [None, "scattered, overlaps, faster than none", "overlaps"]
    note = noise_note(marks)
    for reason in ("its timed steps lie more than 20% of their median apart",
                   "its timed steps overlap those of no checkpointing",
                   "it ran faster than no checkpointing, which does less work"):
        assert reason in note
    # no checkpointing's own scatter is named as such, not as the marked row's
    marks = noise_marks([[200.0, 255.0, 330.0], [400.0, 401.0, 402.0]])
    assert marks == ["scattered", "reference scattered"]
    assert "no checkpointing's timed steps lie more than 20% of their median apart" in noise_note(marks)


# -- warnings shown by the command line name no internal line ------------------------------------------


def test_cli_warnings_name_no_internal_line(tmp_path):
    """A PluginWarning from loading the plugins was printed as ``.../typer/main.py:1445: PluginWarning: ...``
    followed by typer's source line; now it is one line that names gradseam and no file."""
    done = subprocess.run([sys.executable, "-m", "gradseam", "families"], capture_output=True, text=True,
                          env=_env(GRADSEAM_PLUGINS="gs_no_such_plugin_round4", PYTHONWARNINGS="default"),
                          cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    warning = [line for line in done.stderr.splitlines() if "GRADSEAM_PLUGINS" in line]
    assert len(warning) == 1 and warning[0].startswith("gradseam: warning: GRADSEAM_PLUGINS names "), done.stderr
    assert warning[0].endswith("(PluginWarning)")
    assert ".py:" not in done.stderr and "typer" not in done.stderr and "contextlib" not in done.stderr, done.stderr


def test_cli_warning_format_keeps_the_users_own_lines(tmp_path):
    import contextlib as stdlib_contextlib

    import typer

    from gradseam.tools.cli_support import cli_warnings

    user = str(tmp_path / "train.py")
    before = warnings.formatwarning
    with cli_warnings():
        internal = [warnings.formatwarning("a", UserWarning, f, 3) for f in
                    (typer.main.__file__, stdlib_contextlib.__file__, checks.__file__, "<frozen runpy>")]
        mine = warnings.formatwarning("b", UserWarning, user, 3, "x = 1")
    assert internal == ["gradseam: warning: a (UserWarning)\n"] * 4
    assert mine.startswith(f"{user}:3: UserWarning: b")  # a line of the user's program keeps Python's format
    assert warnings.formatwarning is before  # put back after the command


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
