"""The ``gradseam`` command: ``families``, ``demo``, ``bench``, ``advise`` and ``run`` (and ``--version``).

Every option is checked before a command starts working (a benchmark that runs for minutes and
then cannot write its results has wasted the minutes): values, combinations, the family and its
preset (before the CUDA check, so a typo is reported on any machine), the device, and the output
files; then whether a CUDA GPU can exist (:func:`gradseam.tools.checks.cuda_missing`); and only
then what imports torch or diffusers (the family's model class), since those imports take tens of
seconds on a small machine (:mod:`gradseam.tools.checks`, where the option checks are small named
functions of the values, raising :class:`~gradseam.tools.checks.OptionError`). How a mistake is
shown, and why flags and tables look the way they do: :mod:`gradseam.tools.cli_support`.
``gradseam run``'s options are not written here: they are made from the config keys' specs
(:func:`~gradseam.tools.cli_support.with_key_options`).
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

import gradseam

from . import checks
from .cli_support import (
    PIPED_WIDTH,
    Command,
    Group,
    bad,
    chart_path,
    console,
    fail,
    option_names,
    output_path,
    refused,
    warn,
    with_key_options,
)

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import TaskID

    from ..family import Family
    from .estimates import Advice
    from .measure import Measurement
    from .results import RealRun, Result
    from .workloads import Workload

app = typer.Typer(
    cls=Group,
    help="Gradient checkpointing and activation offload for diffusers transformers.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,
)
command = partial(app.command, cls=Command)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"gradseam {gradseam.__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[bool, typer.Option(
        "--version", is_eager=True, callback=_print_version,
        help="print gradseam's version and exit (what a bug report needs first)")] = False,
) -> None:
    # no docstring: the group's help is the Typer(help=...) text above
    pass


def _progress(out: Console) -> Progress:
    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=out, transient=True,
    )


# -- checks shared by the commands ----------------------------------------------------------------


def _device(device: str | None, option: str = "--device") -> str | None:
    with refused():
        checks.device_name(device, option)
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            bad(option, "cuda asked for, but torch sees no CUDA GPU here (torch.cuda.is_available() is False); "
                        "use --device cpu, or leave --device out.")
    return device


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _family(name: str, preset: str | None) -> tuple[Family, str]:
    """The installed family and its preset: checked on any machine, without importing torch or diffusers."""
    try:
        family = checks.find_family(name)
    except gradseam.GradseamError as exc:
        bad("--family", str(exc))
    try:
        preset_name, _ = checks.find_preset(family, preset)
    except gradseam.GradseamError as exc:
        bad("--preset" if preset is not None else "--family", str(exc))
    return family, preset_name


def _model_class(family: Family) -> None:
    """The family's model class importable from the installed diffusers (this imports diffusers: after
    every other check, the GPU's included)."""
    try:
        checks.model_class(family)
    except gradseam.GradseamError as exc:
        bad("--family", str(exc))


def _need_cuda(message: str, then: str = "") -> None:
    """Stop with ``message`` (and ``then``, a sentence after the reason) where there is no CUDA GPU:
    first the checks that need no torch (a CPU-only torch build, no driver), so a machine without a
    GPU hears it at once, then torch's own answer."""
    why = checks.cuda_missing()
    if why is None:
        import torch

        if torch.cuda.is_available():
            return
        why = "torch sees no CUDA GPU here: torch.cuda.is_available() is False"
    fail(f"{message} ({why}).{' ' + then if then else ''}")


def _quiet_diffusers() -> None:
    # building random-weight models logs a bf16-cast notice per model; it is noise here
    from diffusers.utils import logging as dlogging

    dlogging.set_verbosity_error()


# -- families -------------------------------------------------------------------------------------


FAMILY_COLUMNS = ("family", "plugin (distribution)", "model classes", "block lists", "FFN seams",
                  "attention side", "interval", "stride")


def _seams(fam: Family) -> str:
    """Each block class's FFN seams (``a → b`` for a seam of several modules), one class per line."""
    lines = []
    for bc in fam.block_classes:
        seams = ", ".join(" → ".join(seam) + (" (optional)" if set(seam) & set(bc.optional) else "")
                          for seam in bc.ffn)
        lines.append(f"{bc.name.rsplit('.', 1)[-1]}: {seams or 'none'}")
    return "\n".join(lines) or "none"


def _attention(fam: Family) -> str:
    """Each block class's attention submodules (what attention offload and kept kernels work in)."""
    lines = [f"{bc.name.rsplit('.', 1)[-1]}: {', '.join(bc.attention) or 'none'}" for bc in fam.block_classes]
    return "\n".join(lines) or "none"


def _interval(fam: Family) -> str:
    """Whether interval chunks of N blocks run, per block list: those without a carry run block by block."""
    chunked = [bl for bl in fam.block_lists if bl.carry is not None]
    if not chunked:
        return "no (block by block)"
    words = "yes" if len(chunked) == len(fam.block_lists) else "only " + ", ".join(bl.path for bl in chunked)
    if any(bl.per_block for bl in chunked):
        words += " (block by block with a per-block cache)"
    return words


