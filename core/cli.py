"""The ``gradseam`` command: ``families``, ``demo``, ``bench`` and ``advise``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

import gradseam

app = typer.Typer(
    help="Gradient checkpointing and activation offload for diffusers transformers.",
    no_args_is_help=True,
    add_completion=False,
)
console = Console()


def _progress() -> Progress:
    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, transient=True,
    )


@app.command()
def families() -> None:
    """List installed families: who provides them, what they patch, and what they support."""
    table = Table(title="gradseam families")
    for column in ("family", "plugin (distribution)", "model classes", "block lists", "FFN cut",
                   "interval/stride", "attention offload"):
        table.add_column(column)
    for item in gradseam.installed():
        fam = item.family
        dist = f"{item.plugin} ({item.distribution} {item.version})" if item.distribution else item.plugin
        table.add_row(
            fam.name,
            dist,
            "\n".join(n.rsplit(".", 1)[-1] for n in fam.model_names),
            "\n".join(bl.path + (" (optional)" if bl.optional else "") for bl in fam.block_lists),
            "yes" if fam.has_ffn else "no",
            "yes" if fam.supports_interval else "no",
            "yes" if fam.has_attention else "no",
        )
    console.print(table)


@app.command()
def demo(
    tokens: Annotated[int | None, typer.Option(help="image tokens, a square number (default 4096 on GPU, 256 on CPU)")] = None,
    steps: Annotated[int, typer.Option(help="timed steps per strategy")] = 3,
    device: Annotated[str | None, typer.Option(help="cpu or cuda (default: cuda if available)")] = None,
) -> None:
    """Patch a small built-in Flux with every strategy this machine supports and compare them."""
    from .demo import run

    with _progress() as progress:
        task = progress.add_task("strategies", total=None)

        def track(it, total):
            progress.update(task, total=total)
            for item in it:
                progress.update(task, description=f"running {item[0]}")
                yield item
                progress.advance(task)

        rows = run(device=device, image_tokens=tokens, steps=steps, progress=track)
    none = rows[0]
    table = Table(title=f"small Flux ({rows[0].device}, {rows[0].tokens} image tokens): kept activations and step time")
    for column in ("strategy", "kept MiB", "vs none", "step ms", "vs none", "max |grad - unpatched|"):
        table.add_column(column, justify="right" if column != "strategy" else "left")
    for r in rows:
        table.add_row(
            r.strategy, f"{r.kept_mib:.1f}", f"{r.kept_mib / none.kept_mib:.2f}", f"{r.step_ms:.1f}",
            f"{r.step_ms / none.step_ms:.2f}", f"{r.max_grad_diff:.1e}",
        )
    console.print(table)
    console.print(
        "Practical rule: no checkpointing if it fits -> torch-ffn -> torch -> unsloth-ffn -> unsloth; "
        "interval >= 2 only to win speed back once it fits."
    )


def _need_cuda(what: str) -> None:
    import torch

    if not torch.cuda.is_available():
        console.print(f"[red]gradseam {what} measures GPU memory and time and needs a CUDA GPU; none is available.[/red]")
        raise typer.Exit(2)


def _quiet_diffusers() -> None:
    # building random-weight models logs a bf16-cast notice per model; it is noise here
    from diffusers.utils import logging as dlogging

    dlogging.set_verbosity_error()


@app.command()
def bench(
    family: Annotated[str | None, typer.Option(help="benchmark this family's real-size preset model (random weights; needs CUDA)")] = None,
    preset: Annotated[str | None, typer.Option(help="the family's preset (default: its first)")] = None,
    layers: Annotated[int | None, typer.Option(min=1, help="keep only the first K blocks of every block list")] = None,
    tokens: Annotated[list[int] | None, typer.Option(min=1, help="tokens per workload (repeat for several; default: the preset's, or the synthetic shapes)")] = None,
    synthetic: Annotated[bool, typer.Option("--synthetic", help="the synthetic block stack (the default without --family)")] = False,
    blocks: Annotated[int | None, typer.Option(min=1, help="synthetic stack: number of blocks (default 8 on GPU, 2 on CPU)")] = None,
    dim: Annotated[int | None, typer.Option(min=1, help="synthetic stack: model width (default 3072 on GPU, 256 on CPU)")] = None,
    device: Annotated[str | None, typer.Option(help="synthetic stack: cpu or cuda (default: cuda if available)")] = None,
    json_path: Annotated[Path, typer.Option("--json", help="where to write the results")] = Path("gradseam-bench.json"),
    png_path: Annotated[Path | None, typer.Option("--png", help="chart path (default: the JSON path with .png)")] = None,
    steps: Annotated[int | None, typer.Option(min=1, help="timed steps per strategy, median reported (default 5 on GPU, 2 on CPU)")] = None,
) -> None:
    """Benchmark every strategy: memory and step time, side by side with the hand-written references.

    Without --family: the synthetic block stack; on a CUDA GPU in bf16 at four sizes (activation
    peak), elsewhere on the CPU in float32 at 2 blocks x 256 tokens x 256 wide (the memory column
    is then the bytes autograd keeps between forward and backward; offload rows need CUDA).
    --blocks, --tokens and --dim pick one synthetic size. With --family NAME [--preset P]: the
    family's real-size model with random bf16 weights built on the GPU (needs CUDA).
    """
    import torch

    if synthetic and family:
        console.print("[red]--synthetic and --family exclude each other.[/red]")
        raise typer.Exit(2)
    if family is None and (preset or layers):
        console.print("[red]--preset and --layers need --family.[/red]")
        raise typer.Exit(2)
    if family is not None and (blocks or dim or device):
        console.print("[red]--blocks, --dim and --device are for the synthetic stack; they exclude --family.[/red]")
        raise typer.Exit(2)
    if device not in (None, "cpu", "cuda"):
        console.print(f"[red]--device: expected cpu or cuda, got {device!r}.[/red]")
        raise typer.Exit(2)
    if family is not None and not torch.cuda.is_available():
        console.print(
            "[red]gradseam bench --family builds the family's real-size model (billions of parameters) "
            "and measures GPU memory and time, so it needs a CUDA GPU; none is available. Without "
            "--family, `gradseam bench` runs the small synthetic stack on the CPU.[/red]"
        )
        raise typer.Exit(2)
    if device == "cuda":
        _need_cuda("bench --device cuda")
    from . import bench as b

    dev = "cuda" if family is not None else (device or b.default_device())
    cpu = dev == "cpu"
    if steps is None:
        steps = b.CPU_STEPS if cpu else 5
    shapes = None
    if family is not None:
        from .workloads import find_family, find_preset

        try:
            fam = find_family(family)
            preset, _ = find_preset(fam, preset)
        except gradseam.GradseamError as exc:
            console.print(f"[red]{exc}[/red]")
            raise typer.Exit(2) from None
        _quiet_diffusers()
        total = len(tokens or [None]) * len(b.real_rows())
        title = f"gradseam bench: {family} {preset}" + (f", first {layers} blocks of each list" if layers else "")
    else:
        if blocks or dim or tokens:
            default_blocks, default_tokens, default_dim = (b.CPU_SHAPES if cpu else b.SYNTHETIC_SHAPES)[0]
            shapes = [(blocks or default_blocks, t, dim or default_dim) for t in (tokens or [default_tokens])]
        total = len(shapes or (b.CPU_SHAPES if cpu else b.SYNTHETIC_SHAPES)) * len(b.synthetic_rows())
        title = b.synthetic_title(dev)
    with _progress() as progress:
        task = progress.add_task("building" if family else "bench", total=total)

        def on_row(result):
            progress.advance(task)
            progress.update(task, description=f"{result.workload}: {result.strategy}")
            if result.status not in ("ok", b.NEEDS_CUDA):
                progress.console.print(f"{result.strategy}: {result.status}")

        if family is not None:
            try:
                results = b.real(family, preset, layers=layers, tokens=list(tokens) if tokens else None,
                                 steps=steps, on_row=on_row)
            except gradseam.GradseamError as exc:
                console.print(f"[red]{exc}[/red]")
                raise typer.Exit(2) from None
        else:
            results = b.synthetic(shapes, steps=steps, on_row=on_row, device=dev)
    rows = b.with_ratios(results)
    payload = b.payload(rows, title, device=dev, family=family, preset=preset, layers=layers, steps=steps)
    json_path.write_text(json.dumps(payload, indent=1))
    console.print(title)
    console.print(b.to_markdown(rows, cpu=cpu))
    if cpu:
        console.print(f"memory: {b.MEMORY_CPU}; rows marked '{b.NEEDS_CUDA}' copy to pinned memory and need a GPU.")
    console.print(f"wrote {json_path}")
    png_path = png_path or json_path.with_suffix(".png")
    if b.chart(rows, png_path, title, cpu=cpu):
        console.print(f"wrote {png_path}")
    else:
        console.print("matplotlib is not installed, so no chart was written (pip install 'gradseam[bench]').")


@app.command()
def advise(
    family: Annotated[str, typer.Option(help="the family whose real-size preset model is measured")],
    budget: Annotated[str, typer.Option(help="GPU memory budget: '40GiB', '40 GB', '40960MiB' or GiB as a number")],
    preset: Annotated[str | None, typer.Option(help="the family's preset (default: its first)")] = None,
    layers: Annotated[int | None, typer.Option(min=1, help="keep only the first K blocks of every block list")] = None,
    tokens: Annotated[int | None, typer.Option(help="image/video tokens (default: the preset's)")] = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="also write every measurement here")] = None,
) -> None:
    """Measure the strategy ladder on a preset model and recommend the fastest config that fits the budget."""
    from .advise import NoFitError, parse_budget

    try:
        budget_gib = parse_budget(budget)
    except ValueError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    _need_cuda("advise")
    from .advise import advise as run_advise
    from .workloads import build

    _quiet_diffusers()
    try:
        with console.status("building the model"):
            workload = build(family, preset, layers=layers, device="cuda")
            inputs = workload.inputs(tokens)
        with console.status("measuring the ladder (one warm-up + one timed step per candidate)"):
            result = run_advise(workload.model, inputs, budget_gib)
        code = 0
    except NoFitError as exc:
        result, code = exc.advice, 1
    except gradseam.GradseamError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    console.print(f"{workload.family.name} {workload.preset_name} ({workload.layers_note})")
    table = Table(title=f"strategies within {budget_gib:.2f} GiB (static {result.static_gib:.2f} GiB)")
    for column in ("", "candidate", "act. peak GiB", "step ms", "verdict"):
        table.add_column(column, justify="right" if "GiB" in column or "ms" in column else "left")
    for t in result.trials:
        table.add_row(
            "->" if t is result.chosen else "", t.label,
            f"{t.peak_gib:.2f}" if t.peak_gib is not None else "-",
            f"{t.step_ms:.1f}" if t.step_ms is not None else "-",
            t.reason or t.status,  # the reason already says the status in words
        )
    console.print(table)
    if json_path is not None:
        json_path.write_text(json.dumps(result.to_dict(), indent=1))
        console.print(f"wrote {json_path}")
    if result.chosen is None:
        console.print(f"[red]{result.no_fit_message()}[/red]")
        raise typer.Exit(code)
    console.print(f"recommended ({result.chosen.label}); paste into your trainer config:")
    console.print_json(result.to_json())


def main() -> None:
    app()


if __name__ == "__main__":
    main()
