"""``gradseam run``: run an unmodified training script with load-time patching on for the whole run.

``gradseam run [options] [--] train.py args...`` (or ``-m package.module args...``) opens
:func:`gradseam.patching` and runs the program *in this interpreter*, so every model the program
loads with a diffusers loader comes out patched. Why it works the way it does:

- **In-process, as Python runs it.** Load-time patching wraps diffusers' loader classmethods in the
  interpreter that loads the model; a child process would start without them. The program runs the
  way ``python train.py`` / ``python -m pkg.mod`` would run it: ``__name__ == "__main__"``, and its
  module is ``sys.modules["__main__"]`` from its first line to the end of the process, after its top
  level returned too (so pickling classes defined in it works in a checkpoint thread still saving
  and in ``atexit`` handlers, and ``multiprocessing`` workers that re-import it find it);
  ``sys.argv[1:]`` are exactly the program's arguments, and ``sys.path[0]`` is the script's
  directory (the working directory for ``-m``), as Python sets them, and they stay so after the top
  level returns too. runpy's ``run_path`` /
  ``run_module`` are not used: they put the previous ``__main__`` back when the top level returns.
  One difference: ``__file__`` and ``sys.argv[0]`` are the script's absolute path (Python keeps
  ``sys.argv[0]`` as typed).
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

- **What the program does to the process does not move our output.** The report path is made
  absolute when the launch is set up, so a program that changes directory (hydra-style run
  directories) still gets its report where the command line said; and the lines printed here go
  to the stderr ``gradseam run`` started with (:class:`KeptStream`), so a program that replaces or
  closes ``sys.stdout``/``sys.stderr`` neither loses the summary nor turns its own exit status 0
  into a crash of the launcher's.

``report`` writes a JSON file at exit (one per rank under a launcher): the config, the exit
status, and each patched model as :mod:`gradseam.tools.launch_report` describes it.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib.machinery
import importlib.util
import io
import json
import os
import pkgutil
import re
import sys
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import CodeType, ModuleType
from typing import TYPE_CHECKING, Any, TextIO

from ..config import AUTO, AUTO_BUDGETS, BACKEND_KEY, KEY_SPECS, CheckpointConfig
from .launch_report import Patched

if TYPE_CHECKING:
    from ..handle import PatchHandle

# command-line flag -> config key, from the keys' specs (gradseam.config.KeySpec); every flag is its key
# without the "gradient_checkpointing_" prefix
FLAG_KEYS: dict[str, str] = {spec.flag: key for key, spec in KEY_SPECS.items()}
# every spelling of a key's option, "--no-..." of a bool key's included -> the key
_SPELLINGS: dict[str, str] = {flag: key for key, spec in KEY_SPECS.items() for flag in spec.flags}
# keys a flag may clear with "null"/"none" (back to their default)
_NULLABLE = frozenset(key for key, spec in KEY_SPECS.items() if spec.nullable)


class LaunchError(ValueError):
    """A mistake on the ``gradseam run`` command line, found before the program starts."""


# -- the config -----------------------------------------------------------------------------------


def build_config(
    config_file: str | os.PathLike[str] | None = None,
    *,
    ignore_unknown: bool = False,
    flags: Mapping[str, Any] | None = None,
) -> CheckpointConfig:
    """The run's config: the file's keys, then the flags (later wins), read by the API's rule.

    ``gradient_checkpointing`` left out is on where a key that needs it is set, as in ``patch()``; with
    no option at all it is on, because checkpointing is what running under gradseam is for. A file or
    ``--no-checkpointing`` that says false wins. Flag values go to
    :class:`CheckpointConfig` as typed (it parses "2", "0.3" and "true"), one flag at a time, so a bad
    value is reported with the flag that carried it; "null"/"none" clear the interval, the stride or
    the memory budget (``--memory-budget``, a float 0 <= B <= 1; null is the compiled backends' default).
    Settings the backend cannot run on any model (a memory budget without a compiled backend, an
    interval or attention option with one) are refused here too, before the program starts.

    Messages speak the command line's words: a value that came from a flag is named by its flag,
    a key in the file by its config key (that is what the file holds), and the remedy for a
    trainer config is ``--ignore-unknown``, not the Python API's ``ignore_unknown=True``.
    """
    config, flag_of = _read_config(config_file, ignore_unknown, flags)
    _refuse_for_every_model(config, flag_of)
    return config


def prepare(
    config_file: str | os.PathLike[str] | None,
    *,
    ignore_unknown: bool = False,
    flags: Mapping[str, Any] | None = None,
    argv: list[str],
    known_flags: list[str] | None = None,
) -> tuple[CheckpointConfig, Program]:
    """The command line read and checked, cheapest checks first: the config's values, the program
    (a missing script, an unknown option), then what needs torch (:func:`_refuse_for_every_model`
    imports the planner). A mistake is a :class:`LaunchError` before torch or diffusers is imported,
    except a combination that no model can run, found once torch is in."""
    config, flag_of = _read_config(config_file, ignore_unknown, flags)
    program = parse_program(argv, known_flags)
    _refuse_for_every_model(config, flag_of)
    return config, program


def _read_config(
    config_file: str | os.PathLike[str] | None, ignore_unknown: bool, flags: Mapping[str, Any] | None,
) -> tuple[CheckpointConfig, dict[str, str]]:
    keys: dict[str, Any] = {}
    if ignore_unknown and config_file is None:
        raise LaunchError("--ignore-unknown reads the gradseam keys out of a trainer config; it needs --config FILE.")
    if config_file is not None:
        keys.update(_file_keys(os.fspath(config_file), ignore_unknown))
    flag_of: dict[str, str] = {}
    for flag, value in (flags or {}).items():
        key = FLAG_KEYS[flag]
        if key in _NULLABLE and isinstance(value, str) and value.strip().lower() in ("null", "none"):
            value = None
        try:  # the value alone (a budget of "auto" beside it, the only backend it is read with)
            CheckpointConfig.from_dict({BACKEND_KEY: AUTO, key: value} if key in AUTO_BUDGETS else {key: value})
        except ValueError as exc:
            raise LaunchError(f"{flag} {value}: {str(exc).removeprefix(f'gradseam config key {key!r}: ')}") from None
        keys[key] = value
        flag_of[key] = flag
    if not keys:  # no option at all: what a launcher is for, the default backend (the API's rule otherwise)
        keys["gradient_checkpointing"] = True
    try:
        config = CheckpointConfig.from_dict(keys)
    except ValueError as exc:  # only combinations are left (a stride shorter than the interval)
        raise LaunchError(_in_flags(str(exc), flag_of)) from None
    return config, flag_of


def _refuse_for_every_model(config: CheckpointConfig, flag_of: Mapping[str, str]) -> None:
    """Refuse, before the program starts, what the backend does not do whatever the model.

    The planner refuses these when a model is patched; under ``gradseam run`` that would be inside the
    program's first ``from_pretrained``, after it started. They depend on the config alone
    (:func:`gradseam.kinds.check_config`), so here they are one line and exit 2, in the command
    line's words (a flag by its flag, a key of the file by its key).
    """
    from ..errors import UnsupportedStrategyError
    from ..kinds import check_config

    try:
        check_config(config)
    except UnsupportedStrategyError as exc:
        raise LaunchError(_in_flags(str(exc), flag_of)) from None


def _file_keys(where: str, ignore_unknown: bool) -> dict[str, Any]:
    """The gradseam keys of a ``--config`` file, every mistake in it reported in the CLI's words."""
    try:
        # every mistake in the file but an unknown key, which is worded here for the command line
        CheckpointConfig.from_json(where, ignore_unknown=True)
        data = json.loads(Path(where).read_text(encoding="utf-8"))
    except OSError as exc:
        raise LaunchError(f"--config: cannot read {where!r}: {exc.strerror or exc}.") from None
    except ValueError as exc:
        raise LaunchError(f"--config: {exc}") from None
    known = CheckpointConfig.keys()
    unknown = [k for k in data if k not in known]
    if unknown and not ignore_unknown:
        raise LaunchError(_unknown_key(where, unknown[0], known))
    return {k: v for k, v in data.items() if k in known}


def _unknown_key(where: str, key: str, known: tuple[str, ...]) -> str:
    # a flag's name written as a key ("backend", "--segment-stride") is the likeliest slip here
    flag = "--" + key.lstrip("-").replace("_", "-")
    if flag in _SPELLINGS:
        wanted = _SPELLINGS[flag]
        hint = (f" Did you mean {wanted!r}? A config file holds the config keys; {key!r} is the name of "
                f"the {flag} option.")
    else:
        close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
        hint = f" Did you mean {close[0]!r}?" if close else ""
    return (f"--config: {where!r} holds the unknown gradseam config key {key!r}.{hint} Valid keys: "
            f"{sorted(known)}. Add --ignore-unknown to read the gradseam keys out of a whole trainer config.")


_KEY_NAME = re.compile(r"(?:gradseam config key )?'?\b(gradient_checkpointing(?:_[a-z]+)*)\b'?")


def _in_flags(message: str, flag_of: Mapping[str, str]) -> str:
    """``message`` with every config key that a flag set named by its flag (the others stay keys:
    they came from the file)."""
    return _KEY_NAME.sub(lambda m: flag_of.get(m.group(1), m.group(0)), message)


def flag_for_key(text: str) -> str | None:
    """The flag of a config key written as an option (``--gradient_checkpointing_backend``), else None."""
    key = text.lstrip("-").replace("-", "_")
    return next((flag for flag, k in FLAG_KEYS.items() if k == key), None)


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
        _check_top_level(name)
        return Program(name, tuple(rest), module=True)
    if head.startswith("-") and head != "-":
        name = head.split("=")[0]
        flag = flag_for_key(name)
        if flag is not None:
            hint = f" The option for config key {FLAG_KEYS[flag]!r} is {flag}."
        else:
            close = difflib.get_close_matches(name, known_flags or [], n=1, cutoff=0.6)
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


def _usable(stream: Any) -> bool:
    return stream is not None and not getattr(stream, "closed", False)


def _write(stream: Any, text: str) -> bool:
    """Write and flush; False (never an exception) where the stream is gone or fails."""
    if not _usable(stream):
        return False
    try:
        stream.write(text)
        stream.flush()
    except (OSError, ValueError):
        return False
    return True


class KeptStream:
    """The stream ``gradseam run`` started with, kept usable whatever the program does to it.

    A training script may replace ``sys.stderr`` (a logger's tee) or close it; the launcher's lines
    after the program (the summary, the exit code, where the report went) must still reach the
    terminal, and writing them must never raise, since the launcher's exit status is the program's.
    So the object is kept (the program's later ``sys.stderr = ...`` does not touch it), and its file
    descriptor is duplicated at start: when the object has been closed, or writing to it fails
    (its descriptor closed under it), the line goes to the duplicate. A stream with no descriptor
    (an in-process test runner's capture) has no duplicate, and a line it cannot take is dropped.
    """

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self._fd: int | None = None
        self._backup: TextIO | None = None
        try:
            self._fd = os.dup(stream.fileno())
        except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both of the last two
            self._fd = None

    def write(self, text: str) -> None:
        """Write ``text`` and flush; never raises."""
        if not _write(self.stream, text):
            _write(self._open_backup(), text)

    def _open_backup(self) -> TextIO | None:
        if self._backup is None and self._fd is not None:
            encoding = getattr(self.stream, "encoding", None) or "utf-8"
            try:
                self._backup = open(self._fd, "w", encoding=encoding, errors="backslashreplace",  # noqa: SIM115 - kept open until close()
                                    closefd=True)
            except (OSError, ValueError, LookupError):
                return None
            self._fd = None  # owned by the backup stream now
        return self._backup

    def close(self) -> None:
        """Release the duplicate descriptor (the kept object is not ours to close)."""
        if self._backup is not None:
            with contextlib.suppress(OSError, ValueError):
                self._backup.close()
            self._backup = None
        elif self._fd is not None:
            with contextlib.suppress(OSError, ValueError):
                os.close(self._fd)
        self._fd = None


@dataclass
class Launch:
    """One ``gradseam run``: the config, the program, and what happened to it."""

    config: CheckpointConfig
    program: Program
    report: Path | None = None
    rank: int = 0
    world: int = 1
    patched: list[Patched] = field(default_factory=list)
    stream: KeptStream | None = None  # set by run(): stderr as it was before the program started

    def __post_init__(self) -> None:
        # resolved now, against the directory the command was typed in: the program may chdir
        if self.report is not None:
            self.report = Path(os.path.abspath(self.report))

    @property
    def prefix(self) -> str:
        return f"[gradseam rank {self.rank}/{self.world}]" if self.world > 1 else "[gradseam]"

    def say(self, text: str) -> None:
        text = "".join(f"{self.prefix} {line}\n" for line in text.splitlines() or [""])
        if self.stream is not None:
            self.stream.write(text)
        else:  # outside run(): nothing to keep yet
            _write(sys.stderr, text)

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

        self.stream = KeptStream(sys.stderr)
        try:
            with gradseam.patching(self.config, on_patch=self.on_patch):
                # a module is looked up in here: that imports its packages
                code = _execute(self.program, start, self.stream)
            if self.report is not None:  # the handles count every region's calls as they run
                for item in self.patched:
                    item.runs = [r for r in item.handle.regions() if r.shape != "attention"]
            try:
                self.finish(code)
            except Exception as exc:  # the program's exit status outranks our summary of it
                self.say(f"exit code {code}; the summary failed: {type(exc).__name__}: {exc}")
        finally:
            self.stream.close()
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


def _exit_status(code: object, err: KeptStream | None = None) -> int:
    """Python's rule for ``SystemExit(code)``: None is 0, an int is itself, anything else is printed and 1.

    Printed to the program's ``sys.stderr`` as Python does; where the program closed it, to the
    stderr the launch started with (``err``), rather than failing on the way out.
    """
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    if not _write(sys.stderr, f"{code}\n") and err is not None:
        err.write(f"{code}\n")
    return 1


def _program_traceback(tb: Any) -> Any:
    """The traceback without the launcher's frames, so it starts in the program."""
    ours = {os.path.abspath(__file__)}
    while tb is not None and (
        os.path.abspath(tb.tb_frame.f_code.co_filename) in ours or tb.tb_frame.f_code.co_filename.startswith("<frozen")
    ):
        tb = tb.tb_next
    return tb


def _print_uncaught(exc: BaseException, err: KeptStream | None = None) -> None:
    """The traceback as Python would print it: through ``sys.excepthook``, so a hook the program
    installed applies. Where the program closed ``sys.stderr`` (where the default hook writes, and
    fails quietly), the traceback also goes to the stderr the launch started with (``err``): a run
    that failed must not end without saying why."""
    # the default hook prints the exception's own __traceback__, not the one passed to it
    tb = _program_traceback(exc.__traceback__)
    exc = exc.with_traceback(tb)
    shown = False
    try:
        sys.excepthook(type(exc), exc, tb)
        shown = _usable(sys.stderr)
    except Exception:  # a hook that fails: fall back below
        shown = False
    if not shown and err is not None:
        err.write("".join(traceback.format_exception(type(exc), exc, tb)))


# The ``__main__`` modules the programs replaced, kept alive: their code may still be running (the
# ``gradseam`` console script's, ``python -m gradseam``'s), and a module object that goes away may
# take its globals with it.
_REPLACED_MAINS: list[ModuleType] = []


def _main_module(program: Program) -> tuple[ModuleType, CodeType]:
    """The program's ``__main__`` module, filled as Python fills it, and its code (not yet run).

    Python runs a program in the process's one ``__main__`` module for the rest of the process; runpy's
    ``run_path`` / ``run_module`` use a temporary module instead and put the old ``__main__`` back when
    the top level returns, so a thread still saving a checkpoint after the loop, or an ``atexit``
    handler, could no longer pickle a class the program defined. The module is made here and never
    taken out of ``sys.modules`` (see :func:`_execute`).
    """
    module = ModuleType("__main__")
    if program.module:
        spec = _module_spec(program.target)
        where: Any = spec
    elif pkgutil.get_importer(program.target) is None:  # a file (source or compiled), as python runs it
        spec, where = None, program.target
    else:  # a directory or zip file with a __main__.py: sys.path[0] is the place itself
        sys.path[0] = program.target
        spec = importlib.machinery.PathFinder.find_spec("__main__", [program.target])
        if spec is None or spec.loader is None:
            raise LaunchError(f"can't find '__main__' module in {program.display!r}.")
        where = spec
    if spec is None:
        module.__dict__.update(__file__=program.target, __cached__=None, __loader__=None, __package__=None,
                               __spec__=None)
        return module, _code_of_file(program.target)
    code = spec.loader.get_code(spec.name) if spec.loader is not None else None
    if code is None:
        raise LaunchError(f"{program.display}: no code object available for {where.name!r}.")
    module.__dict__.update(__file__=spec.origin, __cached__=spec.cached, __loader__=spec.loader,
                           __package__=spec.parent, __spec__=spec)
    return module, code


def _code_of_file(path: str) -> CodeType:
    """A script's code: compiled bytecode as it is, else the source compiled (what runpy does)."""
    with io.open_code(path) as f:
        code = pkgutil.read_code(f)
    if code is None:
        with io.open_code(path) as f:
            code = compile(f.read(), path, "exec")
    return code


def _execute(program: Program, start: Callable[[], None] = lambda: None, err: KeptStream | None = None) -> int:
    """Run the program as ``python script.py`` / ``python -m module`` would; its exit status.

    What the program sees of the process stays as it set it up for the rest of the process, as under
    ``python``: its module is ``sys.modules["__main__"]``, ``sys.argv`` its command line and
    ``sys.path`` what it made of it, for the threads it leaves running and its ``atexit`` handlers
    (a checkpoint writer still saving after the loop). They are put back only when the program
    never started (a mistake in the command line).
    """
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    started = False
    try:
        if program.module:
            sys.path[0:1] = [os.getcwd()]  # as `python -m` sets it, before the module is looked up
        else:
            sys.path[0:1] = [os.path.dirname(os.path.realpath(program.target))]
        # a LaunchError here is the command line's mistake, not the program's
        module, code = _main_module(program)
        sys.argv = [module.__file__ if program.module else program.target, *program.args]
        start()
        _REPLACED_MAINS.append(sys.modules["__main__"])
        sys.modules["__main__"] = module
        started = True
        try:
            exec(code, module.__dict__)
            return 0
        except SystemExit as exc:
            return _exit_status(exc.code, err)
        except KeyboardInterrupt as exc:
            _print_uncaught(exc, err)
            return 130
        except BaseException as exc:  # whatever the program raised is printed as Python would print it
            _print_uncaught(exc, err)
            return 1
    finally:
        if not started:
            sys.argv, sys.path[:] = saved_argv, saved_path


def _module_spec(name: str) -> importlib.machinery.ModuleSpec:
    """The spec ``python -m name`` runs: the module's, or its ``__main__``'s for a package."""
    spec = _check_module(name)
    if spec.submodule_search_locations is not None:  # a package: python -m runs its __main__
        main = f"{name}.__main__"
        spec = _check_module(main, package=name)
        if spec.submodule_search_locations is not None:
            raise LaunchError(f"-m {name}: {main!r} is a package and cannot be directly executed.")
    return spec


def _check_top_level(name: str) -> None:
    """``-m a.b.c``'s top-level package ``a`` exists, looked up as ``python -m`` would (from the working
    directory), before torch and diffusers are imported for the run. Finding a top-level module runs
    none of the program's code; its submodules are looked up when the program starts."""
    top = name.split(".")[0]
    saved = sys.path[:]
    sys.path[0:1] = [os.getcwd()]
    try:
        found = importlib.util.find_spec(top)
    except (ImportError, ValueError) as exc:
        raise LaunchError(f"-m {name}: {exc}") from None
    finally:
        sys.path[:] = saved
    if found is None:
        raise LaunchError(f"-m {name}: no module named {top!r}.")


def _check_module(name: str, package: str | None = None) -> importlib.machinery.ModuleSpec:
    try:
        found = importlib.util.find_spec(name)
    except (ImportError, ValueError) as exc:
        raise LaunchError(f"-m {package or name}: {exc}") from None
    if found is None:
        if package is not None:
            raise LaunchError(f"-m {package}: no module named {name!r}; {package!r} is a package and cannot be "
                              "directly executed.")
        raise LaunchError(f"-m {name}: no module named {name!r}.")
    return found