def _family_rows() -> list[tuple[str, ...]]:
    rows = []
    for item in gradseam.installed():
        fam = item.family
        dist = f"{item.plugin} ({item.distribution} {item.version})" if item.distribution else item.plugin
        rows.append((
            fam.name,
            dist,
            "\n".join(n.rsplit(".", 1)[-1] for n in fam.model_names),
            "\n".join(bl.path + (" (optional)" if bl.optional else "") for bl in fam.block_lists),
            _seams(fam),
            _attention(fam),
            _interval(fam),
            "yes",  # the stride picks blocks by index in every list, whatever the carry
        ))
    return rows


def print_families(out: Console) -> None:
    """The families as a table where it fits the width whole, else one entry per family.

    Class names and block paths are single words of up to ~30 characters; eight columns of them
    need ~200 columns. Squeezed into an 80-column terminal, rich folds them mid-word
    (``HunyuanVideo15Tr|ansformer3DModel``), which reads as two names and cannot be searched or
    pasted. So the table is printed only where its narrowest layout, every word whole, fits;
    otherwise each family is a short entry, wrapped between words.

    What each column means: the FFN seams are the submodules ``torch-ffn`` / ``unsloth-ffn`` recompute
    (per block class; none: those backends are refused); the attention side, the submodules attention
    offload and kept attention kernels work in (none: both refused); interval, whether
    ``gradient_checkpointing_interval`` chunks several blocks into one region (a list without a carry
    runs block by block); stride, whether ``gradient_checkpointing_segment_stride`` selects the first
    N of every S blocks (every family: it needs no carry).
    """
    from rich.measure import Measurement

    rows = _family_rows()
    table = Table(title="gradseam families")
    for column in FAMILY_COLUMNS:
        table.add_column(column)  # shown only where no word has to be cut (below)
    for row in rows:
        table.add_row(*row)
    # measured without a width limit: Measurement.get clamps its result to the width it is given
    if Measurement.get(out, out.options.update_width(PIPED_WIDTH), table).minimum <= out.width:
        out.print(table)
    else:
        out.print("gradseam families", markup=False, highlight=False)
        for name, dist, classes, lists, seams, attention, interval, stride in rows:
            out.print("", markup=False)
            out.print(f"{name}: {dist}", markup=False, highlight=False)
            for label, value in (("model classes", classes), ("block lists", lists)):
                out.print(f"  {label}: {', '.join(value.splitlines())}", markup=False, highlight=False)
            for label, value in (("FFN seams", seams), ("attention side", attention)):
                lines = value.splitlines()  # one per block class
                if len(lines) == 1:
                    out.print(f"  {label}: {lines[0]}", markup=False, highlight=False)
                    continue
                out.print(f"  {label}:", markup=False, highlight=False)
                for line in lines:
                    out.print(f"    {line}", markup=False, highlight=False)
            out.print(f"  interval: {interval}; stride: {stride}", markup=False, highlight=False)
    out.print(
        "FFN seams: what torch-ffn / unsloth-ffn recompute (none: they are refused). Attention side: where "
        "attention offload and kept attention kernels work (none: both refused). Interval: whether "
        "gradient_checkpointing_interval runs N blocks as one region (no: block by block). Stride: whether "
        "gradient_checkpointing_segment_stride picks the first N of every S blocks.",
        markup=False, highlight=False,
    )
    left_out = gradseam.unsupported_models()
    if left_out:
        out.print("", markup=False)
        out.print(f"Left out ({len(left_out)} model classes no family handles, and why; patching one raises "
                  "with its reason):", markup=False, highlight=False)
        for path, reason in left_out.items():
            out.print(f"  {path.rsplit('.', 1)[-1]}: {reason}", markup=False, highlight=False)


@command()
def families() -> None:
    """List installed families: who provides them, what they patch, and what they support."""
    print_families(console())


# -- demo -----------------------------------------------------------------------------------------


