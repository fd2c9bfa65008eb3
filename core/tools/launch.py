"""``gradseam run``: run an unmodified training script with load-time patching on for the whole run.

``gradseam run [options] [--] train.py args...`` (or ``-m package.module args...``) opens
:func:`gradseam.patching` and runs the program *in this interpreter*, so every model the program
loads with a diffusers loader comes out patched. Why it works the way it does:

- **In-process, through runpy.** Load-time patching wraps diffusers' loader classmethods in the
  interpreter that loads the model; a child process would start without them. ``runpy`` runs the
  program the way ``python train.py`` / ``python -m pkg.mod`` would: ``__name__ == "__main__"``,
  ``sys.modules["__main__"]`` is the program's module while it runs (so pickling classes defined
  in it and ``multiprocessing`` workers that re-import it work), ``sys.argv[1:]`` are exactly the
  program's arguments, and ``sys.path[0]`` is the script's directory (the working directory for
  ``-m``), as Python sets it. One difference: ``__file__`` and ``sys.argv[0]`` are the script's
  absolute path (Python keeps ``sys.argv[0]`` as typed).
- **Under launchers, as the program.** ``accelerate launch`` and ``torchrun`` start one process
  per rank and run the program they are given in each; making ``gradseam`` that program (``-m
  gradseam run ...`` or ``--no_python``/``--no-python gradseam run ...``) puts the patching in
  every rank. Lines printed here carry the rank when ``WORLD_SIZE`` > 1.
- **The program's exit status is ours.** ``sys.exit(n)`` passes ``n`` through; an uncaught
  exception is printed through ``sys.excepthook`` (a hook the program installed still applies)
  without this module's frames, and exits 1, as Python does; Ctrl-C exits 130.
- **diffusers and torch are imported before the program starts**, since the loaders must be
  wrapped before the program can call them. An environment variable a script sets at its top for
  a library that reads it at import (``HF_HUB_OFFLINE``, say) therefore comes too late: set it in
  the environment of ``gradseam run``.
- **Only loads on the program's main thread are patched** (``patching`` keeps its state per
  thread), and only models built by a loader: a model built with its constructor is the
  program's own to patch. The summary at exit says when nothing was patched.

``report`` writes a JSON file at exit (one per rank under a launcher): the config, the exit
status, and each patched model as :mod:`gradseam.launch_report` describes it.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from ..config import CheckpointConfig
from .launch_report import Patched

if TYPE_CHECKING:
    from ..patcher import PatchHandle

# command-line flag -> config key; every flag is its key without the "gradient_checkpointing_" prefix
FLAG_KEYS: dict[str, str] = {
    "--checkpointing": "gradient_checkpointing",
    "--backend": "gradient_checkpointing_backend",
    "--interval": "gradient_checkpointing_interval",
    "--segment-stride": "gradient_checkpointing_segment_stride",
    "--offload-attention": "gradient_checkpointing_offload_attention",
    "--offload-pin-memory-max-buckets": "gradient_checkpointing_offload_pin_memory_max_buckets",
    "--keep-attention": "gradient_checkpointing_keep_attention",
}
_NULLABLE = {"gradient_checkpointing_interval", "gradient_checkpointing_segment_stride"}


class LaunchError(ValueError):
    """A mistake on the ``gradseam run`` command line, found before the program starts."""


# -- the config -----------------------------------------------------------------------------------


def build_config(
    config_file: str | os.PathLike[str] | None = None,
    *,
    ignore_unknown: bool = False,
    flags: Mapping[str, Any] | None = None,
) -> CheckpointConfig:
    """The run's config: checkpointing on, then the file's keys, then the flags (later wins).

    ``gradient_checkpointing`` starts true because turning it on is what running under gradseam is
    for; a file or ``--no-checkpointing`` that says false still wins. Flag values go to
    :class:`CheckpointConfig` as typed (it parses "2" and "true"), one flag at a time, so a bad value
    is reported with the flag that carried it; "null"/"none" clear the interval or the stride.
    """
    keys: dict[str, Any] = {"gradient_checkpointing": True}
    if ignore_unknown and config_file is None:
        raise LaunchError("--ignore-unknown reads the gradseam keys out of a trainer config; it needs --config FILE.")
    if config_file is not None:
        where = os.fspath(config_file)
        try:
            CheckpointConfig.from_json(where, ignore_unknown=ignore_unknown)  # every mistake in the file
            data = json.loads(Path(where).read_text(encoding="utf-8"))
        except OSError as exc:
            raise LaunchError(f"--config: cannot read {where!r}: {exc.strerror or exc}.") from None
        except ValueError as exc:
            hint = " (add --ignore-unknown to read a whole trainer config)" if "unknown gradseam" in str(exc) else ""
            raise LaunchError(f"--config: {exc}{hint}") from None
        known = set(CheckpointConfig.keys())  # noqa: SIM118 - a classmethod, not a dict
        keys.update({k: v for k, v in data.items() if k in known})
    for flag, value in (flags or {}).items():
        key = FLAG_KEYS[flag]
        if key in _NULLABLE and isinstance(value, str) and value.strip().lower() in ("null", "none"):
            value = None
        try:
            CheckpointConfig.from_dict({key: value})
        except ValueError as exc:
            raise LaunchError(f"{flag} {value}: {exc}") from None
        keys[key] = value
    try:
        return CheckpointConfig.from_dict(keys)
    except ValueError as exc:  # only combinations are left (a stride shorter than the interval)
        raise LaunchError(str(exc)) from None


# -- the program ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Program:
    """What to run: a script path or a module name, and its arguments."""

    target: str  # the script's absolute path (what Python puts in ``__file__``) or the module name
    args: tuple[str, ...]
    module: bool = False
    typed: str = ""  # the script as the user wrote it, for messages

    @property
    def display(self) -> str:
        return f"-m {self.target}" if self.module else (self.typed or self.target)


def parse_program(argv: list[str], known_flags: list[str] | None = None) -> Program:
    """``[--] script.py args...`` or ``-m module args...``, checked before anything runs."""
    usage = "name the program to run: gradseam run [OPTIONS] [--] script.py [ARGS]... or -m module [ARGS]..."
    if not argv:
        raise LaunchError(usage)
    head, rest = argv[0], argv[1:]
    if head == "-m" or (head.startswith("-m") and not head.startswith("--")):
        name = head[2:] or (rest.pop(0) if rest else "")
        if not name:
            raise LaunchError(f"-m needs a module name; {usage}")
        return Program(name, tuple(rest), module=True)
    if head.startswith("-") and head != "-":
        import difflib

        close = difflib.get_close_matches(head.split("=")[0], known_flags or [], n=1, cutoff=0.6)
        hint = f" Did you mean {close[0]}?" if close else ""
        raise LaunchError(f"no such option: {head}.{hint} (gradseam's options go before the program.)")
    path = Path(head)
    if not path.exists():
        raise LaunchError(f"can't open file {head!r}: no such file (the program to run).")
    if path.is_dir() and not (path / "__main__.py").is_file():
        raise LaunchError(f"{head!r} is a directory without a __main__.py; name a script or use -m module.")
    return Program(os.path.abspath(head), tuple(rest), typed=head)


def rank_info(environ: Mapping[str, str] | None = None) -> tuple[int, int]:
    """(rank, world size) as torchrun and accelerate set them; (0, 1) for a plain run."""
    env = os.environ if environ is None else environ
    try:
        return int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1"))
    except ValueError:
        return 0, 1


def report_path(template: str | os.PathLike[str], rank: int, world: int) -> Path:
    """The report file of this rank: ``{rank}`` in the name is replaced; otherwise, under a launcher
    with more than one rank, ``.rankN`` goes before the suffix so ranks do not overwrite each other."""
    text = os.fspath(template)
    if "{rank}" in text:
        return Path(text.replace("{rank}", str(rank)))
    path = Path(text)
    if world > 1:
        return path.with_name(f"{path.stem}.rank{rank}{path.suffix}")
    return path


@dataclass
class Launch:
    """One ``gradseam run``: the config, the program, and what happened to it."""

    config: CheckpointConfig
    program: Program
    report: Path | None = None
    rank: int = 0
    world: int = 1
    patched: list[Patched] = field(default_factory=list)
    stream: TextIO | None = None

    @property
    def prefix(self) -> str:
        return f"[gradseam rank {self.rank}/{self.world}]" if self.world > 1 else "[gradseam]"

    def say(self, text: str) -> None:
        stream = self.stream or sys.stderr
        for line in text.splitlines() or [""]:
            print(f"{self.prefix} {line}", file=stream, flush=True)

    def on_patch(self, handle: PatchHandle, component: str | None) -> None:
        item = Patched(handle, component)
        self.patched.append(item)
        self.say(item.line())

    def run(self) -> int:
        """Run the program with patching on; returns its exit status (never raises for the program's errors)."""
        import gradseam

        def start() -> None:
            self.say(f"running {self.program.display} with {self.config.describe()}; models a family handles "
                     "are patched as they load")

        with gradseam.patching(self.config, on_patch=self.on_patch):
            code = _execute(self.program, start)  # a module is looked up in here: that imports its packages
        if self.report is not None:  # the handles count every region's calls as they run
            for item in self.patched:
                item.runs = [r for r in item.handle.regions() if r.kind != "attention-offload"]
        self.finish(code)
        return code

    def finish(self, code: int) -> None:
        if not self.patched:
            import gradseam

            names = ", ".join(f.name for f in gradseam.families()) or "none"
            self.say(
                f"exit code {code}; no model was patched: the program loaded no model an installed family "
                f"handles (installed: {names}) with from_pretrained / from_single_file on its main thread."
            )
        else:
            parts = []
            for item in self.patched:
                text = f"{item.name}: {item.handle.family.name}, {item.handle.config.describe()}"
                if item.runs is not None:
                    ran, planned, total = item.ran()
                    text += f", {ran}/{planned} regions ran ({total} region runs)"
                parts.append(text)
            self.say(f"exit code {code}; patched {len(self.patched)} model(s): " + "; ".join(parts))
            if self.rank == 0:
                for item in self.patched:
                    self.say(str(item.handle.summary()))
        if self.report is not None:
            self.write_report(code)

    def write_report(self, code: int) -> None:
        assert self.report is not None
        doc = {
            "program": [self.program.display, *self.program.args],
            "exit_code": code,
            "rank": self.rank,
            "world_size": self.world,
            "config": self.config.to_dict(),
            "models": [item.to_dict() for item in self.patched],
        }
        try:
            self.report.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
        except OSError as exc:  # checked before the run; say so rather than lose the exit status
            self.say(f"could not write the report {str(self.report)!r}: {exc}")
            return
        self.say(f"wrote {self.report}")


# -- running ----------------------------------------------------------------------------------------


def _exit_status(code: object) -> int:
    """Python's rule for ``SystemExit(code)``: None is 0, an int is itself, anything else is printed and 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr, flush=True)
    return 1


def _program_traceback(tb: Any) -> Any:
    """The traceback without the launcher's and runpy's frames, so it starts in the program."""
    ours = {os.path.abspath(__file__), os.path.abspath(runpy.__file__)}
    while tb is not None and (
        os.path.abspath(tb.tb_frame.f_code.co_filename) in ours or tb.tb_frame.f_code.co_filename.startswith("<frozen")
    ):
        tb = tb.tb_next
    return tb


def _print_uncaught(exc: BaseException) -> None:
    # the default hook prints the exception's own __traceback__, not the one passed to it
    tb = _program_traceback(exc.__traceback__)
    sys.excepthook(type(exc), exc.with_traceback(tb), tb)


def _execute(program: Program, start: Callable[[], None] = lambda: None) -> int:
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    try:
        if program.module:
            sys.path[0:1] = [os.getcwd()]  # as `python -m` sets it, before the module is looked up
            _check_module(program.target)  # a LaunchError here is the command line's mistake, not the program's
        else:
            sys.path[0:1] = [os.path.dirname(os.path.realpath(program.target))]
        sys.argv = [program.target, *program.args]  # run_module replaces argv[0] by the module's file
        start()
        try:
            if program.module:
                runpy.run_module(program.target, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(program.target, run_name="__main__")
            return 0
        except SystemExit as exc:
            return _exit_status(exc.code)
        except KeyboardInterrupt as exc:
            _print_uncaught(exc)
            return 130
        except BaseException as exc:  # whatever the program raised is printed as Python would print it
            _print_uncaught(exc)
            return 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path


def _check_module(name: str) -> None:
    import importlib.util

    try:
        found = importlib.util.find_spec(name)
    except (ImportError, ValueError) as exc:
        raise LaunchError(f"-m {name}: {exc}") from None
    if found is None:
        raise LaunchError(f"-m {name}: no module named {name!r}.")
