"""The ``gradseam`` command: ``families``, ``demo`` and ``bench`` (only calls the public API)."""

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


@app.command()
def bench(
    json_path: Annotated[Path, typer.Option("--json", help="where to write the results")] = Path(
        "gradseam-bench.json"
    ),
    steps: Annotated[int, typer.Option(help="timed steps per strategy (median reported)")] = 5,
) -> None:
    """Benchmark every strategy on the synthetic block stack (needs a CUDA GPU)."""
    import torch

    if not torch.cuda.is_available():
        console.print("[red]gradseam bench measures GPU memory and time and needs a CUDA GPU.[/red]")
        raise typer.Exit(2)
    from .bench import GRADSEAM_ROWS, REFERENCE_ROWS, SYNTHETIC_SHAPES, synthetic, to_markdown, with_ratios

    total = len(SYNTHETIC_SHAPES) * (len(REFERENCE_ROWS) + len(GRADSEAM_ROWS))
    with _progress() as progress:
        task = progress.add_task("bench", total=total)

        def on_row(result):
            progress.advance(task)
            progress.update(task, description=f"{result.workload}: {result.strategy}")

        results = synthetic(steps=steps, on_row=on_row)
    rows = with_ratios(results)
    json_path.write_text(json.dumps(rows, indent=1))
    console.print(to_markdown(rows))
    console.print(f"wrote {json_path}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