@command()
def demo(
    tokens: Annotated[int | None, typer.Option(metavar="N", help="image tokens, a square number (default 4096 on GPU, 256 on CPU)")] = None,
    steps: Annotated[int, typer.Option(metavar="N", help="timed steps per strategy, after one warm-up step")] = 3,
    device: Annotated[str | None, typer.Option(metavar="cpu|cuda", help="default: cuda if available")] = None,
    threads: Annotated[int | None, typer.Option(metavar="N", help="CPU: torch threads (default 1: steadier times on small or busy machines)")] = None,
) -> None:
    """Patch a small built-in Flux with every strategy this machine supports and compare them."""
    from . import measure
    from .demo import check_tokens, noise_marks, run

    with refused():
        checks.at_least("--steps", steps, "a number of timed steps")
        checks.at_least("--threads", threads, "a number of CPU threads")
    device = _device(device)
    if threads is not None and device != "cpu" and _default_device() != "cpu":
        fail("--threads sets the CPU's torch threads; the demo runs on the GPU here (add --device cpu).")
    if tokens is not None:
        try:
            check_tokens(tokens)
        except ValueError as exc:
            bad("--tokens", str(exc))
    out = console()
    with _progress(out) as progress:
        task = progress.add_task("strategies", total=None)

        def track(it, total):
            progress.update(task, total=total)
            for item in it:
                progress.update(task, description=f"running {item[0]}")
                yield item
                progress.advance(task)

        rows = run(device=device, image_tokens=tokens, steps=steps, progress=track, threads=threads)
    none = rows[0]
    marks = noise_marks(rows)
    table = Table(title=f"small Flux ({rows[0].device}, {rows[0].tokens} image tokens): kept activations and step time")
    for column in ("strategy", "kept MiB", "vs none", "step ms", "spread", "vs none", "max |grad - unpatched|"):
        table.add_column(column, justify="right" if column != "strategy" else "left", overflow="fold")
    for r, mark in zip(rows, marks):
        table.add_row(
            r.strategy, f"{r.kept_mib:.1f}", f"{r.kept_mib / none.kept_mib:.2f}", f"{r.step_ms:.1f}",
            _spread_cell(r.spread), f"{r.step_ms / none.step_ms:.2f}" + ("*" if mark else ""), f"{r.max_grad_diff:.1e}",
        )
    out.print(table)
    out.print(measure.spread_line(steps), markup=False, highlight=False)
    note = measure.noise_note(marks)
    if note:
        out.print(note, markup=False, highlight=False)
    out.print(
        "Practical rule (full-depth H200 measurements, docs/benchmarks.md): no checkpointing if it fits. "
        "On a CUDA GPU with shapes that repeat: backend unsloth-compile (compiled blocks under the compiler's "
        "memory budget, what they keep in pinned host memory; Flux dev 4k: 0.73 GiB at 0.98x no "
        "checkpointing with budget 0.3; Wan 14B 40 blocks: 6.33 GiB at ~1.01x), or compile if host memory is "
        "short. Without a compiler or with shapes changing every step, eager: torch-ffn if a shallow cut is "
        "enough, else torch / unsloth; at tens of thousands of tokens (video) with "
        "gradient_checkpointing_offload_attention. Interval >= 2 only to win speed back once an eager backend "
        "fits. "
        "Weights that do not fit the card: gradient_checkpointing_stream_weights keeps the frozen weights in "
        "host memory and copies each block in while the one before it computes (Wan 14B at 480p, all 40 "
        "blocks streamed with unsloth-compile: 9.9 GiB of GPU memory at 1.01x, 34 of them with memory budget 0.05: "
        "13.5 GiB at 1.02-1.03x with 62 GiB of host memory pinned, a 16 or 24 GB card; leave a few GiB free under "
        "the card, since a step that finds too little room retries allocations and slows; image models at a few "
        "thousand tokens: stream as few blocks as fit, each costs about its copy time). "
        "`gradseam advise` finds the crossover for your model at its real depth."
    )


def _spread_cell(spread: float | None) -> str:
    return "-" if spread is None else f"{spread:.0%}"


# -- bench ----------------------------------------------------------------------------------------


def _check_depths(depths: str | None) -> None:
    """The form of --depths, before a model is built (its bound, the model's depth, is checked after)."""
    with refused():
        low = checks.depths_form(depths)
    if low == 1:
        # Seen on HunyuanVideo 1.5: at one block nothing is prefetched ahead in backward, so the
        # step from depth 1 to 2 adds that buffer once and the fit reads it as growth per block.
        typer.echo(
            "note: --depths starts at 1; at one unit of depth offload rows have no next block to prefetch, "
            "so their fitted growth (and full-depth figure) can be too high. Prefer 2,4 where it fits.",
            err=True,
        )


def _check_dim(dim: int | None) -> None:
    if dim is not None:
        from .synthetic import HEAD_DIM

        with refused():
            checks.synthetic_width(dim, HEAD_DIM)


class _Sweep:
    """A bench sweep's progress bar and results file. A sweep of a real model runs for many minutes: each
    row is written to the JSON as soon as it is measured, so an interrupted run (Ctrl-C, a time limit)
    loses only the row in flight."""

    def __init__(self, progress: Progress, log: list[Measurement], json_path: Path, title: str,
                 meta: dict[str, Any]) -> None:
        self.progress, self.log, self.json_path, self.title, self.meta = progress, log, json_path, title, meta
        self.task: TaskID = progress.add_task("building", total=None)
        self.done: list[Result] = []
        self.times: dict[int, tuple[float, ...]] = {}  # id(result) -> its timed steps (records keep the median)

    def steps_of(self, results: list[Result]) -> list[tuple[float, ...] | None]:
        return [self.times.get(id(r)) for r in results]

    def expect(self, total: int, description: str | None = None) -> None:
        self.progress.update(self.task, total=total, **({"description": description} if description else {}))

    def on_row(self, result: Result) -> None:
        from . import bench_report as report
        from .bench_rows import CPU_STATUS_WHY

        self.done.append(result)
        # a row that was measured reports right after its measurement: the log's last entry
        if result.status == "ok" and self.log:
            self.times[id(result)] = self.log[-1].step_times_ms
        self.log.clear()
        partial = report.payload(report.with_ratios(self.done, self.steps_of(self.done)),
                                 self.title + report.PARTIAL, **self.meta)
        self.json_path.write_text(json.dumps(partial, indent=1))
        self.progress.advance(self.task)
        where = f" at depth {result.depth}" if result.depth is not None else ""
        self.progress.update(self.task, description=f"{result.workload}{where}: {result.strategy}")
        if result.status != "ok" and result.status not in CPU_STATUS_WHY:
            why = f" ({result.failure})" if result.failure else ""
            self.progress.console.print(f"{result.strategy}{where}: {result.status}{why}", markup=False,
                                        highlight=False)


