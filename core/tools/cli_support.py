"""What every ``gradseam`` command shares: how mistakes are reported, how flags and tables are shown.

- **A mistake is one line and exit code 2.** Every option is checked before work starts; a bad
  value raises a click usage error, which :class:`Group` prints as ``gradseam CMD: error: ...`` on
  stderr, with no traceback and no box (typer's framed errors wrap at 80 columns in a CI log and
  cut the message). Errors found by gradseam itself go through :func:`fail` and look the same.
- **Flags look like flags.** typer's help shows a ``<bool>`` type next to ``--synthetic``, which
  reads as if it took a value (``--synthetic false`` is then rejected); :class:`Command` and
  :class:`Group` give every flag an empty metavar.
- **A warning names no internal line.** Python prints a warning with the file and line it is
  attributed to; gradseam attributes its warnings to the first frame outside itself, which under the
  command line is typer's, click's or ``contextlib``'s (``typer/main.py:1445: PluginWarning: ...``).
  While a command runs, a warning attributed to such a frame is printed as ``gradseam: warning:
  MESSAGE (Category)`` (:func:`cli_warnings`); a warning attributed to the user's own file (a line of
  the program ``gradseam run`` runs) keeps Python's format.
- **Options come in sections.** An option with a ``rich_help_panel`` (``gradseam run``'s config
  keys: their group) is listed under that heading; typer shows panels only with rich markup, which
  the ``gradseam`` command does not use. :func:`with_key_options` builds those options from the
  config keys' specs, so a key added to :class:`gradseam.CheckpointConfig` is an option of
  ``gradseam run`` with nothing written here.
- **Option checks are values.** The checks in :mod:`gradseam.tools.checks` raise
  :class:`~gradseam.tools.checks.OptionError`; within :func:`refused` it stops the command like
  click's own checks.
- **Tables keep their names when piped.** A console that is not a terminal gets an unlimited width,
  so rich never cuts a cell to 80 columns in a file or CI log; in a terminal, name columns fold
  instead of ending in an ellipsis.

The click classes are found through typer (``typer.BadParameter``'s module), since typer vendors
its own click from 0.20 on and used the ``click`` package before.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import os
import sys
import sysconfig
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console
from typer.core import TyperCommand, TyperGroup

from ..config import KEY_SPECS, KeySpec
from .checks import OptionError

# the click typer uses: the click package, or typer's vendored copy (typer._click)
_exceptions = sys.modules[typer.BadParameter.__module__]
_globals = importlib.import_module(_exceptions.__name__.rsplit(".", 1)[0] + ".globals")
UsageError: type[Exception] = _exceptions.UsageError
ClickException: type[Exception] = _exceptions.ClickException
Abort: type[Exception] = typer.Abort
NoArgsIsHelpError: type[Exception] | None = getattr(_exceptions, "NoArgsIsHelpError", None)  # click >= 8.2

PIPED_WIDTH = 100_000  # wide enough that no table is cut; rich does not pad lines to the width


def console() -> Console:
    """A console for stdout as it is now: a terminal's width, or no width limit when piped."""
    tty = sys.stdout.isatty()
    return Console(width=None if tty else PIPED_WIDTH, soft_wrap=not tty)


def _flags_as_flags(params: list[Any]) -> list[Any]:
    for param in params:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""
    return params


def _parse_in(ctx: Any, parse: Any, args: list[str]) -> list[str]:
    # click's parser raises some errors (a missing option value) without the context, which the
    # error line needs to name the command
    try:
        return parse(ctx, args)
    except UsageError as exc:
        if getattr(exc, "ctx", None) is None:
            exc.ctx = ctx  # type: ignore[attr-defined]
        raise


class Command(TyperCommand):
    def get_params(self, ctx: Any) -> list[Any]:
        return _flags_as_flags(super().get_params(ctx))

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        return _parse_in(ctx, super().parse_args, args)

    def format_options(self, ctx: Any, formatter: Any) -> None:
        """The arguments, then the options, each under its section (``rich_help_panel``) where it has one,
        the rest under "Options", in the order they first appear."""
        sections: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            if param.param_type_name == "argument":
                name = "Arguments"
            else:
                name = getattr(param, "rich_help_panel", None) or "Options"
            sections.setdefault(name, []).append(record)
        for name, records in sections.items():
            with formatter.section(name):
                formatter.write_dl(records)


