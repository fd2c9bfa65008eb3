"""Where a streamed step's time goes on the GPU: the compute stream's idle gaps, the host link's copies, the allocator.

The copy-stream model (:mod:`gradseam.tools.host_link`) explained a streamed Flux step on an H100 only with 1.5 ms a
streamed block added that it could not name; this script's profile named it (docs/benchmarks.md). This script runs one config (a row of bench, or a per-block plan's JSON)
on a real-size model under a memory cap and reports, for the timed steps: the step time, what the caching
allocator had to do (retries after a failed allocation, which free cached memory and synchronize the device;
``cudaMalloc``/``cudaFree`` calls), and from one profiled step (``torch.profiler``): how long the compute stream
sat idle in forward and in backward, how long copies ran host-to-device and device-to-host and how much of that
time both directions ran at once, and the longest idle gaps with the kernel after each.

    python docs/scripts/stream_profile.py --family flux --tokens 4096 --lora 16 --gpu-memory 16 \\
        --config docs/data/plans/flux-4k-16gib-stream30-by-size.json --json stream30.json

A CUDA device is required (the profile is of CUDA streams).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

import gradseam
from gradseam.tools import named_strategies
from gradseam.tools.bench import capped
from gradseam.tools.measure import forward_backward, measure
from gradseam.tools.workloads import build

ALLOCATOR = ("num_alloc_retries", "num_sync_all_streams", "num_device_alloc", "num_device_free", "num_ooms")


def _config(args: argparse.Namespace) -> dict[str, Any] | None:
    if args.config:
        return json.loads(Path(args.config).read_text())
    return named_strategies.rows(args.row)[0][1] or None


def _busy(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``intervals`` (start, end), merged and sorted."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _total(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Time (same unit) both merged interval lists cover."""
    i = j = 0
    both = 0.0
    while i < len(a) and j < len(b):
        both += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return both