def _sweep_family(sweep: _Sweep, family: str, preset: str, *, depths: str | None, full: bool, depth: int | None,
                  full_rows: list[str] | None, tokens: list[int] | None, rows: list[str] | None,
                  skip_rows: list[str] | None, steps: int, base: str | None = None,
                  lora: int | None = None, gpu_memory_gib: float | None = None,
                  host_memory_gib: float | None = None,
                  config_rows: list[tuple[str, dict[str, Any]]] | None = None) -> RealRun:
    """The rows chosen (--row, every row but --skip-row's, or all, then --config-row's) on the family's real-size
    model (bench.real), on a quantized ``base`` and with a LoRA where asked; a failure stops the command."""
    from . import bench as b
    from .bench_rows import chosen_rows, full_depth_rows

    rows = chosen_rows(rows, skip_rows)
    full_rows = list(full_rows) if full_rows else None
    per_tokens = len(tokens or [None])

    def on_build(built: RealRun) -> None:
        sweep.meta["weights_gib"] = round(built.weights_gib, 2)
        per_depth = len(b.real_rows(rows, extra=config_rows)) * per_tokens
        last = len(full_depth_rows(full_rows, config_rows) or []) * per_tokens if full_rows else per_depth
        sweep.expect(per_depth * len(built.fit_depths) + (last if full else 0))

    try:
        return b.real(family, preset, depths=depths, full=full, full_depth=depth, full_rows=full_rows,
                      tokens=list(tokens) if tokens else None, rows=rows, steps=steps, on_row=sweep.on_row,
                      on_build=on_build, base=base, lora=lora, gpu_memory_gib=gpu_memory_gib,
                      host_memory_gib=host_memory_gib, config_rows=config_rows)
    except b.DeviceLostError as exc:
        fail(str(exc), code=1)
    except (gradseam.GradseamError, ValueError) as exc:
        fail(str(exc))


def _sweep_synthetic(sweep: _Sweep, *, cpu: bool, blocks: int | None, tokens: list[int] | None, dim: int | None,
                     steps: int, device: str, threads: int | None) -> list[Result]:
    """Every row on the synthetic stack, at its default shapes or the one --blocks/--tokens/--dim pick."""
    from . import bench as b

    defaults = b.CPU_SHAPES if cpu else b.SYNTHETIC_SHAPES
    shapes = None
    if blocks or dim or tokens:
        default_blocks, default_tokens, default_dim = defaults[0]
        shapes = [(blocks or default_blocks, t, dim or default_dim) for t in (tokens or [default_tokens])]
    sweep.expect(len(shapes or defaults) * len(b.synthetic_rows()), "bench")
    try:
        return b.synthetic(shapes, steps=steps, on_row=sweep.on_row, device=device, threads=threads)
    except b.DeviceLostError as exc:  # a row broke the device: say which, keep the JSON
        fail(str(exc), code=1)


def _print_bench(out: Console, sweep: _Sweep, results: list[Result], run: RealRun | None, *, full: bool, cpu: bool,
                 png_path: Path) -> None:
    """The results file, the tables (pasteable markdown) and the chart."""
    from . import bench_report as report

    measured = report.with_ratios(results, sweep.steps_of(results))
    deep = depth_info = None
    if run is not None:
        deep = report.full_depth_rows(run)
        depth_info = report.depth_info(run, measured_full=full)
    _show_bench(out, sweep.title, sweep.meta, sweep.json_path, measured, deep, depth_info, cpu=cpu, png_path=png_path)


def _show_bench(out: Console, title: str, meta: dict[str, Any], json_path: Path, measured: list[dict[str, Any]],
                deep: list[dict[str, Any]] | None, depth_info: dict[str, Any] | None, *, cpu: bool,
                png_path: Path) -> None:
    """Rows with their ratios, as one sweep or the processes of ``--isolate-rows`` measured them: the JSON, the
    tables and the chart."""
    from . import bench_report as report
    from . import measure

    payload = report.payload(measured, title, depth=depth_info, full_depth=deep, **meta)
    json_path.write_text(json.dumps(payload, indent=1))
    out.print(title, markup=False)
    if deep is not None:
        out.print(report.full_depth_markdown(deep, depth_info), markup=False, highlight=False, soft_wrap=True)
        out.print("\nMeasured:", markup=False)
    out.print(report.to_markdown(measured, cpu=cpu), markup=False, highlight=False, soft_wrap=True)  # pasteable
    plans = report.auto_plans_note(measured)
    if plans:
        out.print(plans, markup=False, highlight=False, soft_wrap=True)
    if cpu:
        out.print(f"memory: {report.MEMORY_CPU}.", markup=False)
        left_out = report.cpu_status_note(measured)
        if left_out:
            out.print(left_out, markup=False, highlight=False)
        out.print(measure.spread_line(meta["steps"]), markup=False)
        note = report.cpu_noise_note(measured)
        if note:
            out.print(note, markup=False, highlight=False)
    out.print(f"wrote {json_path}", markup=False)
    if report.chart(deep if deep is not None else measured, png_path, title, cpu=cpu):
        out.print(f"wrote {png_path}", markup=False)
    else:
        out.print("matplotlib is not installed, so no chart was written (pip install 'gradseam[bench]').", markup=False)


def _machine(device: str) -> dict[str, str | None]:
    """What measured a bench run, for its JSON: the GPU's name (None on the CPU) and torch's version. Rows of
    different cards are not comparable, and a figure must say which card gave it."""
    import torch

    gpu = torch.cuda.get_device_name(0) if device != "cpu" and torch.cuda.is_available() else None
    return {"gpu": gpu, "torch_version": torch.__version__}