def option_names() -> list[str]:
    """Every long option of the command now running (``--no-x`` forms and ``--help`` included)."""
    ctx = _globals.get_current_context()
    return [name for param in ctx.command.get_params(ctx) for name in (*param.opts, *param.secondary_opts)
            if name.startswith("--")]


# -- gradseam run's options: one per config key, from the keys' specs ---------------------------------


def _key_parameter(key: str, spec: KeySpec) -> inspect.Parameter:
    """The typer option of one config key: ``--x/--no-x`` for a bool key, else one taking a value as typed
    (a string: the config parses it, so that a bad value is reported as the config words it)."""
    option: Any
    if spec.negative_flag is not None:
        option = Annotated[bool | None, typer.Option(
            f"{spec.flag}/{spec.negative_flag}", help=spec.option_help(key), rich_help_panel=spec.group)]
    else:
        option = Annotated[str | None, typer.Option(
            spec.flag, metavar=spec.metavar, help=spec.option_help(key), rich_help_panel=spec.group)]
    name = spec.flag.removeprefix("--").replace("-", "_")
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=option)


def with_key_options(func: Callable[..., None]) -> Callable[..., None]:
    """``func`` as a typer command with one option per config key in place of its parameter ``flags``.

    The options are made from :data:`gradseam.config.KEY_SPECS` (flag, metavar, help line, section),
    in the keys' order; ``func`` receives ``flags``, ``{flag: value}`` of the options given, for
    :func:`gradseam.tools.launch.prepare`.
    """
    signature = inspect.signature(func, eval_str=True)
    keyed = {key: _key_parameter(key, spec) for key, spec in KEY_SPECS.items()}
    params: list[inspect.Parameter] = []
    for param in signature.parameters.values():
        params += keyed.values() if param.name == "flags" else [param.replace(kind=inspect.Parameter.KEYWORD_ONLY)]
    names = [p.name for p in params]
    if "flags" not in signature.parameters or len(set(names)) != len(names):
        raise TypeError(f"{func.__name__} needs a parameter 'flags' and no parameter named as a key's option")
    flag_of = {keyed[key].name: spec.flag for key, spec in KEY_SPECS.items()}

    @functools.wraps(func)
    def command(**values: Any) -> None:
        given = {flag_of[name]: values.pop(name) for name in flag_of}
        func(**values, flags={flag: value for flag, value in given.items() if value is not None})

    command.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined] - typer reads it
    command.__annotations__ = {p.name: p.annotation for p in params}
    return command


def _package_dir(module: Any) -> str:
    return os.path.dirname(os.path.abspath(module.__file__))


def internal_dirs() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Where a frame is the command line's machinery, not the user's: (packages, standard library).

    The packages are gradseam itself, typer and its click, rich and pluggy; the standard library
    (``contextlib``, ``runpy``) counts without the site-packages it may hold."""
    import pluggy
    import rich

    import gradseam

    packages = [_package_dir(gradseam), _package_dir(typer), _package_dir(_exceptions), _package_dir(rich),
                _package_dir(pluggy)]
    adapters = sys.modules.get("gradseam.adapters")
    if adapters is not None:
        packages.append(_package_dir(adapters))
    paths = sysconfig.get_paths()
    stdlib = [os.path.abspath(paths[key]) for key in ("stdlib", "platstdlib") if paths.get(key)]
    return tuple(dict.fromkeys(packages)), tuple(dict.fromkeys(stdlib))


def is_internal(filename: str, dirs: tuple[tuple[str, ...], tuple[str, ...]] | None = None) -> bool:
    """Whether a warning attributed to ``filename`` points at the command line's machinery."""
    if not filename or filename.startswith("<"):  # <frozen importlib._bootstrap>, <string>
        return True
    packages, stdlib = dirs or internal_dirs()
    path = os.path.abspath(filename)
    if any(path.startswith(d + os.sep) for d in packages):
        return True
    installed = any(f"{os.sep}{name}{os.sep}" in path for name in ("site-packages", "dist-packages"))
    return not installed and any(path.startswith(d + os.sep) for d in stdlib)