def summarize(events: list[dict[str, Any]], backward_at: float) -> dict[str, Any]:
    """The profiled step from a Chrome trace's events: the compute stream is the one that ran the most kernel time;
    ``backward_at`` (trace microseconds, the backward's first kernel) splits forward from backward, and each idle gap
    counts in the pass of the kernel after it (the turnaround's, before the backward's first kernel, in backward)."""
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    copies = [e for e in events if e.get("cat") == "gpu_memcpy" and "dur" in e]
    by_stream: dict[Any, float] = {}
    for e in kernels:
        by_stream[e["args"].get("stream")] = by_stream.get(e["args"].get("stream"), 0.0) + e["dur"]
    compute = max(by_stream, key=by_stream.__getitem__)
    on_compute = sorted((e for e in kernels if e["args"].get("stream") == compute), key=lambda e: e["ts"])
    start, end = on_compute[0]["ts"], on_compute[-1]["ts"] + on_compute[-1]["dur"]
    gaps = []
    for before, after in zip(on_compute, on_compute[1:]):
        gap = after["ts"] - (before["ts"] + before["dur"])
        if gap > 0:
            gaps.append((gap, after["ts"], after["name"][:80]))
    idle_forward = sum(g for g, at, _ in gaps if at < backward_at) / 1e3
    idle_backward = sum(g for g, at, _ in gaps if at >= backward_at) / 1e3
    h2d = _busy([(e["ts"], e["ts"] + e["dur"]) for e in copies if "HtoD" in e["name"]])
    d2h = _busy([(e["ts"], e["ts"] + e["dur"]) for e in copies if "DtoH" in e["name"]])
    h2d_bytes = sum(e["args"].get("bytes", 0) for e in copies if "HtoD" in e["name"])
    d2h_bytes = sum(e["args"].get("bytes", 0) for e in copies if "DtoH" in e["name"])
    return {
        "gpu_span_ms": (end - start) / 1e3,
        "compute_kernel_ms": by_stream[compute] / 1e3,
        "compute_idle_forward_ms": idle_forward,
        "compute_idle_backward_ms": idle_backward,
        "h2d_ms": _total(h2d) / 1e3, "h2d_gib": h2d_bytes / 2**30,
        "d2h_ms": _total(d2h) / 1e3, "d2h_gib": d2h_bytes / 2**30,
        "both_directions_ms": _overlap(h2d, d2h) / 1e3,
        "longest_gaps": [{"ms": g / 1e3, "in": "forward" if at < backward_at else "backward", "before": name}
                         for g, at, name in sorted(gaps, reverse=True)[:12]],
        "gaps_over_100us": sum(1 for g, _, _ in gaps if g > 100),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="flux")
    parser.add_argument("--preset", default=None)
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--lora", type=int, default=16)
    parser.add_argument("--gpu-memory", type=float, default=None, help="GiB: the cap, as bench's --gpu-memory")
    parser.add_argument("--config", default=None, help="a config's JSON (a per-block plan); else --row")
    parser.add_argument("--row", default="unsloth-compile", help="a bench row's strategy, without '@ ...'")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--trace", type=Path, help="also write the profiled step's Chrome trace here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("stream_profile.py profiles CUDA streams: it needs a CUDA device.")
    work = build(args.family, args.preset, lora=args.lora)
    # bench's own step and timing protocol (the median of the timed steps, each pass's peak and time)
    step = forward_backward(work.model, work.inputs(args.tokens))
    config = _config(args)
    handle = gradseam.patch(work.model, config) if config else None
    result: dict[str, Any] = {"family": work.family.name, "tokens": args.tokens, "gpu_memory_gib": args.gpu_memory,
                              "config": args.config or args.row, "device": torch.cuda.get_device_name(),
                              "torch": torch.__version__, "gradseam": gradseam.__version__}
    try:
        with capped(args.gpu_memory):
            for _ in range(2):  # warm-ups (the first compiles), outside the allocator's count below
                step()
            before = torch.cuda.memory_stats()
            got = measure(step, steps=args.steps, warmup=0, engine=getattr(handle, "engine", None))
            after = torch.cuda.memory_stats()
            result["step_ms"] = got.step_ms
            result["step_times_ms"] = [round(t, 1) for t in got.step_times_ms]
            result["forward_ms"], result["backward_ms"] = got.forward_ms, got.backward_ms
            result["activation_peak_gib"] = got.peak_gib
            result["gpu_peak_gib"] = got.peak_gib + got.base_gib  # what the cap counts: weights, inputs and all
            result["pinned_gib"] = got.pinned_gib
            result["allocator_per_step"] = {k: (after.get(k, 0) - before.get(k, 0)) / args.steps for k in ALLOCATOR}
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=activities) as prof:
                with torch.profiler.record_function("gradseam_step"):
                    step()
                torch.cuda.synchronize()
    finally:
        if handle is not None:
            handle.remove()
    trace = Path(args.trace or "/tmp/stream_profile_trace.json")
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    # the backward's first kernel: the first GPU event launched from another thread than the first launch's (CUDA
    # backward runs on the autograd engine's device thread)
    runtime = sorted((e for e in events if e.get("cat") == "cuda_runtime"), key=lambda e: e["ts"])
    main_tid = runtime[0]["tid"]
    launcher = {e.get("args", {}).get("correlation"): e["tid"] for e in runtime}
    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy")), key=lambda e: e["ts"])
    backward_at = next((e["ts"] for e in gpu if launcher.get(e.get("args", {}).get("correlation"), main_tid)
                        != main_tid), float("inf"))
    result["profile"] = summarize(events, backward_at)
    result["cpu_top"] = [
        {"name": a.key[:80], "calls": a.count, "cpu_ms": a.self_cpu_time_total / 1e3}
        for a in sorted(prof.key_averages(), key=lambda a: a.self_cpu_time_total, reverse=True)[:15]]
    print(json.dumps({k: v for k, v in result.items() if k != "cpu_top"}, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