def _bench_isolated(family: str, preset: str, json_path: Path, png_path: Path, *, depths: str | None, full: bool,
                    full_rows: list[str] | None, depth: int | None, tokens: list[int] | None, rows: list[str] | None,
                    skip_rows: list[str] | None, steps: int | None, base: str | None, lora: int | None,
                    gpu_memory: str | None, host_memory: str | None, config_row_specs: list[str],
                    meta: dict[str, Any]) -> None:
    """``bench --isolate-rows``: each row by a ``gradseam bench`` process of its own (:mod:`.bench_isolated`), one
    step of progress per row, then the rows shown as one sweep shows them."""
    from . import bench_isolated as isolated
    from . import bench_report as report
    from .bench_rows import CPU_STATUS_WHY, chosen_rows, config_rows, real_rows

    rows = chosen_rows(rows, skip_rows)
    labels = [name for name, _ in real_rows(rows, extra=config_rows(config_row_specs))]
    sweep = isolated.Sweep(family, preset, depths, full, full_rows, depth, tokens, steps, base, lora, gpu_memory,
                           host_memory, config_row_specs)
    folder = json_path.with_name(f"{json_path.stem}-rows")
    title = f"gradseam bench: {family} {preset} (each row in a process of its own)"
    out = console()
    with _progress(out) as progress:
        task = progress.add_task(f"row 1 of {len(labels)}: {labels[0]}" if labels else "bench", total=len(labels))

        def on_row(position: int, label: str, mine: list[Result], gathered: isolated.Gathered) -> None:
            # the rows so far, as one file (an interrupted or timed-out sweep keeps them, as a sweep's JSON does)
            measured, deep = isolated.tables(gathered)
            json_path.write_text(json.dumps(report.payload(
                measured, title + report.PARTIAL, depth=gathered.depth, full_depth=deep,
                **{**meta, **gathered.meta}), indent=1))
            progress.advance(task)
            if position < len(labels):
                progress.update(task, description=f"row {position + 1} of {len(labels)}: {labels[position]}")
            for result in mine:
                if result.status != "ok" and result.status not in CPU_STATUS_WHY:
                    where = f" at depth {result.depth}" if result.depth is not None else ""
                    why = f" ({result.failure})" if result.failure else ""
                    progress.console.print(f"{label}{where}: {result.status}{why}", markup=False, highlight=False)

        gathered = isolated.run(sweep, labels, folder, on_row=on_row)
    measured, deep = isolated.tables(gathered)
    _show_bench(out, title, {**meta, **gathered.meta}, json_path, measured, deep, gathered.depth, cpu=False,
                png_path=png_path)
    out.print(f"each row's JSON and output: {folder}", markup=False)


# the weights a real-size model is measured with: bench's and advise's options
BaseOption = Annotated[str | None, typer.Option(metavar="NAME", help="quantize the blocks' weights as this base, e.g. torchao-fp8 or bnb-nf4 (gradseam.tools.bases; an unknown name lists them all; needs pip install 'gradseam[quant]')")]
LoraOption = Annotated[int | None, typer.Option(metavar="R", help="train a LoRA of rank R on the attention projections (needs peft) instead of frozen weights")]


