"""How bench's results are shown: the full-depth table first, then every measured row; JSON and chart.

The JSON written by ``gradseam bench`` (see :func:`payload`)::

    {
      "title": str,            # also the table/chart title; says "CPU" on the CPU
      "device": "cuda" | "cpu",
      "gpu": str | null,       # the GPU's name as torch reads it ("NVIDIA H200"), null on the CPU: which card measured
      "torch": str | null,     # torch's version
      "memory": str,           # what peak_gib measures (MEMORY_GPU or MEMORY_CPU)
      "family": str | null, "preset": str | null, "steps": int,
      "base": str | null,      # real models: the quantized base (gradseam.tools.bases), null for bf16 weights
      "lora": int | null,      # real models: the rank of the LoRA trained, null for frozen weights
      "weights_gib": float | null,  # real models: the full model's weights as stored
      "gpu_memory_gib": float | null,  # bench --gpu-memory: the GPU memory every row's steps ran on
      "host_memory_gib": float | null,  # bench --host-memory: the pinned host memory the auto rows plan within
      "depth": null | {        # real models only
        "full": int,           # the depth the full_depth rows speak for (units, see gradseam.tools.depth)
        "blocks": str,         # what that depth is in blocks, e.g. "19 + 38 blocks"
        "fit": [int, int],     # the two depths every row was measured at
        "unit": str,           # what one unit of depth is
        "exact": bool,         # every depth keeps each list in its real proportion
        "measured_full": bool, # the full depth was measured too (--full)
        "unseen_lists": [str], # block lists the fit depths keep the same blocks of (DepthPlan.unseen)
        "warning": str | null  # what that means for the predictions, and the depths that avoid it
      },
      "full_depth": [          # real models only: one per (workload, strategy), the figures to read first
        {"workload": str, "strategy": str, "status": str,   # "ok" or why there is no figure
         "peak_gib": float | null, "peak_source": "measured" | "predicted" | null,
         "predicted_peak_gib": float | null, "prediction_error": float | null,  # measured / predicted - 1
         "peak_fit": "step" | "forward" | "backward" | null,  # whose fit predicts the peak (depth.predict_peak)
         "growth_gib_per_unit": float | null, "fixed_gib": float | null,  # of that fit
         "pinned_gib": float | null, "pinned_source": str | null,
         "step_ms": float | null, "step_source": str | null, "vs_none": float | null,
         "step_not_predicted": str,  # only where the step did not grow between the fit depths: its two times
         "gpu_peak_gib": float | null}  # the whole GPU's peak where the full depth was measured, else null
      ],
      "rows": [                # every measurement, one per (workload, depth, strategy), in sweep order
        {"workload": str, "tokens": int, "strategy": str, "depth": int | null, "blocks": str | null,
         "peak_gib": float | null, "step_ms": float | null, "pinned_gib": float | null,
         "status": str,        # "ok", "OOM", "needs CUDA", "not measured on the CPU (...)", "ruled out: ...",
                               # "unsupported: ...", "error: ..."
         "pinned_allocations_after_warmup": int | null,
         "forward_peak_gib": float | null, "backward_peak_gib": float | null,  # GPU: each pass's own peak
         "forward_ms": float | null, "backward_ms": float | null,  # GPU: each pass's own time (medians, CUDA events)
         "first_step_ms": float | null,  # compiled rows: the first warm-up step, where they compile; auto: the step that plans
         "gpu_peak_gib": float | null,  # GPU rows: the whole GPU's peak, weights included (streamed rows: loads)
         "pinned_weights_gib": float | null,  # rows that stream weights: their pinned host copies, also in pinned_gib
         "alloc_retries": int | null,  # GPU rows: the allocator's retries over the timed steps (each synchronizes)
         "failure": str | null,  # OOM rows: GPU or pinned host, forward or backward, the allocator's words
         "plan": {"source": str, "config": {...}, "report": str,  # auto rows (failed ones too): the plan, its keys, what
                  "predicted": {"gpu_gib": float, "host_gib": float, "step_ms": float} | null,  # it predicted, and
                  "checked": {"gpu_gib": ..., "host_gib": ..., "step_ms": ...} | null} | null,  # ran before its step
         "config": {...},  # --config-row rows only (no such key in the others): the gradseam keys it ran, as given
         "vs_none": float | null, "vs_torch": float | null,  # step-time ratios at the same workload and depth
         "step_times_ms": [float] | null}  # every timed step (step_ms is their median); null: not measured
      ]
    }
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from .bench_rows import CAP_SUFFIX, CPU_STATUS_WHY, STREAM_SUFFIX, streamed_count, streams_weights
from .depth import predict, predict_peak
from .measure import GiB, MiB, noise_marks, noise_note, spread

if TYPE_CHECKING:
    from .results import RealRun, Result

MEMORY_GPU = "activation peak: max_memory_allocated over the timed steps minus what was allocated before"
MEMORY_CPU = "bytes autograd keeps between forward and backward (saved tensors, parameters excluded)"


def with_ratios(
    results: list[Result], step_times: Sequence[Sequence[float] | None] | None = None,
) -> list[dict[str, Any]]:
    """Rows as dicts with ``vs_none`` and ``vs_torch`` step-time ratios at the same workload and depth,
    and ``step_times_ms``, each row's timed steps (``step_times``, parallel to ``results``; the
    records themselves keep only the median)."""
    times = list(step_times) if step_times is not None else [None] * len(results)
    out = []
    for r, steps in zip(results, times):
        same = [o for o in results if o.workload == r.workload and o.depth == r.depth]
        none = next((o.step_ms for o in same if o.strategy == "none"), None)
        torch_ms = next((o.step_ms for o in same if o.strategy == "torch"), None)
        row = asdict(r)
        if row["config"] is None:  # only a --config-row row has one
            del row["config"]
        row["vs_none"] = round(r.step_ms / none, 3) if r.step_ms and none else None
        row["vs_torch"] = round(r.step_ms / torch_ms, 3) if r.step_ms and torch_ms else None
        row["step_times_ms"] = [round(t, 3) for t in steps] if steps and r.status == "ok" else None
        out.append(row)
    return out


def noise(rows: list[dict[str, Any]]) -> list[str | None]:
    """Per row, why its step time is within noise against no checkpointing at the same workload and
    depth (:func:`gradseam.tools.measure.noise`), or None; rows without timed steps are never marked.

    For the CPU table, where every row but ``none`` recomputes (the rows that would not, the
    compiler's, need CUDA); a GPU table also holds compiled rows, which can beat eager ``none``.
    """
    marks: list[str | None] = [None] * len(rows)
    groups: dict[tuple[Any, Any], list[int]] = {}
    for i, r in enumerate(rows):
        if r.get("step_times_ms"):
            groups.setdefault((r["workload"], r.get("depth")), []).append(i)
    for members in groups.values():
        ref = next((i for i in members if rows[i]["strategy"] == "none"), None)
        if ref is None:
            continue
        order = [ref, *(i for i in members if i != ref)]
        for i, mark in zip(order, noise_marks([rows[i]["step_times_ms"] for i in order])):
            marks[i] = mark
    return marks


def cpu_noise_note(rows: list[dict[str, Any]]) -> str | None:
    """The sentence under a CPU table whose rows :func:`noise` marked; None when none is."""
    return noise_note(noise(rows), exact="the memory column (bytes kept for backward)")


def cpu_status_note(rows: list[dict[str, Any]]) -> str | None:
    """One line per kind of row a CPU table left out ("needs CUDA", "not measured on the CPU (...)"),
    saying why; None when it left none out."""
    shown = {r["status"] for r in rows}
    lines = [f"'{status}': {why}." for status, why in CPU_STATUS_WHY.items() if status in shown]
    return "\n".join(lines) or None


def full_depth_rows(run: RealRun) -> list[dict[str, Any]]:
    """Per (workload, strategy): the figures at ``run.full_depth``, measured where they were, else predicted."""
    target, fit_depths = run.full_depth, run.fit_depths
    out = []
    for workload, strategy in dict.fromkeys((r.workload, r.strategy) for r in run.results):
        mine = [r for r in run.results if r.workload == workload and r.strategy == strategy]
        at_full = next((r for r in mine if r.depth == target and r.depth not in fit_depths), None)
        if at_full is None and target in fit_depths:
            at_full = next((r for r in mine if r.depth == target), None)
        row: dict[str, Any] = {"workload": workload, "strategy": strategy, "status": "ok"}
        for key, out_key in (("peak_gib", "peak"), ("pinned_gib", "pinned"), ("step_ms", "step")):
            if key == "peak_gib":
                peak_guess = predict_peak(run.results, workload, strategy, fit_depths, target)
                guess = peak_guess[:2] if peak_guess is not None else None
                row["peak_fit"] = peak_guess[2] if peak_guess is not None else None
            else:
                guess = predict(run.results, workload, strategy, fit_depths, target, key)
            measured = getattr(at_full, key) if at_full is not None and at_full.status == "ok" else None
            falls = key == "step_ms" and guess is not None and guess[1].growth <= 0
            if falls and measured is None:
                # the deeper model ran no slower: a line through the two would say the full model is faster still
                (d1, d2), (v1, v2) = guess[1].depths, guess[1].values
                row["step_not_predicted"] = f"{v1:.1f} ms at depth {d1}, {v2:.1f} ms at depth {d2}"
                guess = None
            value, source = (measured, "measured") if measured is not None else (
                (guess[0], "predicted") if guess is not None else (None, None))
            if key == "pinned_gib" and value is not None:
                value = max(value, 0.0)
            row[f"{out_key}_gib" if out_key != "step" else "step_ms"] = (
                round(value, 1 if key == "step_ms" else 9) if value is not None else None)
            row[f"{out_key}_source"] = source
            if key == "peak_gib":
                row["predicted_peak_gib"] = round(guess[0], 9) if guess is not None else None
                row["prediction_error"] = (round(measured / guess[0] - 1, 4)
                                           if measured is not None and guess is not None and guess[0] > 0 else None)
                row["growth_gib_per_unit"] = round(guess[1].growth, 9) if guess is not None else None
                row["fixed_gib"] = round(guess[1].fixed, 9) if guess is not None else None
        row["gpu_peak_gib"] = at_full.gpu_peak_gib if at_full is not None and at_full.status == "ok" else None
        if row["peak_gib"] is None:
            failed = at_full if at_full is not None and at_full.status != "ok" else next(
                (r for r in mine if r.status != "ok"), None)
            row["status"] = failed.status if failed is not None else "not measured"
        if at_full is None and all(r.status == "ok" for r in mine):  # measured, so its config was valid
            counted = _streams_a_count(strategy, mine) or _selects_fixed_blocks(mine)
            if counted is not None:
                row = _count_not_predicted(row, counted, run)
        out.append(row)
    return full_depth_ratios(out)


def _streams_a_count(strategy: str, mine: Sequence[Result]) -> str | None:
    """What streams a count of blocks in this row, said for its status: its label's ``+ stream N``, or a
    ``--config-row``'s keys (at the top level or in a per-block entry); None where nothing does."""
    from ..config import STREAM_KEY
    from .cost_cache import streams_a_count

    count = streamed_count(strategy)
    if count is not None:
        return f"'stream {count}' streams {count} blocks"
    config = next((r.config for r in mine if r.config), None)
    if config is not None and streams_a_count(config):
        return f"its config streams a count of blocks ({STREAM_KEY}: a number)"
    return None


def _selects_fixed_blocks(mine: Sequence[Result]) -> str | None:
    """What makes a ``--config-row``'s per-block entries the same blocks at every depth, said for its status: an entry
    selecting a range of a list (``"blocks[0:5]"``) takes those blocks at every depth, a larger share of a cut model's
    (all five of Wan 2.1 14B's at depth 5, an eighth of them at 40: the thirty-sixth session's 12 GiB mix); an entry
    naming a whole list (``"blocks"``, ``"blocks[:]"``, ``"blocks[0:]"``) takes the same share at every depth. None
    where every entry names a whole list."""
    from ..config import BLOCKS_KEY, SELECTOR, selector_parts

    config = next((r.config for r in mine if r.config), None)
    entries = (config.get(BLOCKS_KEY) or ()) if config is not None else ()
    if all(selector_parts(dict(entry)[SELECTOR])[1:] == (0, None) for entry in entries):
        return None
    return f"its config's per-block entries ({BLOCKS_KEY}) select the same blocks"


def _count_not_predicted(row: dict[str, Any], what: str, run: RealRun) -> dict[str, Any]:
    """``row`` (a row streaming a count of blocks, or whose per-block entries select ranges: :func:`_selects_fixed_blocks`,
    not measured at the full depth) with every figure left out. Its N
    blocks are N at every depth (all of a cut model's where it has fewer), so the line through the fit depths is not
    the full model's with N streamed: at Flux dev's depths 1 and 2 (3 and 6 blocks) ``stream 30`` streams every
    block, and a prediction from them would be ``stream all``'s."""
    depths = " and ".join(f"{d} ({run.plan.describe(d)})" for d in run.fit_depths)
    status = (f"not predicted: {what} at every depth, all of a cut model's where it has fewer, so its figures at "
              f"depths {depths} do not scale to the full depth; measure it there (--full --full-row "
              f"'{row['strategy']}')")
    return {**dict.fromkeys(row), "workload": row["workload"], "strategy": row["strategy"], "status": status}


def full_depth_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` (full-depth rows) with each ``vs_none`` taken against the ``none`` row of the same workload among
    them: one sweep's, or the rows of ``--isolate-rows``' processes read back together."""
    out = []
    for row in rows:
        none = next((o for o in rows if o["workload"] == row["workload"] and o["strategy"] == "none"), None)
        none_ms = none["step_ms"] if none is not None else None
        out.append({**row, "vs_none": round(row["step_ms"] / none_ms, 3) if row["step_ms"] and none_ms else None})
    return out


def depth_info(run: RealRun, measured_full: bool) -> dict[str, Any]:
    return {"full": run.full_depth, "blocks": run.plan.describe(min(run.full_depth, run.plan.full)),
            "fit": list(run.fit_depths), "unit": run.plan.unit_note(), "exact": run.plan.exact,
            "measured_full": measured_full, "unseen_lists": run.plan.unseen(run.fit_depths),
            "warning": run.plan.unseen_note(run.fit_depths)}


# what a JSON's title ends with while its sweep is still writing it: an interrupted or timed-out sweep keeps its rows
PARTIAL = " (partial: interrupted runs keep this)"


def payload(
    rows: list[dict[str, Any]], title: str, *, device: str = "cuda", family: str | None = None,
    preset: str | None = None, steps: int = 5, depth: dict[str, Any] | None = None,
    full_depth: list[dict[str, Any]] | None = None, base: str | None = None, lora: int | None = None,
    weights_gib: float | None = None, gpu_memory_gib: float | None = None, host_memory_gib: float | None = None,
    gpu: str | None = None, torch_version: str | None = None,
) -> dict[str, Any]:
    """The JSON document ``gradseam bench`` writes (schema in this module's docstring)."""
    return {
        "title": title, "device": device, "gpu": gpu, "torch": torch_version,
        "memory": MEMORY_CPU if device == "cpu" else MEMORY_GPU,
        "family": family, "preset": preset, "steps": steps, "base": base, "lora": lora, "weights_gib": weights_gib,
        "gpu_memory_gib": gpu_memory_gib, "host_memory_gib": host_memory_gib,
        "depth": depth, "full_depth": full_depth, "rows": rows,
    }


def _figure(value: float | None, source: str | None, fmt: str) -> str:
    if value is None:
        return ""
    return ("~" if source == "predicted" else "") + format(value, fmt)


def full_depth_markdown(rows: list[dict[str, Any]], depth: dict[str, Any]) -> str:
    """The full-depth table: ``~`` marks a predicted figure, a plain one was measured at that depth."""
    lines = [
        f"At the full depth ({depth['full']} units = {depth['blocks']}; {depth['unit']}), fitted from depths "
        f"{depth['fit'][0]} and {depth['fit'][1]}; ~ = predicted, plain = measured.",
        "",
        "| workload | strategy | act. peak GiB | GiB per unit | pinned host GiB | step ms | vs none | "
        "measured / predicted |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    if depth.get("warning"):
        lines[1:1] = ["", f"Note: {depth['warning']}"]
    last = None
    passes = set()
    for r in rows:
        workload = r["workload"] if r["workload"] != last else ""
        last = r["workload"]
        if r["peak_gib"] is None:
            lines.append(f"| {workload} | {r['strategy']} | {r['status']} | | | | | |")
            continue
        peak = _figure(r["peak_gib"], r["peak_source"], ".2f")
        if r["peak_source"] == "predicted" and r.get("peak_fit") in ("forward", "backward"):
            passes.add(r["peak_fit"])
            peak += " †"
        growth = f"{r['growth_gib_per_unit']:.3f}" if r["growth_gib_per_unit"] is not None else ""
        check = f"{r['prediction_error'] + 1:.3f}" if r["prediction_error"] is not None else ""
        vs_none = f"{r['vs_none']:.2f}" if r["vs_none"] is not None else ""
        lines.append(
            f"| {workload} | {r['strategy']} | {peak} | {growth} | "
            f"{_figure(r['pinned_gib'], r['pinned_source'], '.1f')} | {_figure(r['step_ms'], r['step_source'], '.0f')} "
            f"| {vs_none} | {check} |"
        )
    unpredicted = [f"{r['strategy']} ({r['step_not_predicted']})" for r in rows if r.get("step_not_predicted")]
    if unpredicted:
        lines += ["", f"No step time predicted for {'; '.join(unpredicted)}: the deeper model ran no slower, so the "
                      "timing's noise was larger than what a unit of depth adds, and a line through the two would "
                      "predict the full model faster than either. Measure it at the full depth (--full-row) or at "
                      "deeper --depths, over more --steps."]
    if passes:
        which = " or ".join(f"the {p}" for p in sorted(passes))
        lines += ["", f"† predicted from {which} pass's own peak, which grows with depth faster than the whole "
                      "step's peak did between the fit depths: there the other pass set the peak (a fixed transient), "
                      "hiding what each block adds, or this pass's peak climbs over the first blocks and then stops "
                      "(Wan 2.1 14B's streamed unsloth-compile: predicted 2x what the full model used; advise and auto "
                      "measure such a row again deeper). Measure with --full where it fits."]
    return "\n".join(lines)


def to_markdown(rows: list[dict[str, Any]], *, cpu: bool = False) -> str:
    """The measured rows as a markdown table.

    ``cpu=True`` shows the MiB kept for backward instead of the GiB peak, each step time's spread
    (``(slowest - fastest) / median`` of its timed steps), and marks with ``*`` a ``vs none`` ratio
    that is within noise (:func:`noise`; :func:`cpu_noise_note` is the sentence that explains it):
    on a small or busy CPU the times scatter by more than the strategies differ.
    """
    memory = "kept for backward MiB (CPU)" if cpu else "act. peak GiB"
    step_col = "step ms (spread)" if cpu else "step ms"
    marks = noise(rows) if cpu else [None] * len(rows)
    with_depth = any(r.get("depth") is not None for r in rows)
    depth_col = " depth |" if with_depth else ""
    # the whole GPU's peak (weights included): what a smaller card must hold, shown where weights stream or a
    # row has a memory cap of its own
    with_gpu = any(STREAM_SUFFIX in r["strategy"] or CAP_SUFFIX in r["strategy"] or streams_weights(r.get("config"))
                   for r in rows)
    gpu_col = " GPU peak GiB |" if with_gpu else ""
    lines = [
        f"| workload |{depth_col} strategy | {memory} |{gpu_col} pinned host GiB | {step_col} | vs none | "
        "vs gradseam torch |",
        "|---|" + ("---:|" if with_depth else "") + "---|---:|" + ("---:|" if with_gpu else "") + "---:|---:|---:|---:|",
    ]
    last = None
    for r, mark in zip(rows, marks):
        workload = r["workload"] if r["workload"] != last else ""
        last = r["workload"]
        depth = f" {r.get('depth')} ({r.get('blocks')}) |" if with_depth else ""
        if r["status"] != "ok":
            lines.append(f"| {workload} |{depth} {r['strategy']} | {r['status']} |{' |' if with_gpu else ''} | | | |")
            continue
        vs_none = (f"{r['vs_none']:.2f}" + ("*" if mark else "")) if r["vs_none"] is not None else ""
        vs_torch = f"{r['vs_torch']:.3f}" if r["vs_torch"] is not None else ""
        peak = r["peak_gib"] * GiB / MiB if cpu else r["peak_gib"]
        timed = r.get("step_times_ms") or ()
        scatter = spread(timed)
        step = f"{r['step_ms']:.1f}"
        if cpu and scatter is not None:
            step += f" ({scatter:.0%})"
        elif cpu and len(timed) == 1:
            step += " (1 step)"  # no spread to show: one timed step
        pinned = f"{r['pinned_gib']:.2f}" if r.get("pinned_gib") is not None else ""
        gpu = (f" {r['gpu_peak_gib']:.2f} |" if r.get("gpu_peak_gib") is not None else " |") if with_gpu else ""
        lines.append(
            f"| {workload} |{depth} {r['strategy']} | {peak:.2f} |{gpu} {pinned} | {step} | {vs_none} | {vs_torch} |"
        )
    for note in (first_steps_note(rows), retries_note(rows)):
        if note:
            lines += ["", note]
    return "\n".join(lines)


# A compiled row's first step this many times its median is worth a line: a compile of a real model
# takes tens of seconds; a row whose graphs came from inductor's cache starts within a few steps.
SLOW_FIRST_STEP = 5.0


def first_steps_note(rows: list[dict[str, Any]]) -> str | None:
    """One line naming the compiled rows (those with ``first_step_ms``) whose first step took far longer
    than the rest, once per shape: what a user waits through before the table's step time applies."""
    slow = [r for r in rows if r.get("status") == "ok" and r.get("first_step_ms") and r.get("step_ms")
            and r["first_step_ms"] >= SLOW_FIRST_STEP * r["step_ms"]]
    if not slow:
        return None
    parts = []
    for r in slow:
        where = f" at depth {r['depth']}" if r.get("depth") is not None else ""
        parts.append(f"{r['strategy']}{where} {r['first_step_ms'] / 1000:.1f} s")
    return "First steps (compiling, once per shape and row; not in the step times above): " + "; ".join(parts) + "."


def retries_note(rows: list[dict[str, Any]]) -> str | None:
    """One line naming the rows whose timed steps made the caching allocator retry: each retry freed its cache and
    synchronized the device to find room, so those rows' steps ran slower and less evenly than their room allows
    (seen under a 16 GiB cap on an H100: two steps of five at ~1.8x the others)."""
    retried = [r for r in rows if r.get("status") == "ok" and r.get("alloc_retries")]
    if not retried:
        return None
    parts = []
    for r in retried:
        where = f" at depth {r['depth']}" if r.get("depth") is not None else ""
        steps = len(r.get("step_times_ms") or ())
        parts.append(f"{r['strategy']}{where} {r['alloc_retries']}" + (f" in {steps} steps" if steps else ""))
    return ("Allocator retries in the timed steps (each frees the allocator's cache and synchronizes the device to "
            "find room; those steps run slower and unevenly: give the row more room, e.g. a higher cap or more "
            "blocks streamed, with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True): " + "; ".join(parts) + ".")


def auto_plans_note(rows: list[dict[str, Any]]) -> str | None:
    """A line per ``auto`` row measured: how long its first step took (planning and all, ``first_step_ms``), where
    its costs came from, and the explicit keys that run the same plan without planning."""
    import json

    lines = []
    for r in rows:
        plan = r.get("plan")
        if not plan:
            continue
        where = f" at depth {r['depth']}" if r.get("depth") is not None else ""
        if r.get("first_step_ms") is None:  # the row failed after planning: what it ran, and its prediction
            lines.append(f"{r['strategy']}{where}: planned ({plan['source']} costs), then {r['status']}"
                         + (f" ({r['failure']})" if r.get("failure") else "") + f"; the plan: {plan['report']}; its "
                         f"keys: {json.dumps(plan['config'])}")
            continue
        lines.append(f"{r['strategy']}{where}: its first step planned ({plan['source']} costs) and took "
                     f"{r['first_step_ms'] / 1000:.1f} s; the same plan without planning: "
                     f"{json.dumps(plan['config'])}")
        said = plan.get("predicted")
        if said:  # how close the plan came, each measured figure against its prediction
            pairs = [("GPU peak", "gpu_gib", r.get("gpu_peak_gib"), "GiB"),
                     ("pinned host", "host_gib", r.get("pinned_gib"), "GiB"), ("step", "step_ms", r.get("step_ms"), "ms")]
            parts = [f"{what} {got:.2f} {unit} measured, {said[key]:.2f} predicted ({got / said[key] - 1:+.1%})"
                     for what, key, got, unit in pairs if got is not None and said.get(key)]
            if parts:
                lines.append(f"{r['strategy']}{where}: " + "; ".join(parts))
        ran = plan.get("checked")
        if ran:  # what the plan took when auto ran it on the whole model, before that first step
            lines.append(f"{r['strategy']}{where}: run on the whole model while planning: GPU peak {ran['gpu_gib']:.2f} "
                         f"GiB, pinned host {ran['host_gib']:.2f} GiB, step {ran['step_ms']:.2f} ms")
    return "\n".join(lines) or None


def _caps(rows: list[dict[str, Any]]) -> list[float]:
    """The GPU caps the rows' labels name (``"... @ 16GiB"``), in GiB, smallest first."""
    from .checks import parse_size

    found = set()
    for r in rows:
        _, sep, cap = r["strategy"].partition(CAP_SUFFIX)
        if sep:
            try:
                found.add(parse_size(cap))
            except ValueError:
                continue
    return sorted(found)


def _gpu_axis(rows: list[dict[str, Any]]) -> bool:
    """Whether a workload's chart shows the whole GPU's peak: where weights stream or a row has a cap of its own, the
    activations are not what must fit (a streamed row's 2 GiB of activations stand beside its resident weights and
    the blocks in flight), and every row has the figure."""
    relevant = any(STREAM_SUFFIX in r["strategy"] or CAP_SUFFIX in r["strategy"] or streams_weights(r.get("config"))
                   for r in rows)
    return relevant and all(r.get("gpu_peak_gib") is not None for r in rows)


def chart(rows: list[dict[str, Any]], path: Any, title: str = "gradseam bench", *, cpu: bool = False) -> bool:
    """Memory (x) vs step time (y), one point per strategy, one panel per workload; False without matplotlib.

    ``rows`` are measured rows or full-depth rows (``peak_source`` present): predicted points are
    drawn hollow. ``cpu=True``: x is the MiB autograd keeps for backward (``peak_gib`` of a CPU run). Where weights
    stream or rows are capped (:func:`_gpu_axis`), x is the whole GPU's peak, and each cap a dotted line: what a
    card of that size holds.
    """
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(1, max(1, len(workloads)), figsize=(7 * max(1, len(workloads)), 6), squeeze=False,
                             dpi=120)
    labels: list[tuple[Any, list[tuple[str, float, float]]]] = []
    for ax, workload in zip(axes[0], workloads):
        mine = [r for r in rows if r["workload"] == workload and r["peak_gib"] is not None and r["step_ms"]]
        failed = [r["strategy"] for r in rows if r["workload"] == workload and r["peak_gib"] is None]
        whole_gpu = not cpu and _gpu_axis(mine)
        predicted = False
        points = []
        for r in mine:
            ref = r["strategy"] == "none" or r["strategy"].startswith("ref:")
            color = "grey" if ref else "C0"
            guess = "predicted" in (r.get("peak_source"), r.get("step_source"))
            predicted |= guess
            x = r["peak_gib"] * GiB / MiB if cpu else r["gpu_peak_gib"] if whole_gpu else r["peak_gib"]
            ax.scatter(x, r["step_ms"], marker="s" if ref else "o", facecolors="none" if guess else color,
                       edgecolors=color)
            points.append((r["strategy"], x, r["step_ms"]))
        labels.append((ax, points))
        xs = [x for _, x, _ in points if x > 0]
        # Full-depth rows span 0.5 GiB (offloaded) to hundreds (no checkpointing): on a linear axis the
        # rows a user would pick share a sliver at the left, so a wide span is drawn on a log axis.
        wide = bool(xs) and max(xs) / min(xs) > 20
        if wide:
            from matplotlib.ticker import FuncFormatter, LogLocator

            ax.set_xscale("log")
            ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
        if whole_gpu:
            for cap in _caps(mine):
                ax.axvline(cap, color="C3", linestyle=":", linewidth=1)
                ax.annotate(f"{cap:g} GiB card", (cap, 0.0), xycoords=("data", "axes fraction"), xytext=(3, 4),
                            textcoords="offset points", fontsize=7, color="C3", rotation=90)
        what = ("kept for backward (MiB, CPU)" if cpu else
                "GPU peak, weights included (GiB)" if whole_gpu else "activation peak (GiB)")
        ax.set_xlabel(what + (", log scale" if wide else ""))
        ax.set_ylabel("step time (ms)")
        ax.set_title(workload + (" (hollow: predicted)" if predicted else ""), fontsize=9)
        ax.grid(alpha=0.3)
        if failed:
            ax.text(0.01, 0.01, "not shown: " + ", ".join(failed), transform=ax.transAxes, fontsize=7,
                    va="bottom", wrap=True)
    fig.suptitle(title)
    fig.tight_layout()
    for ax, points in labels:  # placed once the layout is final: they are laid out in pixels
        _label(ax, points)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# Rows often sit on top of each other (diffusers' flag and gradseam's torch are the same regions):
# labels are placed one by one at the first offset (right of the point, then left of it), stepping
# down and up a line at a time, whose box is clear of those already placed and inside the axes, so
# every name stays readable; where no place is clear, the least covered one. A moved label gets a
# thin leader.
_STEPS = [0] + [sign * k for k in range(1, 25) for sign in (-1, 1)]


def _label(ax: Any, points: list[tuple[str, float, float]], size: float = 7) -> None:
    ax.autoscale_view()
    pixel = ax.figure.dpi / 72  # pixels per point
    char, line = 0.62 * size * pixel, 1.35 * size * pixel  # a 7 pt character's mean width, a line's height
    placed: list[tuple[float, float, float, float]] = []
    frame = ax.get_window_extent()  # labels stay inside the axes, clear of the tick labels

    def covered(box: tuple[float, float, float, float]) -> float:
        return sum(max(0.0, min(box[2], b[2]) - max(box[0], b[0])) * max(0.0, min(box[3], b[3]) - max(box[1], b[1]))
                   for b in placed)

    for text, x, y in sorted(points, key=lambda p: (-p[2], p[1])):  # from the top: slow rows rarely crowd
        px, py = ax.transData.transform((x, y))
        width = char * len(text)
        home = (px + 4 * pixel, py + 3 * pixel)
        spots = [(left, home[1] + step * line) for step in _STEPS for left in (home[0], px - 4 * pixel - width)]
        boxes = [(left, bottom, left + width, bottom + line) for left, bottom in spots
                 if frame.x0 <= left and left + width <= frame.x1 and frame.y0 <= bottom and bottom + line <= frame.y1]
        box = next((b for b in boxes if not covered(b)), None) or min(boxes, key=covered, default=None)
        if box is None:  # wider than the axes: at the point, as matplotlib would
            box = (*home, home[0] + width, home[1] + line)
        placed.append(box)
        ax.annotate(text, (x, y), fontsize=size, xytext=((box[0] - px) / pixel, (box[1] - py) / pixel),
                    textcoords="offset points",
                    arrowprops={"arrowstyle": "-", "lw": 0.5, "color": "0.4"} if box[:2] != home else None)
