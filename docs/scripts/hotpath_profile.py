"""Where the Python of a checkpointed step goes, per block: the hot-path profile of docs/benchmarks.md.

At short sequences a GPU step is bound by how fast Python launches kernels, so every microsecond a
backend spends per block call shows in the step time. This script runs each named row on a real-size
model (frozen weights, bf16) and reports, beside the step time, the Python that gradseam's own code
and ``torch.utils.checkpoint`` run per block and step (cProfile self time, over separate profiled
steps, so the timed steps are not slowed by the profiler).

    python docs/scripts/hotpath_profile.py --family flux --tokens 1024 --steps 5 --json hotpath.json

Runs on any device; the figures in docs/benchmarks.md are from the H200.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time
from collections.abc import Callable
from pathlib import Path

import torch

import gradseam
from gradseam.tools import named_strategies
from gradseam.tools.measure import default_loss, grad_leaves
from gradseam.tools.workloads import blocks, build

ROWS = ("none", "torch", "torch + attention kept", "torch, interval 2")
GRADSEAM = str(Path(gradseam.__file__).parent)
# where each slice of the profile comes from, by file: gradseam's runtime, torch's checkpoint, the
# Python dispatch/function modes (kept kernels), and autograd's saved-tensor hooks machinery
SLICES = {
    "gradseam": (GRADSEAM,),
    "checkpoint": ("torch/utils/checkpoint.py",),
    "modes": ("torch/utils/_python_dispatch.py", "torch/overrides.py", "torch/_ops.py"),
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _slices(profile: cProfile.Profile) -> dict[str, float]:
    stats = pstats.Stats(profile)
    out = dict.fromkeys(SLICES, 0.0)
    for (filename, _, _), (_, _, tottime, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        for name, parts in SLICES.items():
            if any(p in filename for p in parts):
                out[name] += tottime
    out["total"] = sum(v for _, (_, _, v, _, _) in stats.stats.items())  # type: ignore[attr-defined]
    return out


def _stepper(model: torch.nn.Module, inputs: dict) -> Callable[[], None]:
    """One training step on ``inputs``: gradients of the inputs that need them cleared, forward, backward."""
    leaves = grad_leaves(inputs)

    def step() -> None:
        for t in leaves:
            t.grad = None
        default_loss(model(**inputs)).backward()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="flux")
    parser.add_argument("--preset", default=None)
    parser.add_argument("--tokens", type=int, action="append")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--layers", type=int, default=None, help="keep the first N blocks of every list (a smoke test)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--row", action="append", help="a row by label (repeat; default: the four of the table)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    labels = args.row or list(ROWS)
    work = build(args.family, args.preset, device=args.device, layers=args.layers)
    device = work.device
    n_blocks = len(blocks(work.model, work.family))
    results = []
    for tokens in args.tokens or [1024]:
        step = _stepper(work.model, work.inputs(tokens))
        for label, config in named_strategies.rows(*labels):
            handle = gradseam.patch(work.model, config) if config else None
            try:
                for _ in range(2):  # warm-up: allocator, kernels chosen, anything memoised
                    step()
                _sync(device)
                times = []
                for _ in range(args.steps):
                    start = time.perf_counter()
                    step()
                    _sync(device)
                    times.append((time.perf_counter() - start) * 1e3)
                profile = cProfile.Profile()
                profile.enable()
                for _ in range(args.steps):
                    step()
                _sync(device)
                profile.disable()
            finally:
                if handle is not None:
                    handle.remove()
            per_block = {k: v / (args.steps * n_blocks) * 1e6 for k, v in _slices(profile).items()}
            row = {"tokens": tokens, "row": label, "step_ms": sorted(times)[len(times) // 2],
                   "step_times_ms": [round(t, 1) for t in times], "python_us_per_block": per_block}
            results.append(row)
            print(f"{tokens:>6} {label:<28} {row['step_ms']:8.1f} ms ({min(times):.0f}-{max(times):.0f})  " + "  ".join(
                f"{k} {v:7.1f} us" for k, v in per_block.items()), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"family": work.family.name, "preset": work.preset_name,
                                         "blocks": n_blocks, "device": str(device), "torch": torch.__version__,
                                         "gradseam": gradseam.__version__, "rows": results}, indent=1))


if __name__ == "__main__":
    main()