@command()
def bench(
    family: Annotated[str | None, typer.Option(metavar="NAME", help="benchmark this family's real-size preset model (random weights; needs CUDA)")] = None,
    preset: Annotated[str | None, typer.Option(metavar="NAME", help="the family's preset (default: its first)")] = None,
    depths: Annotated[str | None, typer.Option(metavar="D1,D2", help="the two depths every row is measured at, in units of depth (default 2,4); the full-depth figures are fitted from them")] = None,
    full: Annotated[bool, typer.Option("--full", help="also measure at the full depth (needs the full model to fit the GPU); rows predicted not to fit the GPU or the host's pinnable memory are ruled out")] = False,
    depth: Annotated[int | None, typer.Option(metavar="N", help="predict for this depth instead of the preset's real one (units of depth)")] = None,
    full_rows: Annotated[list[str] | None, typer.Option("--full-row", metavar="LABEL", help="with --full: measure only this row at the full depth (repeat for several; compiling a full model per row is slow); the rest are predicted")] = None,
    tokens: Annotated[list[int] | None, typer.Option(metavar="N", help="tokens per workload (repeat for several; default: the preset's, or the synthetic shapes)")] = None,
    rows: Annotated[list[str] | None, typer.Option("--row", metavar="LABEL", help="only this row, by label (repeat for several; default: every row)")] = None,
    skip_rows: Annotated[list[str] | None, typer.Option("--skip-row", metavar="LABEL", help="every row but this one (repeat for several)")] = None,
    synthetic: Annotated[bool, typer.Option("--synthetic", help="the synthetic block stack (the default without --family)")] = False,
    blocks: Annotated[int | None, typer.Option(metavar="N", help="synthetic stack: number of blocks (default 8 on GPU, 2 on CPU)")] = None,
    dim: Annotated[int | None, typer.Option(metavar="D", help="synthetic stack: model width, divisible by its head count max(dim // 128, 1) (default 3072 on GPU, 256 on CPU)")] = None,
    device: Annotated[str | None, typer.Option(metavar="cpu|cuda", help="synthetic stack: cpu or cuda (default: cuda if available)")] = None,
    json_path: Annotated[Path, typer.Option("--json", metavar="FILE", help="where to write the results (its directory is created)")] = Path("gradseam-bench.json"),
    png_path: Annotated[Path | None, typer.Option("--png", metavar="FILE", help="chart path (default: the JSON path with .png)")] = None,
    steps: Annotated[int | None, typer.Option(metavar="N", help="timed steps per strategy, median reported (default 5 on GPU, 2 on CPU)")] = None,
    threads: Annotated[int | None, typer.Option(metavar="N", help="synthetic stack on the CPU: torch threads (default: torch's, one per core; 1 gives steadier times on small or busy machines)")] = None,
    base: BaseOption = None,
    lora: LoraOption = None,
    gpu_memory: Annotated[str | None, typer.Option(metavar="SIZE", help="with --family: run every row's steps on this much of the GPU, e.g. '24GiB' (torch.cuda.set_per_process_memory_fraction), as on a smaller card; rows that stream weights ('unsloth-compile + stream all') fit where resident ones do not; the 'auto' row plans within it")] = None,
    host_memory: Annotated[str | None, typer.Option(metavar="SIZE", help="with --row auto: the pinned host memory its plan may use (its gradient_checkpointing_host_memory), e.g. '48GiB' (default: 3/4 of this machine's available memory)")] = None,
    config_row_specs: Annotated[list[str] | None, typer.Option("--config-row", metavar="LABEL=FILE", help="with --family: also measure your own config as a row labelled LABEL, after the rows --row picks, by the same protocol (repeat for several). FILE is a JSON object of gradseam config keys as a trainer config writes them (a hand-chosen per-block plan, say), or an auto row's \"plan\" object from bench's JSON, whose \"config\" is such an object. 'mine @ 24GiB=FILE' runs its steps on 24 GiB of the GPU, as other rows' ' @ SIZE' does; --full-row LABEL measures it at the full depth")] = None,
    isolate_rows: Annotated[bool, typer.Option("--isolate-rows", help="with --family: measure each row in a process of its own, the model built again for each, so no row runs after another in one process (its allocator cache, pinned pool and compiled graphs); each row's JSON and output are kept in FILE-rows/ beside --json FILE")] = False,
) -> None:
    """Benchmark every strategy: memory, host memory and step time, side by side with the references.

    Without --family: the synthetic block stack; on a CUDA GPU in bf16 at four sizes (activation
    peak), elsewhere on the CPU in float32 at 2 blocks x 256 tokens x 256 wide (the memory column
    is then the bytes autograd keeps between forward and backward; offload rows need CUDA).
    --blocks, --tokens and --dim pick one synthetic size. With --family NAME [--preset P]: the
    family's real-size model with random bf16 weights built on the GPU (needs CUDA), measured at
    two depths; the table shows the figures at the model's real depth first (~ = predicted).
    """
    with refused():
        checks.bench_options(family=family, preset=preset, depths=depths, full=full, depth=depth,
                             full_rows=full_rows, tokens=tokens, rows=rows, skip_rows=skip_rows, synthetic=synthetic,
                             blocks=blocks, dim=dim, device=device, steps=steps, threads=threads, base=base, lora=lora)
    with refused():
        cap_gib = checks.gpu_cap(gpu_memory, family)
        host_gib = checks.host_size(host_memory) if host_memory is not None else None
    from .bench_rows import config_rows, is_auto_row  # labels and JSON files only: no torch

    if config_row_specs and family is None:
        fail("--config-row adds a row to a real-size model's sweep; it needs --family.")
    try:
        extra_rows = config_rows(config_row_specs or [])
    except gradseam.GradseamError as exc:
        bad("--config-row", str(exc))
    if isolate_rows and family is None:
        fail("--isolate-rows measures each row of a real-size model's sweep in a process of its own; it needs --family.")
    with refused():
        checks.full_rows_measured(full_rows, rows, skip_rows, extra_rows)
    if host_gib is not None and not any(is_auto_row(r) for r in rows or ()):
        fail("--host-memory is the budget the 'auto' row plans within; add --row auto (or --row 'auto @ 24GiB').")
    fam, preset = _family(family, preset) if family is not None else (None, preset)
    _check_depths(depths)
    with refused():
        checks.known_rows(skip_rows)
    _check_dim(dim)
    json_path = output_path(json_path, "--json")
    png_path = chart_path(json_path, png_path)
    if fam is not None:
        _need_cuda(
            "gradseam bench --family builds the family's real-size model (billions of parameters) and "
            "measures GPU memory and time, so it needs a CUDA GPU; none is available",
            "Without --family, `gradseam bench` runs the small synthetic stack on the CPU.",
        )
        _model_class(fam)
    device = _device(device)
    if isolate_rows:
        assert fam is not None
        _bench_isolated(fam.name, preset, json_path, png_path, depths=depths, full=full, full_rows=full_rows,
                        depth=depth, tokens=tokens, rows=rows, skip_rows=skip_rows, steps=steps, base=base, lora=lora,
                        gpu_memory=gpu_memory, host_memory=host_memory, config_row_specs=config_row_specs or [],
                        meta={"device": "cuda", "family": family, "preset": preset, "steps": steps or 5,
                              "base": base, "lora": lora, "gpu_memory_gib": cap_gib, "host_memory_gib": host_gib,
                              **_machine("cuda")})
        return
    from . import bench as b
    from . import measure

    dev = "cuda" if fam is not None else (device or b.default_device())
    cpu = dev == "cpu"
    if threads is not None and not cpu:
        fail("--threads sets the CPU's torch threads; the synthetic stack runs on the GPU here (add --device cpu).")
    if steps is None:
        steps = b.CPU_STEPS if cpu else 5
    title = f"gradseam bench: {fam.name} {preset}" if fam is not None else b.synthetic_title(dev)
    meta = {"device": dev, "family": family, "preset": preset, "steps": steps, "base": base, "lora": lora,
            "gpu_memory_gib": cap_gib, "host_memory_gib": host_gib, **_machine(dev)}
    out = console()
    run = None
    if fam is not None:
        _quiet_diffusers()
    with _progress(out) as progress, measure.recorded() as log:
        sweep = _Sweep(progress, log, json_path, title, meta)
        if fam is not None:
            run = _sweep_family(sweep, fam.name, preset, depths=depths, full=full, depth=depth,
                                full_rows=full_rows, tokens=tokens, rows=rows, skip_rows=skip_rows, steps=steps,
                                base=base, lora=lora, gpu_memory_gib=cap_gib, host_memory_gib=host_gib,
                                config_rows=extra_rows)
            results = run.results
        else:
            results = _sweep_synthetic(sweep, cpu=cpu, blocks=blocks, tokens=tokens, dim=dim, steps=steps,
                                       device=dev, threads=threads)
    _print_bench(out, sweep, results, run, full=full, cpu=cpu, png_path=png_path)


