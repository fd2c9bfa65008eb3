"""``gradseam bench --isolate-rows``: each row measured in a process of its own, the results set side by side as one.

Why: a row measured after others in one process is not measured as a training run meets it. The allocator's cache
and its fragmentation, the pinned pool, the compiled graphs and the host's page-locked memory are what the rows
before left. On an H100 capped at 16 GiB, Flux dev 4k's ``unsloth-compile + stream 25`` took 614 ms run first and
684 ms run after another row, in the same call. A comparison such as issue 40's (a capped row against the uncapped
reference, within 15%) moved by more than its margin. Here every row builds the model afresh in a new ``gradseam
bench`` process, with the command's own options and ``--row`` naming that row alone, and writes its own JSON.
The rows are then read back and shown as one sweep would show them. Step-time ratios (``vs none``) compare rows
of different processes on the same GPU, each measured first.

What each row's process is given:

- the sweep's options (family, preset, depths, tokens, steps, base, LoRA, GPU cap);
- ``--full`` where that row is measured at the full depth (``--full`` alone, or ``--full-row`` naming it). A row
  ``--full-row`` leaves out is measured at the fit depths of a model built to them, and predicted at the full depth;
- ``--host-memory`` for the ``auto`` rows, its only readers;
- ``--config-row`` for a config row.

Its JSON and its output (stdout and stderr) are kept beside the sweep's JSON, in ``<name>-rows/``, so a row that
failed can be read there; the sweep's JSON is written after each row, so a sweep stopped between rows keeps them. A process that ended without writing its row gives a row with the exit code and its last
line of output as the status.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from .results import Result

# (argv after "gradseam", where its output goes) -> the process's exit code
Spawn = Callable[[list[str], Path], int]


@dataclass(frozen=True)
class Sweep:
    """The options of the ``gradseam bench`` command that each row's process runs with."""

    family: str
    preset: str | None = None
    depths: str | None = None
    full: bool = False
    full_rows: Sequence[str] | None = None
    depth: int | None = None
    tokens: Sequence[int] | None = None
    steps: int | None = None
    base: str | None = None
    lora: int | None = None
    gpu_memory: str | None = None
    host_memory: str | None = None
    config_rows: Sequence[str] = ()  # the --config-row specs, LABEL=FILE

    def argv(self, label: str, json_path: Path) -> list[str]:
        """The ``gradseam`` command line that measures the row ``label`` alone and writes ``json_path``."""
        from .bench_rows import is_auto_row

        args = ["bench", "--family", self.family]
        for option, value in (("--preset", self.preset), ("--depths", self.depths), ("--depth", self.depth),
                              ("--steps", self.steps), ("--base", self.base), ("--lora", self.lora),
                              ("--gpu-memory", self.gpu_memory)):
            if value is not None:
                args += [option, str(value)]
        for count in self.tokens or ():
            args += ["--tokens", str(count)]
        if self.full and (self.full_rows is None or label in self.full_rows):
            args.append("--full")
        if self.host_memory is not None and is_auto_row(label):
            args += ["--host-memory", self.host_memory]
        spec = next((s for s in self.config_rows if s.partition("=")[0].strip() == label), None)
        if spec is not None:
            args += ["--config-row", spec]
        return [*args, "--row", label, "--json", str(json_path), "--png", str(json_path.with_suffix(".png"))]


def spawn_process(argv: list[str], log: Path) -> int:
    """``python -m gradseam ARGV`` in a new process, its stdout and stderr written to ``log``."""
    with log.open("w") as out:
        return subprocess.run([sys.executable, "-m", "gradseam", *argv], stdout=out, stderr=subprocess.STDOUT,
                              check=False).returncode


@dataclass
class Gathered:
    """What the rows' processes measured, read back: the rows, their timed steps, and the JSON's other parts."""

    results: list[Result]
    steps: list[tuple[float, ...] | None]
    full_depth: list[dict[str, Any]] | None
    depth: dict[str, Any] | None
    meta: dict[str, Any]  # weights_gib, where a row's process said


