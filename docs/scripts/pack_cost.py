"""The offload engine's CPU cost per saved tensor on a CUDA machine: what a compiled block pays to pack.

A compiled block hands autograd its saved tensors in one burst after its kernels are enqueued; the
offload engine packs each (a pinned buffer from the pool, the copy to host memory on a side stream,
the bookkeeping that brings it back). When a block's GPU work is a few milliseconds (Flux at 4k
tokens), that CPU time is what the GPU waits for. This script times only the CPU side: ``groups``
groups of ``tensors`` saved tensors each, packed as one burst per group, as ``unsloth-compile``
does per block, after a warm-up that fills the pinned pool. Run it against two installs of gradseam
(``PYTHONPATH``) to compare engines on one machine::

    python docs/scripts/pack_cost.py --groups 57 --tensors 15 --mib 4 --json pack-cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from gradseam.offload import OffloadEngine, host_store


def one_step(engine: OffloadEngine, batches: list[list[torch.Tensor]]) -> tuple[float, list[object]]:
    """Pack every batch as one group; the CPU seconds it took and what autograd would hold."""
    held: list[object] = []
    start = time.perf_counter()
    for batch in batches:
        with engine.group(hooks=False) as group:
            held.extend(engine.pack(group, t, set()) for t in batch)
    return time.perf_counter() - start, held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=57, help="groups a step (Flux dev: 19 + 38 blocks)")
    parser.add_argument("--tensors", type=int, default=15, help="saved tensors a group (a compiled Flux block: ~15)")
    parser.add_argument("--mib", type=float, default=4.0, help="size of each saved tensor")
    parser.add_argument("--steps", type=int, default=5, help="timed steps after one warm-up")
    parser.add_argument("--label", default="", help="what this install is (printed and written)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("pack_cost.py measures CUDA calls: run it on a CUDA machine")
    numel = int(args.mib * 2**20) // 2
    batches = [[torch.randn(numel, device="cuda", dtype=torch.bfloat16) for _ in range(args.tensors)]
               for _ in range(args.groups)]
    engine = OffloadEngine(host_store(12), min_bytes=0)
    times = []
    for step in range(args.steps + 1):
        torch.cuda.synchronize()
        seconds, held = one_step(engine, batches)
        torch.cuda.synchronize()
        del held
        if step:  # the first step fills the pinned pool
            times.append(seconds)
    per_tensor_us = [s / (args.groups * args.tensors) * 1e6 for s in times]
    result = {
        "label": args.label, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "groups": args.groups, "tensors": args.tensors, "mib": args.mib,
        "step_ms": [round(s * 1e3, 2) for s in times],
        "per_tensor_us_median": round(statistics.median(per_tensor_us), 1),
        "per_group_ms_median": round(statistics.median(times) / args.groups * 1e3, 3),
    }
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