# -- advise ---------------------------------------------------------------------------------------


@command()
def advise(
    family: Annotated[str, typer.Option(metavar="NAME", help="the family whose real-size preset model is measured")],
    gpu: Annotated[str | None, typer.Option("--gpu", "--gpu-memory", metavar="SIZE", help="the GPU memory available to the run: '40GiB', '40 GB', '40960MiB' or GiB as a number  [required]")] = None,
    budget: Annotated[str | None, typer.Option(metavar="SIZE", hidden=True, help="deprecated: the old name of --gpu")] = None,
    host_memory: Annotated[str | None, typer.Option(metavar="SIZE", help="the host memory of the machine that will train, e.g. '64GiB' (default: this machine's available memory); gradseam plans to pin at most 3/4 of it")] = None,
    preset: Annotated[str | None, typer.Option(metavar="NAME", help="the family's preset (default: its first)")] = None,
    depths: Annotated[str | None, typer.Option(metavar="D1,D2", help="the two depths each candidate is measured at, in units of depth (default 2,4)")] = None,
    depth: Annotated[int | None, typer.Option(metavar="N", help="plan for this depth instead of the preset's real one (units of depth)")] = None,
    tokens: Annotated[int | None, typer.Option(metavar="N", help="image/video tokens (default: the preset's)")] = None,
    json_path: Annotated[Path | None, typer.Option("--json", metavar="FILE", help="also write every measurement here (its directory is created)")] = None,
    base: BaseOption = None,
    lora: LoraOption = None,
) -> None:
    """Measure the strategy ladder at two depths and recommend the fastest config that fits at the real depth.

    Every candidate's activation peak, step time and pinned host memory are predicted for the
    preset's full depth from two shallow measurements; a candidate fits when its peak plus the full
    model's static memory is within the GPU's memory (--gpu) and its pinned memory within what this
    machine can pin.
    """
    with refused():
        gpu_gib, option = checks.advise_options(gpu=gpu, budget=budget, depth=depth, tokens=tokens, base=base,
                                                lora=lora)
        host_gib = checks.host_size(host_memory)
    fam, preset = _family(family, preset)
    _check_depths(depths)
    if json_path is not None:
        json_path = output_path(json_path, "--json")
    _need_cuda("gradseam advise measures GPU memory and time on the family's real-size model and needs a "
               "CUDA GPU; none is available")
    _model_class(fam)
    if option == "--budget":  # once the command line is accepted: a refused one stays one error line
        warn("--budget is deprecated; use --gpu SIZE (the GPU memory available to the run).")
    out = console()
    workload, result, code = _measure_advice(out, fam, preset, gpu_gib, depths=depths, depth=depth, tokens=tokens,
                                             base=base, lora=lora, host_gib=host_gib)
    _print_advice(out, workload, result, gpu_gib, json_path)
    if result.chosen is None:
        raise typer.Exit(code)


def _measure_advice(out: Console, fam: Family, preset: str, gpu_gib: float, *, depths: str | None,
                    depth: int | None, tokens: int | None, base: str | None = None,
                    lora: int | None = None, host_gib: float | None = None) -> tuple[Workload, Advice, int]:
    """Build the model and walk the ladder; the advice and the exit code (1: nothing fits)."""
    import torch

    from .advise import advise as run_advise
    from .estimates import NoFitError
    from .workloads import build

    _quiet_diffusers()
    try:
        with out.status("building the model"):
            workload = build(fam, preset, depth="fit", depths=depths, device="cuda", base=base, lora=lora)
            inputs = workload.inputs(tokens)
            torch.cuda.synchronize()
            static = torch.cuda.memory_allocated() / (1 << 30) + workload.dropped_gib
        with out.status("measuring the ladder at two depths (one warm-up + one timed step per candidate and depth)") \
                as status:
            from .host import pinnable_gib

            def progress(line: str, done: bool) -> None:  # a line per candidate measured; the spinner names the next
                if done:
                    out.print(f"  {line}", markup=False, highlight=False)
                else:
                    status.update(line)

            result = run_advise(workload.model, inputs, gpu_gib, static_gib=static, depths=workload.fit_depths,
                                depth=depth, plan=workload.plan, progress=progress,
                                pinnable_gib=pinnable_gib(host_gib) if host_gib is not None else None)
        return workload, result, 0
    except NoFitError as exc:
        return workload, exc.advice, 1
    except (gradseam.GradseamError, ValueError) as exc:
        fail(str(exc))


