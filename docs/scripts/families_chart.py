"""One picture of every family's full-depth rows: activation peak and step time, side by side.

``python docs/scripts/families_chart.py [--out docs/img/families-full-depth.png] [--table] FAMILY ...`` reads
``docs/data/bench-FAMILY-full.json`` (a ``gradseam bench --family FAMILY --depths 2,4 --full`` run)
where there is one, else ``docs/data/bench-FAMILY.json`` (the same without ``--full``: every
full-depth figure predicted), with a family's weight-streaming row from ``docs/data/bench-FAMILY-stream.json``
where it was measured, and draws, per family, the full-depth activation peak of each row on a log scale (left) and its step
time relative to no checkpointing (right). Hollow markers are predicted from the two fit depths,
filled ones measured at full depth; a row that failed (OOM, compiler error) is drawn as a cross at
the left edge with its status, so a gap never reads as "no cost". A table answers "how much"; this
answers "which row, for my family" at a glance, which is why the families section leads with it.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parents[1] / "data"
# bench's JSON names the GPU that measured it since the twenty-second session; every family run before that was
# on the H200 (docs/benchmarks.md says so for each)
BEFORE_RECORDED = "H200"
# issue 42's weight-streaming row: every block's frozen weights in pinned host memory, copied in ahead of its compute.
# Measured apart (bench-FAMILY-stream.json): "stream all" streams every block at every depth, so its line through the
# two fit depths predicts the full one, as no count of blocks streamed would
STREAMED = "unsloth-compile + stream all"
# how the benchmarks page writes each row's name
LABELS = {"none": "none", "torch": "`torch`", "unsloth + attention offload": "`unsloth` + attention offload",
          "unsloth-compile": "`unsloth-compile`", STREAMED: "`unsloth-compile` + every block's weights streamed"}
ROWS = ("none", "torch", "unsloth + attention offload", "unsloth-compile", STREAMED)
COLOURS = {"none": "#7f7f7f", "torch": "#1f77b4", "unsloth + attention offload": "#2ca02c",
           "unsloth-compile": "#d62728", STREAMED: "#9467bd"}


def _run(family: str) -> dict[str, Any]:
    # a run that measured the full depth supersedes one that only predicted it
    full = DATA / f"bench-{family}-full.json"
    return json.loads((full if full.exists() else DATA / f"bench-{family}.json").read_text())


def card(family: str) -> str:
    """The GPU that measured ``family``'s run, as its JSON names it."""
    gpu = _run(family).get("gpu") or BEFORE_RECORDED
    return gpu.removeprefix("NVIDIA ")


def load(family: str) -> tuple[str, list[dict[str, Any]]]:
    # a later run of the compiled rows (bench-FAMILY-compiled.json) fills in a row the main run could not give
    # (HunyuanVideo's OOM); the weight-streaming run (bench-FAMILY-stream.json) adds its row
    run = _run(family)
    rows = [r for r in run["full_depth"] if r["strategy"] in ROWS]
    none = next((r for r in rows if r["strategy"] == "none" and r.get("step_ms")), None)

    def against_none(row: dict[str, Any]) -> dict[str, Any]:
        if row.get("vs_none") is None and none is not None and row.get("step_ms"):
            return {**row, "vs_none": round(row["step_ms"] / none["step_ms"], 3)}  # against the main run's
        return row

    later = DATA / f"bench-{family}-compiled.json"
    if later.exists():
        for row in json.loads(later.read_text()).get("full_depth") or []:
            mine = next((r for r in rows if r["strategy"] == row["strategy"]), None)
            if mine is not None and mine.get("status") != "ok" and row.get("status") == "ok":
                rows[rows.index(mine)] = against_none(row)
    streamed = DATA / f"bench-{family}-stream.json"
    if streamed.exists():
        stream_run = json.loads(streamed.read_text())
        deepest = max((r for r in stream_run["rows"] if r["strategy"] == STREAMED and r.get("peak_gib") is not None),
                      key=lambda r: r["depth"], default=None)  # what the chart's bar of an upper bound starts from
        rows += [{**against_none(r), "deepest_peak_gib": deepest and deepest["peak_gib"]}
                 for r in stream_run.get("full_depth") or [] if r["strategy"] == STREAMED]
    return f"{family}\n{run['preset']}, {run['depth']['blocks']}", rows