def run(sweep: Sweep, labels: Sequence[str], folder: Path, *, spawn: Spawn | None = None,
        on_row: Callable[[int, str, list[Result], Gathered], None] | None = None) -> Gathered:
    """Each of ``labels`` measured by its own process (its JSON and log in ``folder``), in order, and read back.
    ``spawn`` runs one (default :func:`spawn_process`); ``on_row(position, label, its results, all so far)`` after
    each."""
    folder.mkdir(parents=True, exist_ok=True)
    gathered = Gathered([], [], None, None, {})
    failed: list[Result] = []
    for position, label in enumerate(labels, 1):
        stem = f"{position:02d}-{_file_name(label)}"
        json_path, log = folder / f"{stem}.json", folder / f"{stem}.log"
        json_path.unlink(missing_ok=True)  # a file left by an earlier sweep must not be read as this row's
        code = (spawn or spawn_process)(sweep.argv(label, json_path), log)
        mine = _read(json_path, gathered)
        if not mine:
            mine = [Result(_workload(gathered, sweep), 0, label, None, None, _ended(code, log))]
            gathered.results += mine
            gathered.steps.append(None)
            failed.append(mine[0])
        if on_row is not None:
            on_row(position, label, mine, gathered)
    workload = _workload(gathered, sweep)
    tokens = next((r.tokens for r in gathered.results if r.tokens), 0)
    for result in failed:  # a row that failed before any other was read is named by the family until now
        result.workload, result.tokens = workload, tokens
        if gathered.full_depth is not None or gathered.depth is not None:
            gathered.full_depth = [*(gathered.full_depth or []), _no_figures(result)]
    return gathered


def _workload(gathered: Gathered, sweep: Sweep) -> str:
    """The workload's words, as the rows' processes wrote them (the family's name before any did)."""
    return next((r.workload for r in gathered.results if r.tokens), sweep.family)


def _no_figures(result: Result) -> dict[str, Any]:
    """A full-depth row for a row whose process wrote nothing: its status, and no figure."""
    row: dict[str, Any] = {key: None for key in (
        "peak_gib", "peak_source", "predicted_peak_gib", "prediction_error", "peak_fit", "growth_gib_per_unit",
        "fixed_gib", "pinned_gib", "pinned_source", "step_ms", "step_source", "vs_none", "gpu_peak_gib")}
    return {"workload": result.workload, "strategy": result.strategy, "status": result.status, **row}


def _read(json_path: Path, into: Gathered) -> list[Result]:
    """The rows a process wrote (none where it wrote no file), added to ``into`` with the JSON's other parts."""
    try:
        data = json.loads(json_path.read_text())
    except (OSError, ValueError):
        return []
    names = {f.name for f in fields(Result)}
    mine = [Result(**{k: v for k, v in row.items() if k in names}) for row in data.get("rows") or ()]
    into.results += mine
    into.steps += [tuple(row["step_times_ms"]) if row.get("step_times_ms") else None for row in data["rows"]]
    if data.get("full_depth") is not None:
        into.full_depth = [*(into.full_depth or []), *data["full_depth"]]
    if data.get("depth") is not None:
        measured_full = bool(into.depth and into.depth.get("measured_full")) or bool(data["depth"].get("measured_full"))
        into.depth = {**data["depth"], "measured_full": measured_full}
    if data.get("weights_gib") is not None:
        into.meta["weights_gib"] = data["weights_gib"]
    return mine


def tables(gathered: Gathered) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The measured rows and the full-depth rows, with their ratios across the processes: what bench shows."""
    from .bench_report import full_depth_ratios, with_ratios

    # each process computed its ratios against a none it did not run
    deep = full_depth_ratios(gathered.full_depth) if gathered.full_depth is not None else None
    return with_ratios(gathered.results, gathered.steps), deep


def _ended(code: int, log: Path) -> str:
    try:
        lines = [line.strip() for line in log.read_text().splitlines() if line.strip()]
    except OSError:
        lines = []
    last = lines[-1] if lines else "no output"
    return f"error: its process exited with code {code} without writing its row ({last}; the whole output: {log})"


def _file_name(label: str) -> str:
    return "".join(c if c.isalnum() or c in "-." else "-" for c in label).strip("-")[:60] or "row"