@contextlib.contextmanager
def cli_warnings() -> Iterator[None]:
    """Within the block, a warning attributed to an internal frame (:func:`is_internal`) is formatted as
    ``gradseam: warning: MESSAGE (Category)``, without a file or line; others keep Python's format.

    It replaces :func:`warnings.formatwarning`, which Python's printing and ``logging.captureWarnings``
    use and warning records (``catch_warnings(record=True)``, pytest) do not, and puts the previous one
    back after the block unless the program under ``gradseam run`` replaced it meanwhile.
    """
    before = warnings.formatwarning
    dirs = internal_dirs()

    def formatwarning(message: Any, category: type[Warning], filename: str, lineno: int,
                      line: str | None = None) -> str:
        if is_internal(filename, dirs):
            return f"gradseam: warning: {message} ({category.__name__})\n"
        return before(message, category, filename, lineno, line)

    warnings.formatwarning = formatwarning
    try:
        yield
    finally:
        if warnings.formatwarning is formatwarning:
            warnings.formatwarning = before


class Group(TyperGroup):
    """The ``gradseam`` group: runs a command and turns a usage error into one line and exit code 2."""

    def get_params(self, ctx: Any) -> list[Any]:
        return _flags_as_flags(super().get_params(ctx))

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        return _parse_in(ctx, super().parse_args, args)

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        if not standalone_mode:
            with cli_warnings():
                return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            with cli_warnings():
                code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except ClickException as exc:
            if NoArgsIsHelpError is not None and isinstance(exc, NoArgsIsHelpError):
                exc.show()  # type: ignore[attr-defined] - the help, for a bare `gradseam`
            else:
                print(error_line(exc), file=sys.stderr, flush=True)
            sys.exit(exc.exit_code)  # type: ignore[attr-defined]
        except Abort:
            print("Aborted.", file=sys.stderr, flush=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) and not isinstance(code, bool) else 0)


def error_line(exc: Any) -> str:
    """``gradseam CMD: error: message`` on one line."""
    ctx = getattr(exc, "ctx", None)
    where = ctx.command_path if ctx is not None else "gradseam"
    message = " ".join(str(exc.format_message()).split())
    return f"{where}: error: {message}"


def fail(message: str, code: int = 2) -> NoReturn:
    """Stop the current command with a one-line error (exit code 2: the command line was wrong)."""
    exc = UsageError(message, ctx=_globals.get_current_context(silent=True))
    exc.exit_code = code  # type: ignore[attr-defined]
    raise exc


def bad(option: str, message: str) -> NoReturn:
    """A bad value of one option: ``Invalid value for '--steps': ...``, as click words its own checks."""
    raise typer.BadParameter(message, ctx=_globals.get_current_context(silent=True), param_hint=f"'{option}'")


@contextlib.contextmanager
def refused() -> Iterator[None]:
    """Within the block, an :class:`~gradseam.tools.checks.OptionError` stops the command as a mistake in
    the command line: ``Invalid value for '--x': ...`` for one option's value, the message alone for
    options that exclude or need each other."""
    try:
        yield
    except OptionError as exc:
        if exc.option is None:
            fail(str(exc))
        bad(exc.option, str(exc))


def warn(message: str) -> None:
    """``gradseam CMD: warning: message`` on stderr, one line (as :func:`fail`'s errors look)."""
    ctx = _globals.get_current_context(silent=True)
    where = ctx.command_path if ctx is not None else "gradseam"
    print(f"{where}: warning: {message}", file=sys.stderr, flush=True)


def output_path(path: Path, option: str) -> Path:
    """Check an output file before a long run: create its directory, refuse a directory or a read-only place."""
    if path.is_dir():
        bad(option, f"{str(path)!r} is a directory; name a file.")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        bad(option, f"cannot create the directory {str(path.parent)!r} for {str(path)!r}: {exc.strerror or exc}.")
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        bad(option, f"{str(path)!r} is not writable.")
    return path


def chart_path(json_path: Path, png_path: Path | None) -> Path:
    """Where bench draws its chart (``--png``, else the JSON's path with ``.png``), checked like an output
    file, and refused where it would overwrite the results or matplotlib cannot write its suffix."""
    chart = png_path or json_path.with_suffix(".png")
    if chart.resolve() == json_path.resolve():
        bad("--png", f"the chart would overwrite the results file {str(json_path)!r}; name another file with --png.")
    if png_path is not None:
        try:
            from matplotlib.backend_bases import FigureCanvasBase
        except ImportError:
            pass  # no chart is written without matplotlib; bench says so at the end
        else:
            formats = FigureCanvasBase.get_supported_filetypes()
            if chart.suffix.lstrip(".").lower() not in formats:
                bad("--png", f"matplotlib cannot write {chart.suffix or 'a file without a suffix'!r}; name a "
                             f"file ending in one of: {', '.join('.' + f for f in sorted(formats))}.")
    return output_path(chart, "--png")