def _print_advice(out: Console, workload: Workload, result: Advice, gpu_gib: float, json_path: Path | None) -> None:
    """Every candidate's figures, the JSON file, and the recommended config (or why nothing fits)."""
    out.print(f"{workload.family.name} {workload.preset_name}{workload.weights_note}: planned for {result.depth_note}",
              markup=False)
    pinnable = f", pinnable host memory {result.pinnable_gib:.1f} GiB" if result.pinnable_gib is not None else ""
    table = Table(title=f"strategies within {gpu_gib:.2f} GiB (static {result.static_gib:.2f} GiB at full depth{pinnable})")
    for column in ("", "candidate", "act. peak GiB", "GiB per unit", "pinned GiB", "step ms", "verdict"):
        table.add_column(column, justify="right" if "GiB" in column or "ms" in column else "left", overflow="fold")
    for t in result.trials:
        table.add_row(
            "->" if t is result.chosen else "", t.label,
            f"{t.peak_gib:.2f}" if t.peak_gib is not None else "-",
            f"{t.growth_gib:.3f}" if t.growth_gib is not None else "-",
            f"{t.pinned_gib:.1f}" if t.pinned_gib is not None else "-",
            f"{t.step_ms:.1f}" if t.step_ms is not None else "-",
            t.reason or t.status,  # the reason already says the status in words
        )
    out.print(table)
    if json_path is not None:
        json_path.write_text(json.dumps(result.to_dict(), indent=1))
        out.print(f"wrote {json_path}", markup=False)
    mix = result.per_block
    if result.chosen is None and mix is None:
        out.print(f"[red]{result.no_fit_message()}[/red]")
        return
    if mix is not None:  # a mix beats every uniform candidate that fits (or none fits): it is the recommendation
        if result.chosen is None:
            out.print("no uniform candidate fits both budgets; recommended: the per-block plan", markup=False)
        out.print(mix.report(keys=False), markup=False)
        out.print("recommended (the per-block plan: each entry of gradient_checkpointing_blocks runs its blocks "
                  "with its settings); paste into your trainer config:", markup=False)
        out.print_json(json.dumps(mix.config))
        return
    out.print(f"recommended ({result.chosen.label}); paste into your trainer config:", markup=False)
    out.print_json(result.to_json())
    if result.compile:
        out.print(f"and {result.compile}.", markup=False)
    if result.per_block_note:
        out.print(f"per-block plan: {result.per_block_note}", markup=False)


# -- run ------------------------------------------------------------------------------------------


@command(
    context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True},
    epilog="Examples: gradseam run --backend torch-ffn -- train.py --lr 1e-4 | "
           "accelerate launch -m gradseam run --backend torch -- train.py ... | "
           "torchrun --nproc-per-node 8 -m gradseam run --config gradseam.json -- train.py ...",
)
@with_key_options
def run(
    program: Annotated[list[str] | None, typer.Argument(
        metavar="PROGRAM", show_default=False,
        help="script.py [ARGS]... or -m module [ARGS]...: the training program and its arguments, as you "
             "would give them to python, after gradseam's options (a -- before it is allowed)")] = None,
    *,
    flags: dict[str, Any],  # one option per config key, made from the keys' specs (with_key_options)
    config: Annotated[Path | None, typer.Option(
        "--config", metavar="FILE", help="a JSON file of gradseam config keys; the options above override it")] = None,
    ignore_unknown: Annotated[bool, typer.Option(
        "--ignore-unknown", help="with --config: read the gradseam keys out of a whole trainer config, ignoring the others")] = False,
    report: Annotated[Path | None, typer.Option(
        "--report", metavar="FILE", help="write a JSON report at exit: each patched model and how often its "
        "regions ran ('{rank}' in the name, or .rankN added, under a multi-process launcher)")] = None,
) -> None:
    """Run a training script with every diffusers model it loads patched; exits with the script's exit code.

    Models a gradseam family handles are patched as the script loads them (from_pretrained,
    from_single_file); one line per patched model and a summary at exit go to stderr. The options
    are the config keys without the gradient_checkpointing_ prefix; they go before the script.
    """
    from . import launch

    try:  # every check of the command line before torch or diffusers is imported (but one, see prepare)
        cfg, program_ = launch.prepare(config, ignore_unknown=ignore_unknown, argv=list(program or []),
                                       flags=flags, known_flags=option_names())
    except launch.LaunchError as exc:
        fail(str(exc))
    rank, world = launch.rank_info()
    path = output_path(launch.report_path(report, rank, world), "--report") if report is not None else None
    try:
        code = launch.Launch(cfg, program_, path, rank, world).run()
    except launch.LaunchError as exc:
        fail(str(exc))
    raise typer.Exit(code)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