def draw(families: list[str], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [load(f) for f in families]
    height = 0.55 * len(runs) * len(ROWS) / 2 + 1.5  # inches
    fig, (peak_ax, step_ax) = plt.subplots(1, 2, figsize=(12, height), sharey=True)
    # the left edge: a power of ten below every measured peak (0.1 GiB unless a row holds less: the audio DiTs' do),
    # where failed rows are drawn
    peaks = [r["peak_gib"] for _, rows in runs for r in rows if r.get("status") == "ok" and r.get("peak_gib")]
    edge = 10.0 ** math.floor(math.log10(min([0.1, *peaks])))
    ticks, names = [], []
    for i, (label, rows) in enumerate(runs):
        base = i * (len(ROWS) + 1)
        ticks.append(base + (len(ROWS) - 1) / 2)
        names.append(label)
        for j, name in enumerate(ROWS):
            row = next((r for r in rows if r["strategy"] == name), None)
            if row is None:
                continue
            y = base + j
            if row.get("status") != "ok":
                peak_ax.plot([edge], [y], "x", color=COLOURS[name])
                status = str(row.get("status"))  # "OOM", or "error: Kind: message": the kind is enough
                peak_ax.annotate(status.split(":")[1].strip() if ":" in status else status, (edge, y), xytext=(6, -3), textcoords="offset points",
                                 fontsize=7, color=COLOURS[name])
                continue
            predicted = row.get("peak_source") == "predicted"
            style = {"color": COLOURS[name], "markerfacecolor": "none" if predicted else COLOURS[name]}
            peak_ax.plot([row["peak_gib"]], [y], "o", **style)
            if upper_bound(row) and row.get("deepest_peak_gib"):
                peak_ax.plot([row["deepest_peak_gib"], row["peak_gib"]], [y, y], "-", color=COLOURS[name], lw=1.5)
            if row.get("vs_none") is not None:  # none: no step figure (bench_report's step_not_predicted, or no none)
                step_ax.plot([row["vs_none"]], [y], "o", **style)
    peak_ax.set_xscale("log")
    peak_ax.set_xlim(left=edge)
    peak_ax.set_xlabel("activation peak at full depth, GiB (log)")
    step_ax.axvline(1.0, color="#7f7f7f", lw=0.8, ls="--")
    step_ax.set_xlabel("step time / no checkpointing")
    peak_ax.set_yticks(ticks, names, fontsize=8)
    # top to bottom, one row of space at each end: matplotlib's own 5% margin was two families' height of blank
    # space above the first on the tall charts
    peak_ax.set_ylim(len(runs) * (len(ROWS) + 1) - 1, -1)
    for ax in (peak_ax, step_ax):
        ax.grid(axis="x", alpha=0.3)
    drawn = {r["strategy"] for _, rows in runs for r in rows}  # a row no family has gets no legend entry
    handles = [plt.Line2D([], [], marker="o", ls="", color=c, label=n) for n, c in COLOURS.items() if n in drawn]
    handles.append(plt.Line2D([], [], marker="o", ls="", color="k", markerfacecolor="none",
                              label="hollow: predicted from the two fit depths"))
    if any(upper_bound(r) for _, rows in runs for r in rows if r.get("status") == "ok"):
        handles.append(plt.Line2D([], [], marker="o", ls="-", color="k", markerfacecolor="none",
                                  label="bar: streamed, from the deepest measured peak to the forward line's (an upper bound)"))
    cards = ", ".join(dict.fromkeys(card(f) for f in families))
    # the title and the legend take a fixed 1.1 inches at the top, not a share of the height: a share left a blank
    # band of several inches above the tall charts (44 families)
    fig.suptitle(f"gradseam bench, {cards}, bf16 frozen weights: every row at the family's full depth", fontsize=10,
                 y=1 - 0.12 / height)
    fig.legend(handles=handles, loc="upper center", ncol=3, fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, 1 - 0.35 / height))
    fig.tight_layout(rect=(0, 0, 1, 1 - 1.1 / height))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def upper_bound(row: dict[str, Any]) -> bool:
    """Whether ``row``'s full-depth peak is a weight-streaming row's, predicted from its forward pass's line: where
    that row was measured at the full depth (Flux dev 4k, Wan 2.1 14B), the forward's growth between the first depths
    stopped after them, and the line over-predicted (7.86 GiB predicted for Flux, 2.03 measured). The table marks it
    (†) and the chart draws it as a bar from the deepest measured peak to the prediction."""
    return row["strategy"] == STREAMED and row.get("peak_source") == "predicted" and row.get("peak_fit") == "forward"


def table(families: list[str]) -> str:
    """The benchmarks page's table of the same rows: ``~`` marks a figure predicted from the two fit depths, a plain
    one was measured at the full depth; a row that failed shows its status."""
    lines = ["| family (preset) | full depth | row | act. peak GiB | GiB per unit | pinned host GiB | step ms | vs none |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for family in families:
        run = _run(family)
        _, rows = load(family)
        tokens = next((r["tokens"] for r in run["rows"] if r.get("tokens")), None)
        first = f"{family} ({run['preset']}{f', {tokens:,} tokens' if tokens else ''}) | {run['depth']['blocks']}"
        for name in ROWS:
            row = next((r for r in rows if r["strategy"] == name), None)
            if row is None:
                continue
            head = f"| {first} | {LABELS[name]} |" if first else f"| | | {LABELS[name]} |"
            first = ""
            if row.get("status") != "ok" or row.get("peak_gib") is None:
                # its first line: a compiler's message goes on with the graph node and a traceback (Sana-WM's inductor
                # error), which would break the table and read as a link to mkdocs
                lines.append(f"{head} {(str(row.get('status')).strip().splitlines() or [''])[0]} | | | | |")
                continue

            def figure(value: float | None, source: str | None, fmt: str) -> str:
                return "" if value is None else ("~" if source == "predicted" else "") + format(value, fmt)

            growth = row.get("growth_gib_per_unit")
            vs_none = row.get("vs_none")
            peak = figure(row["peak_gib"], row.get("peak_source"), ".2f") + (" †" if upper_bound(row) else "")
            lines.append(f"{head} {peak} | "
                         f"{'' if growth is None else format(growth, '.3f')} | "
                         f"{figure(row.get('pinned_gib'), row.get('pinned_source'), '.1f')} | "
                         f"{figure(row.get('step_ms'), row.get('step_source'), ',.0f')} | "
                         f"{'' if vs_none is None else format(vs_none, '.2f')} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="+", help="names whose docs/data/bench-NAME[-full].json to draw")
    parser.add_argument("--out", type=Path, default=DATA.parent / "img" / "families-full-depth.png")
    parser.add_argument("--table", action="store_true", help="print the benchmarks page's table of the same rows too")
    args = parser.parse_args()
    draw(args.families, args.out)
    print(f"wrote {args.out}")
    if args.table:
        print(table(args.families))


if __name__ == "__main__":
    main()
